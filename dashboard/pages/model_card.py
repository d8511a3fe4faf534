"""What a board's model is, in a person's words: its name, size, whether it was instruction-tuned,
and the context it was trained for. Pure (no file is read): a card is found by the GGUF file name
a board reports in its heartbeats (``status["model"]``).

The packaged model is described exactly (its GGUF metadata: ``general.name`` "Gemma 3 270m",
``general.size_label`` 270M, no ``general.finetune``, so the pretrained base model;
``gemma3.context_length`` 32768; file type 15, Q4_K_M). Another GGUF gets what its file name says
(``-it``/``instruct``/``chat``: instruction-tuned; a size such as ``1b``; a quantization such as
``q8_0``), and "not known" for the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelCard:
    file: str  # the GGUF file name, as boards report it
    name: str  # what people call it
    parameters: str = ""  # e.g. "270M" ("" when not known)
    quantization: str = ""  # e.g. "Q4_K_M"
    file_mb: int | None = None  # the file's size
    instruction_tuned: bool | None = None  # None: not known
    context_length: int | None = None  # tokens it was trained for (a board may use fewer: its own context)
    known: bool = False  # described from its metadata, not guessed from its name

    @property
    def kind(self) -> str:
        if self.instruction_tuned is None:
            return "base or instruction-tuned: not known"
        return "instruction-tuned" if self.instruction_tuned else "base model (pretrained, not instruction-tuned)"

    def facts(self) -> list[str]:
        """The card's facts in order, each a short phrase (unknown ones left out)."""
        size = [f"{self.parameters} parameters"] if self.parameters else []
        file = [f"{self.quantization}{f', {self.file_mb} MB' if self.file_mb else ''}"] if self.quantization else []
        context = [f"trained context {self.context_length:,} tokens"] if self.context_length else []
        return size + file + [self.kind] + context

    def chat_expectation(self) -> str:
        """What to expect when this model is chatted with ("" when it was tuned for it)."""
        if self.instruction_tuned:
            return ""
        if self.instruction_tuned is None:
            return (
                f"{self.name} may be a base model (its file name does not say): a base model continues text rather than answering, "
                "so a chat may get echoes and loose continuations."
            )
        return (
            f"{self.name} is a base model, not instruction-tuned: it continues your text rather than answering it, so expect "
            "echoes and loose continuations. Text completion and MMLU questions suit it; for a chat, start the boards with an "
            "instruction-tuned GGUF (EDGECACHE_MODEL)."
        )


PACKAGED = ModelCard(
    file="gemma-3-270m-q4_k_m.gguf",
    name="Gemma 3 270M",
    parameters="270M",
    quantization="Q4_K_M",
    file_mb=253,  # 253,113,024 bytes
    instruction_tuned=False,
    context_length=32_768,
    known=True,
)
KNOWN = {PACKAGED.file: PACKAGED}

_TUNED = re.compile(r"(?:^|[-_.])(it|instruct|chat|sft|dpo|rlhf)(?:[-_.]|$)", re.I)
_SIZE = re.compile(r"(?:^|[-_.])(\d+(?:\.\d+)?)([mb])(?:[-_.]|$)", re.I)
_QUANT = re.compile(r"(?:^|[-_.])(i?q\d(?:_[a-z0-9]+)*|f16|bf16|f32)(?:[-_.]|$)", re.I)


def card_for(file_name: str) -> ModelCard:
    """The card of the GGUF ``file_name`` (a name seen in no heartbeat yet: "")."""
    file_name = (file_name or "").strip()
    if file_name in KNOWN:
        return KNOWN[file_name]
    stem = re.sub(r"\.gguf$", "", file_name, flags=re.I)
    size = _SIZE.search(stem)
    quant = _QUANT.search(stem)
    return ModelCard(
        file=file_name,
        name=stem or "not reported yet",
        parameters=f"{size.group(1)}{size.group(2).upper()}" if size else "",
        quantization=quant.group(1).upper() if quant else "",
        instruction_tuned=True if _TUNED.search(stem) else None,
    )

"""Anchor fine-tuning (seed 004) with the reference engine, exported back to a GGUF boards serve.

``python -m dashboard.lab.anchor_tune [--minutes 40] [--threads 1]`` writes
``$EDGECACHE_HOME/lab/anchor-tuned-<base>.gguf`` and a JSON record of what the tune reached
beside it. Steps:

1. Text: the Python language reference that ships with CPython (``pydoc_data.topics``): open
   text, no MMLU question in it. Prose paragraphs are unwrapped, code blocks dropped, and the
   text cut into sequences (``anchors.split_sequences``), each tokenized on its own as a board
   tokenizes a segmented prompt; documents are BOS + up to ``max_tokens`` tokens of
   consecutive sequences. The last topics are held out.
2. Model: the served GGUF in PyTorch (``reference``), with LoRA adapters (rank ``rank``) on
   every layer's q, k, v and output projections; the base weights stay frozen.
3. Objective: the student (LoRA, anchor mask) matches the base model's own next-token
   distribution with full attention (the teacher), KL(teacher || student) at sampled positions;
   in ``full_fraction`` of the steps the student attends fully too, so that the tuned model stays
   the base model where nothing is pruned (trained under the mask alone, it drifted: its first
   MMLU token agreed with the base model's on about a third of the prompts).
   The paper continues pre-training with the language-model loss on RedPajama; at a budget of
   tens of thousands of tokens, self-distillation asks for exactly what pruning needs (behave
   as if the dropped cells were there) without moving the model towards the tuning text.
4. Export: the adapters merged into the weights (W + scale B A), written as float32 tensors
   into a copy of the base GGUF (every other tensor byte for byte), then quantized by
   llama.cpp (``llama_model_quantize``) to the base file's own type mix (Q4_K_M here).

LoRA is a few lines here rather than ``peft``: the reference engine is a functional model
read from a GGUF, not the ``transformers`` module tree ``peft`` wraps.
Needs the lab extra (torch, gguf). Costs: one step (a 256-token document, 96 positions)
takes several seconds on one core; the export about 20 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from inference.engine.llama import Vocabulary, _quiet_llama
from inference.engine.model_file import ModelFile, _cached_sha256, resolve_model
from inference.lab.anchors import anchor_mask, sequence_spans, split_sequences, tuned_path
from inference.lab.kv_prediction import lab_dir

try:
    import gguf
    import torch
except ImportError as exc:  # pragma: no cover - depends on the optional extra
    raise ImportError("anchor tuning needs the lab extra: pip install -e '.[lab]' (torch, gguf)") from exc

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output")
SOURCE = "the Python language reference shipped with CPython (pydoc_data.topics)"
HELDOUT_TOPICS = 8


# -- text ---------------------------------------------------------------------------------------
def reference_paragraphs(topic_texts: Sequence[str]) -> list[str]:
    """Prose paragraphs of the reference: lines unwrapped, headings, underlines, code and grammar
    blocks (indented), and tables left out."""
    paragraphs = []
    for text in topic_texts:
        for block in re.split(r"\n\s*\n", text):
            lines = block.split("\n")
            if not lines or any(line.startswith((" ", "\t")) for line in lines):
                continue  # code, grammar, indented lists
            if len(lines) >= 2 and re.fullmatch(r"[*=\-~^+]+", lines[-1].strip() or "x"):
                continue  # a heading and its underline
            prose = " ".join(line.strip() for line in lines).strip()
            if len(prose) < 40 or prose.count("|") > 2:
                continue
            paragraphs.append(prose)
    return paragraphs


def tuning_documents(
    tokenize: Callable[[str, bool], list[int]], *, max_tokens: int = 256, heldout: bool = False, unit: str = "sentence"
) -> list[list[list[int]]]:
    """Documents as lists of token sequences (the first starts with BOS), from the reference's
    training topics or its held-out ones. ``tokenize(text, add_bos)``. ``unit``: "sentence"
    (``split_sequences``: sentences, anchors mostly on their full stop) or "paragraph" (each
    paragraph one sequence whose anchor is its blank line, as an MMLU demonstration's is)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    chosen = names[-HELDOUT_TOPICS:] if heldout else names[:-HELDOUT_TOPICS]
    paragraphs = reference_paragraphs([topics[name] for name in chosen])
    documents: list[list[list[int]]] = []
    current: list[list[int]] = []
    size = 0
    for paragraph in paragraphs:
        for text in split_sequences(paragraph + "\n\n") if unit == "sentence" else [paragraph + "\n\n"]:
            tokens = tokenize(text, not current)
            if len(tokens) > max_tokens // 2:
                continue  # a sentence too long to leave room for what follows it
            if size + len(tokens) > max_tokens and len(current) >= 2:
                documents.append(current)
                current, size = [], 0
                tokens = tokenize(text, True)
            current.append(tokens)
            size += len(tokens)
    if len(current) >= 2:
        documents.append(current)
    return documents


# -- LoRA ---------------------------------------------------------------------------------------
@dataclass
class LoRA:
    """Low-rank adapters on the reference engine's weight matrices: W x + scale B (A x)."""

    rank: int
    alpha: float
    a: dict[str, torch.Tensor] = field(default_factory=dict)  # (rank, in)
    b: dict[str, torch.Tensor] = field(default_factory=dict)  # (out, rank), zero at start
    enabled: bool = True

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def attach(
        cls, reference, rank: int = 16, alpha: float = 32.0, targets: Sequence[str] = TARGETS, seed: int = 0
    ) -> "LoRA":
        """Adapters for every layer's ``targets``, wired into ``reference.matmul``."""
        generator = torch.Generator().manual_seed(seed)
        lora = cls(rank, alpha)
        for layer in range(reference.config.n_layer):
            for target in targets:
                name = f"blk.{layer}.{target}.weight"
                out_features, in_features = reference._w[name].shape
                lora.a[name] = (
                    torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
                ).requires_grad_()
                lora.b[name] = torch.zeros(out_features, rank, requires_grad=True)
        base_matmul = reference.matmul

        def matmul(x: torch.Tensor, name: str) -> torch.Tensor:
            out = base_matmul(x, name)
            if lora.enabled and name in lora.a:
                out = out + (x @ lora.a[name].T) @ lora.b[name].T * lora.scale
            return out

        reference.matmul = matmul
        return lora

    def parameters(self) -> list[torch.Tensor]:
        return [*self.a.values(), *self.b.values()]

    def merged(self, reference) -> dict[str, np.ndarray]:
        """Every adapted weight with its adapter folded in (float32, numpy's (out, in) order)."""
        with torch.no_grad():
            return {
                name: (reference._w[name] + self.scale * self.b[name] @ self.a[name]).numpy().astype(np.float32)
                for name in self.a
            }

    def state(self) -> dict:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "a": {k: v.detach() for k, v in self.a.items()},
            "b": {k: v.detach() for k, v in self.b.items()},
        }

    def load_state(self, state: dict) -> None:
        with torch.no_grad():
            for name, value in state["a"].items():
                self.a[name].copy_(value)
            for name, value in state["b"].items():
                self.b[name].copy_(value)


def _forward(reference):
    """The reference engine's forward with autograd on (its public one runs in inference mode)."""
    from inference.lab.reference import ReferenceModel  # lazy: the reference engine needs the lab extra (torch)

    raw = ReferenceModel.forward.__wrapped__
    return lambda *args, **kwargs: raw(reference, *args, **kwargs)


def document_mask(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    spans = sequence_spans([len(tokens) for tokens in sequences])
    return torch.from_numpy(anchor_mask(spans, bos=True)), spans


def loss_positions(spans: Sequence[tuple[int, int]], count: int, rng: random.Random) -> list[int]:
    """Positions whose next-token distributions are compared: every position after the first
    sequence (there the mask hides the dropped cells), then sampled down to ``count``."""
    n = spans[-1][1]
    candidates = list(range(spans[0][1], n)) if len(spans) > 1 else list(range(1, n))
    if len(candidates) > count:
        candidates = sorted(rng.sample(candidates, count))
    return candidates


def distillation_loss(
    reference, lora: LoRA, sequences: Sequence[Sequence[int]], positions: Sequence[int], masked: bool = True
) -> torch.Tensor:
    """KL(base model, full attention || adapted model, anchor mask), mean over ``positions`` (nats).
    ``masked=False``: the adapted model with full attention too (it should stay the base model there)."""
    tokens = [token for part in sequences for token in part]
    mask = document_mask(sequences)[0] if masked else None
    lora.enabled = False
    with torch.no_grad():
        teacher = reference.forward(tokens, logits_at=list(positions)).logits
    lora.enabled = True
    student = _forward(reference)(tokens, logits_at=list(positions), mask=mask).logits
    log_p = torch.log_softmax(teacher, dim=-1)
    log_q = torch.log_softmax(student, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


@torch.no_grad()
def heldout_kl(
    teacher,
    student,
    documents,
    lora: LoRA | None = None,
    positions_per_doc: int = 96,
    seed: int = 1,
    masked: bool = True,
) -> float:
    """Mean KL(teacher, full attention || student, anchor mask) over held-out documents. The
    teacher is always the base model: ``lora`` (when the teacher carries the adapters) is turned
    off for its pass and on for the student's."""
    rng = random.Random(seed)
    values = []
    for sequences in documents:
        spans = sequence_spans([len(tokens) for tokens in sequences])
        positions = loss_positions(spans, positions_per_doc, rng)
        tokens = [token for part in sequences for token in part]
        mask, _ = document_mask(sequences)
        if lora is not None:
            lora.enabled = False
        log_p = torch.log_softmax(teacher.forward(tokens, logits_at=positions).logits, -1)
        if lora is not None:
            lora.enabled = True
        log_q = torch.log_softmax(
            student.forward(tokens, logits_at=positions, mask=mask if masked else None).logits, -1
        )
        values.append(float((log_p.exp() * (log_p - log_q)).sum(-1).mean()))
    return float(np.mean(values)) if values else float("nan")


# -- export -------------------------------------------------------------------------------------
def write_float_gguf(source: str | os.PathLike, target: str | os.PathLike, replaced: dict[str, np.ndarray]) -> Path:
    """A copy of ``source`` with the tensors in ``replaced`` written as float32 (every field and
    every other tensor byte for byte): the input of llama.cpp's quantizer."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(target), arch, endianess=reader.endianess)
    for name, found in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = found.types[0]
        sub_type = found.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, found.contents(), value_type, sub_type=sub_type)
    if reader.alignment:
        writer.data_alignment = reader.alignment
    for tensor in reader.tensors:
        if tensor.name in replaced:
            array = np.ascontiguousarray(replaced[tensor.name], dtype=np.float32)
            expected = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            if array.shape != expected:
                raise ValueError(f"{tensor.name}: replacement is {array.shape}, the model's tensor is {expected}")
            writer.add_tensor(tensor.name, array)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


ADAPTED_PATTERN = r"blk\.[0-9]+\.attn_(q|k|v|output)\.weight"


def quantize_like(
    source: str | os.PathLike,
    float_gguf: str | os.PathLike,
    target: str | os.PathLike,
    threads: int = 1,
    adapted_type: str | None = None,
) -> dict[str, str]:
    """Quantize ``float_gguf`` with llama.cpp to ``source``'s file type (token embedding kept at
    its type), into ``target``; ``adapted_type`` (e.g. "Q8_0") quantizes the adapted tensors to
    that type instead. Returns {tensor: "source type -> result type"} for every tensor whose
    type differs from ``source``'s (empty: the same mix)."""
    import llama_cpp

    _quiet_llama()
    reader = gguf.GGUFReader(str(source))
    types = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = int(reader.fields["general.file_type"].contents())
    if "token_embd.weight" in types:
        params.token_embedding_type = int(types["token_embd.weight"])
    params.allow_requantize = False  # untouched tensors are copied (same type), never quantized twice
    if adapted_type is not None:
        overrides = (llama_cpp.llama_model_tensor_override * 2)()
        overrides[0].pattern = ADAPTED_PATTERN.encode()
        overrides[0].type = int(gguf.GGMLQuantizationType[adapted_type])
        overrides[1].pattern = None  # the list ends here
        params.tt_overrides = overrides
    status = llama_cpp.llama_model_quantize(str(float_gguf).encode(), str(target).encode(), ctypes_byref(params))
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantize {float_gguf} (status {status})")
    result = {tensor.name: tensor.tensor_type for tensor in gguf.GGUFReader(str(target)).tensors}
    return {
        name: f"{types[name].name} -> {result.get(name).name if name in result else 'missing'}"
        for name in types
        if result.get(name) != types[name]
    }


def ctypes_byref(value):
    import ctypes

    return ctypes.byref(value)


def export_tuned(
    source: str | os.PathLike,
    target: str | os.PathLike,
    merged: dict[str, np.ndarray],
    threads: int = 1,
    adapted_type: str | None = None,
) -> dict:
    """Merged weights -> float GGUF -> quantized GGUF at ``target`` (atomically). Returns what happened
    (``type_changes``: how many tensors went from which type to which, against the base file)."""
    target = Path(target)
    float_path = target.with_name(target.name + f".{os.getpid()}.f32.partial")
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    started = time.perf_counter()
    try:
        write_float_gguf(source, float_path, merged)
        changed = quantize_like(source, float_path, partial, threads, adapted_type)
        os.replace(partial, target)
    finally:
        for leftover in (float_path, partial):
            leftover.unlink(missing_ok=True)
    transitions: dict[str, int] = {}
    for change in changed.values():
        transitions[change] = transitions.get(change, 0) + 1
    return {
        "path": str(target),
        "adapted_type": adapted_type or "as in the base model",
        "bytes": target.stat().st_size,
        "type_changes": transitions,
        "export_s": round(time.perf_counter() - started, 1),
    }


# -- the fine-tune ------------------------------------------------------------------------------
@dataclass
class TuneConfig:
    minutes: float = 40.0  # wall-time budget of the training loop
    max_steps: int = 100_000
    rank: int = 16
    alpha: float = 32.0
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    max_tokens: int = 256  # per document
    positions: int = 96  # compared positions per document
    heldout_documents: int = 8
    threads: int = 1
    seed: int = 0
    units: str = "both"  # sequences: "sentence", "paragraph" or "both" (every document cut both ways)
    full_fraction: float = 0.5  # steps whose student attends fully: the tuned model stays the base model there


def tune(
    model_path: str | os.PathLike,
    target: str | os.PathLike,
    config: TuneConfig = TuneConfig(),
    log: Callable[[str], None] = print,
    checkpoint: str | os.PathLike | None = None,
    resume: bool = False,
) -> dict:
    """Fine-tune LoRA adapters with the anchor mask for ``config.minutes``, export the tuned GGUF
    to ``target``; returns (and writes beside ``target``) the record of what it reached.
    ``resume``: start from the adapters saved at ``checkpoint`` (``max_steps=0``: export them)."""
    from inference.lab.reference import ReferenceModel  # lazy: the reference engine needs the lab extra (torch)

    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    rng = random.Random(config.seed)
    model = ModelFile(Path(model_path), _cached_sha256(Path(model_path)))
    vocabulary = Vocabulary.load(model)
    tokenize = lambda text, add_bos: vocabulary.tokenize(text, add_bos=add_bos)  # noqa: E731
    units = ("sentence", "paragraph") if config.units == "both" else (config.units,)
    train = [
        document for unit in units for document in tuning_documents(tokenize, max_tokens=config.max_tokens, unit=unit)
    ]
    heldout = [
        document
        for unit in units
        for document in tuning_documents(tokenize, max_tokens=config.max_tokens, heldout=True, unit=unit)[
            : config.heldout_documents // len(units)
        ]
    ]
    log(
        f"{len(train)} training documents ({sum(len(t) for d in train for t in d)} tokens), {len(heldout)} held out; from {SOURCE}"
    )
    reference = ReferenceModel.load(model.path, threads=config.threads)
    lora = LoRA.attach(reference, config.rank, config.alpha, seed=config.seed)
    previous = None
    if resume and checkpoint is not None and Path(checkpoint).exists():
        lora.load_state(torch.load(checkpoint))
        log(f"resumed the adapters saved at {checkpoint}")
        if record_path(target).exists():
            previous = json.loads(record_path(target).read_text())
            previous.pop("previous_phase", None)
    started = time.perf_counter()
    lora.enabled = False
    base_kl = heldout_kl(reference, reference, heldout)  # adapters off: the base model
    lora.enabled = True
    log(f"held-out KL(full || anchor mask), base model: {base_kl:.4f}")
    optimizer = torch.optim.AdamW(lora.parameters(), lr=config.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / config.warmup_steps))
    losses: list[float] = []  # under the anchor mask
    full_losses: list[float] = []  # with full attention
    tokens_seen = 0
    deadline = time.perf_counter() + config.minutes * 60
    order = list(range(len(train)))
    step = 0
    train_started = time.perf_counter()
    while step < config.max_steps and time.perf_counter() < deadline:
        if step % len(order) == 0:
            rng.shuffle(order)
        sequences = train[order[step % len(order)]]
        spans = sequence_spans([len(tokens) for tokens in sequences])
        positions = loss_positions(spans, config.positions, rng)
        masked = rng.random() >= config.full_fraction
        loss = distillation_loss(reference, lora, sequences, positions, masked=masked)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lora.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        (losses if masked else full_losses).append(float(loss.detach()))
        tokens_seen += spans[-1][1]
        step += 1
        if step % 5 == 0 or step == 1:
            elapsed = time.perf_counter() - train_started
            log(
                f"step {step}: KL under the mask, mean of the last 20: {np.mean(losses[-20:]) if losses else float('nan'):.4f}; with full attention: {np.mean(full_losses[-20:]) if full_losses else float('nan'):.4f}; {tokens_seen} tokens, {elapsed / step:.1f} s/step, {elapsed / 60:.1f} min"
            )
        if checkpoint is not None and step % 25 == 0:
            torch.save(lora.state(), checkpoint)
    train_s = time.perf_counter() - train_started
    if checkpoint is not None and step:
        torch.save(lora.state(), checkpoint)
    tuned_kl = heldout_kl(reference, reference, heldout, lora)
    drift_kl = heldout_kl(reference, reference, heldout, lora, masked=False)
    log(
        f"held-out KL(base || tuned), both with full attention: {drift_kl:.4f} (how far the tune moved the model where nothing is pruned)"
    )
    log(f"held-out KL(full || anchor mask), tuned (float): {tuned_kl:.4f} (base {base_kl:.4f})")
    # Quantizing to the base file's mix can round small adapter deltas away (Q5_0 q/k/v): export
    # that, and the adapted tensors at Q8_0, and serve the one that keeps more of the tune.
    merged = lora.merged(reference)
    variants = []
    for adapted_type in (None, "Q8_0"):
        path = target if adapted_type is None else target.with_name(target.stem + "-adapted-q8_0.gguf")
        exported = export_tuned(model.path, path, merged, threads=config.threads, adapted_type=adapted_type)
        quantized = ReferenceModel.load(path, threads=config.threads)
        exported["heldout_kl_masked"] = round(heldout_kl(reference, quantized, heldout, lora), 4)
        del quantized
        log(
            f"exported {path.name} ({exported['bytes'] / 1e6:.1f} MB, adapted tensors {exported['adapted_type']}) in {exported['export_s']} s: held-out KL under the anchor mask {exported['heldout_kl_masked']}"
        )
        variants.append(exported)
    best = min(variants, key=lambda variant: variant["heldout_kl_masked"])
    if best["path"] != str(target):
        os.replace(best["path"], target)
    for variant in variants:
        Path(variant["path"]).unlink(missing_ok=True) if variant["path"] != str(target) else None
        variant["served"] = variant is best
    best["path"] = str(target)
    quantized_kl = best["heldout_kl_masked"]
    record = {
        "method": f"LoRA self-distillation (teacher: the base model with full attention; student under the anchor mask, with full attention in {config.full_fraction:.0%} of the steps)",
        "source": SOURCE,
        "base_model": model.path.name,
        "base_sha256": model.sha256[:16],
        "targets": list(TARGETS),
        "rank": config.rank,
        "alpha": config.alpha,
        "learning_rate": config.learning_rate,
        "steps": step,
        "documents_seen": step,
        "tokens_seen": tokens_seen,
        "train_minutes": round(train_s / 60, 1),
        "seconds_per_step": round(train_s / max(step, 1), 2),
        "threads": config.threads,
        "units": config.units,
        "full_fraction": config.full_fraction,
        "train_kl_first20": round(float(np.mean(losses[:20])), 4) if losses else None,
        "train_kl_last20": round(float(np.mean(losses[-20:])), 4) if losses else None,
        "train_full_attention_kl_last20": round(float(np.mean(full_losses[-20:])), 4) if full_losses else None,
        "heldout_documents": len(heldout),
        "heldout_kl_base_masked": round(base_kl, 4),
        "heldout_kl_tuned_masked": round(tuned_kl, 4),
        "heldout_kl_tuned_full_attention": round(drift_kl, 4),
        "heldout_kl_tuned_quantized_masked": round(quantized_kl, 4),
        "exports": variants,
        "total_minutes": round((time.perf_counter() - started) / 60, 1),
    }
    if previous is not None:
        record["previous_phase"] = previous  # the run these adapters resumed from
    record_path(target).write_text(json.dumps(record, indent=2))
    return record


def record_path(target: str | os.PathLike) -> Path:
    return Path(target).with_suffix(".json")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dashboard.lab.anchor_tune",
        description="Anchor fine-tuning (seed 004): LoRA with the anchor mask, exported to GGUF",
    )
    parser.add_argument("--minutes", type=float, default=TuneConfig.minutes, help="training wall time (default 40)")
    parser.add_argument("--max-steps", type=int, default=TuneConfig.max_steps)
    parser.add_argument("--rank", type=int, default=TuneConfig.rank)
    parser.add_argument("--learning-rate", type=float, default=TuneConfig.learning_rate)
    parser.add_argument("--heldout-documents", type=int, default=TuneConfig.heldout_documents)
    parser.add_argument(
        "--units",
        choices=("sentence", "paragraph", "both"),
        default=TuneConfig.units,
        help="how the text is cut into anchored sequences (default both)",
    )
    parser.add_argument(
        "--full-fraction",
        type=float,
        default=TuneConfig.full_fraction,
        help="share of steps trained with full attention, so the tuned model stays the base model there (default 0.5)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads (default 1)")
    parser.add_argument(
        "--output", default=None, help="the tuned GGUF (default: $EDGECACHE_HOME/lab/anchor-tuned-<base>.gguf)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="start from the adapters saved beside the output (with --max-steps 0: only export them)",
    )
    parser.add_argument("--log", default=None, help="also append progress to this file")
    args = parser.parse_args(argv)
    model = resolve_model()
    target = Path(args.output) if args.output else tuned_path(lab_dir(), model.sha256)
    target.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(args.log, "a", buffering=1) if args.log else None

    def log(line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamped, flush=True)
        if log_file is not None:
            log_file.write(stamped + "\n")

    config = TuneConfig(
        minutes=args.minutes,
        max_steps=args.max_steps,
        rank=args.rank,
        learning_rate=args.learning_rate,
        threads=args.threads,
        heldout_documents=args.heldout_documents,
        units=args.units,
        full_fraction=args.full_fraction,
    )
    record = tune(model.path, target, config, log=log, checkpoint=target.with_suffix(".lora.pt"), resume=args.resume)
    log(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())

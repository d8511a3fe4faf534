"""Anchor tokens (seed 004, "Anchor-based Large Language Models") as a board strategy.

A prompt is a chain of sequences (an MMLU prompt's instruction and each demonstration, the
sentences or paragraphs of a text); the last token of each sequence is its **anchor**. Anchor
inference keeps, of every finished sequence, only the anchor's keys and values (and BOS, the
attention sink every Gemma prompt starts with), and drops the rest; the current sequence (the
question) is kept whole. A model fine-tuned with the anchor attention mask (``anchor_tune``)
learns to pack a sequence into its anchor; the base model was never asked to, so pruning it
(training-free) loses most of what the dropped cells held.

On llama.cpp the anchor mask is exact without a custom mask: sequences are prefilled one
after another, and after each one the cells between BOS and its anchor are removed
(``Engine.remove``, a position range of the main sequence). A later token then attends to
BOS, earlier anchors and its own sequence, which is the mask of ``anchor_mask`` below; cells
keep their positions (nothing is shifted), so each sequence continues at its anchor + 1 and
RoPE distances stay those of the full prompt. Gemma-3's sliding-window layers (window 512)
see only the kept cells inside their window, as they would in a full prompt: removal takes
the cells out of both the global and the sliding-window caches (the engine keeps every
position of the sliding-window layers, ``swa_full``), so no layer sees a dropped cell.

One difference from the paper's mask, on purpose: there an anchor attends only to its own
sequence; here anchors also see earlier anchors, because llama.cpp prefills a sequence's
anchor in the same batch as its other tokens. Training uses the same mask, so what the
fine-tune learns is what the board runs.

An anchor state is approximate: this strategy never reads or writes the cache box and clears
the context before and after each run, so no exact run can restore a pruned cell; the bytes an
anchor entry would move are measured by ``bench lab-anchors`` (``prefix_entry``).
Pure parts (sequences, spans, masks) need numpy only; serving needs llama.cpp.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from inference.engine.llama import MAIN_SEQ, Engine, EngineConfig
from inference.engine.model_file import ModelFile, _cached_sha256
from inference.serving.run import FirstToken, RunState, ServingStrategy, ms_since
from inference.serving.strategies import StrategySpec

from .kv_prediction import lab_dir

BASE = "anchors"  # the served model, pruned without training (expected to lose accuracy)
TUNED = "anchors-tuned"  # the anchor-tuned GGUF (``anchor_tune``), pruned
STRATEGIES = (BASE, TUNED)


class TunedModelMissing(ValueError):
    """No anchor-tuned GGUF for this base model in the lab directory (a ValueError: the run reports it)."""


def strategy_label(strategy: str) -> str:
    """The breakdown's ``strategy`` field: says the state was pruned to anchors, and by which model."""
    return "anchors(base)" if strategy == BASE else "anchors(tuned)"


def tuned_path(directory: str | Path, base_sha256: str) -> Path:
    """Where ``anchor_tune`` writes the anchor-tuned GGUF of a base model."""
    return Path(directory) / f"anchor-tuned-{base_sha256[:16]}.gguf"


# -- sequences, spans and masks (pure) ------------------------------------------------------------
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")
_BLANK_LINES = re.compile(r"(\n\s*\n)")


def split_sequences(text: str) -> list[str]:
    """``text`` cut into anchored sequences whose concatenation is ``text``: after every blank
    line (a paragraph keeps its blank line, so its anchor is the newline token, as an MMLU
    demonstration's is) and, inside a paragraph, after each sentence end (the space goes to the
    next sentence). A text with neither is one sequence."""
    pieces: list[str] = []
    parts = _BLANK_LINES.split(text)
    for index in range(0, len(parts), 2):
        paragraph = parts[index] + (parts[index + 1] if index + 1 < len(parts) else "")
        if not paragraph:
            continue
        cuts = [match.start() for match in _SENTENCE_END.finditer(paragraph)]
        start = 0
        for cut in cuts:
            pieces.append(paragraph[start:cut])
            start = cut
        pieces.append(paragraph[start:])
    return [piece for piece in pieces if piece]


def sequence_spans(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` token positions of consecutive sequences of ``lengths`` tokens."""
    spans, start = [], 0
    for length in lengths:
        if length < 1:
            raise ValueError("every sequence needs at least one token")
        spans.append((start, start + length))
        start += length
    return spans


def anchor_positions(spans: Sequence[tuple[int, int]]) -> list[int]:
    """The anchor (last token) of every sequence but the last (the current one is kept whole)."""
    return [end - 1 for _, end in spans[:-1]]


def kept_positions(spans: Sequence[tuple[int, int]], bos: bool) -> list[int]:
    """The positions anchor inference keeps: BOS, every earlier sequence's anchor, the last sequence."""
    kept = set(anchor_positions(spans))
    if bos and spans:
        kept.add(0)
    if spans:
        kept.update(range(*spans[-1]))
    return sorted(kept)


def pruned_ranges(spans: Sequence[tuple[int, int]], bos: bool) -> list[tuple[int, int]]:
    """The ``[p0, p1)`` ranges anchor inference removes: each finished sequence but its anchor
    (and BOS, in the first). Empty ranges are left out."""
    ranges = []
    for index, (start, end) in enumerate(spans[:-1]):
        first = start + 1 if index == 0 and bos else start
        if first < end - 1:
            ranges.append((first, end - 1))
    return ranges


def anchor_mask(spans: Sequence[tuple[int, int]], bos: bool = True, anchors_see_anchors: bool = True) -> np.ndarray:
    """(n, n) booleans, True where query i may attend key j: causal, and a token sees its own
    sequence, earlier sequences' anchors and BOS. ``anchors_see_anchors=False`` is the paper's
    mask to the letter (an anchor sees only its own sequence and BOS); the board's llama.cpp
    prefill gives the default."""
    n = spans[-1][1] if spans else 0
    sequence = np.empty(n, np.int64)
    for index, (start, end) in enumerate(spans):
        sequence[start:end] = index
    is_anchor = np.zeros(n, bool)
    is_anchor[[end - 1 for _, end in spans]] = True
    causal = np.tri(n, dtype=bool)
    same = sequence[:, None] == sequence[None, :]
    earlier_anchor = (sequence[None, :] < sequence[:, None]) & is_anchor[None, :]
    if not anchors_see_anchors:
        earlier_anchor &= ~is_anchor[:, None]
    allowed = same | earlier_anchor
    if bos and n:
        allowed[:, 0] = True
    return allowed & causal


# -- serving (llama.cpp) ------------------------------------------------------------------------
@dataclass
class AnchorPrefill:
    """What an anchor-pruned prefill left in the main sequence."""

    logits: np.ndarray  # after the prompt's last token (a copy)
    spans: list[tuple[int, int]]
    kept: int  # cells kept (BOS, anchors, the last sequence)
    removed: int  # cells removed


def prompt_sequences(engine: Engine, segments: Sequence[str]) -> list[list[int]]:
    """Token lists of the prompt's sequences: the given segments (an MMLU prompt's instruction,
    demonstrations and question), or, for a single text, ``split_sequences`` of it. Each is
    tokenized on its own (BOS before the first), as a segmented prompt is everywhere."""
    texts = list(segments) if len(segments) > 1 else split_sequences(segments[0]) if segments else []
    sequences = [engine.tokenize(text, add_bos=index == 0) for index, text in enumerate(texts)]
    return [tokens for tokens in sequences if tokens]


def anchor_prefill(engine: Engine, sequences: Sequence[Sequence[int]], seq: int = MAIN_SEQ) -> AnchorPrefill:
    """Prefill ``sequences`` one after another into the empty sequence ``seq``, removing each
    finished sequence's cells but its anchor (and BOS) before the next one starts: the anchor
    mask, exactly. Positions are never shifted."""
    lengths = [len(tokens) for tokens in sequences]
    spans = sequence_spans(lengths)
    bos = engine.bos is not None and bool(sequences) and sequences[0][:1] == [engine.bos]
    removed = 0
    logits = None
    for index, ((start, end), tokens) in enumerate(zip(spans, sequences)):
        last = index == len(spans) - 1
        out = engine.prefill(list(tokens), start, seq=seq, logits_at={end - 1} if last else frozenset())
        if last:
            logits = out[end - 1]
        else:
            first = start + 1 if index == 0 and bos else start
            if first < end - 1:
                engine.remove(seq, first, end - 1)
                removed += end - 1 - first
    return AnchorPrefill(logits, spans, kept=spans[-1][1] - removed if spans else 0, removed=removed)


def prefix_entry(engine: Engine, end: int, seq: int = MAIN_SEQ) -> list[bytes]:
    """The state of positions ``[0, end)`` of ``seq`` as an entry would hold it: llama.cpp state
    bytes of the cells that are there (a pruned prefix: BOS and anchors only), one blob per
    ``n_swa`` positions (a sliding-window cache exports only what its last position sees)."""
    step = engine.n_swa or end
    return [engine.export_range(p0, min(end, p0 + step), seq=seq) for p0 in range(0, end, step)]


@dataclass
class _Sequences:
    """A prompt as its anchored sequences' token lists."""

    sequences: list[list[int]]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.sequences)


class AnchorServing(ServingStrategy[_Sequences]):
    """Serves prompts on ``engine`` with anchor inference (labelled ``anchors(base)`` or ``anchors(tuned)``).

    An anchor state is never exchanged, and the context is cleared before and after each run."""

    approximate = True
    clears_context = True  # no exact run may keep or find pruned cells

    def __init__(self, engine: Engine, strategy: str = BASE, owns_engine: bool = False):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown anchor strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
        self.engine, self.strategy, self.owns_engine = engine, strategy, owns_engine
        self.label = strategy_label(strategy)

    @classmethod
    def open(cls, engine: Engine, strategy: str, lab_dir: str | Path) -> "AnchorServing":
        """The base strategy on the board's own engine; the tuned one on the anchor-tuned GGUF
        (a second, smaller llama.cpp context of the board's configuration)."""
        if strategy == BASE:
            return cls(engine, BASE)
        path = tuned_path(lab_dir, engine.model_file.sha256)
        if not path.exists():
            raise TunedModelMissing(
                f"no anchor-tuned model at {path}: make one with `python -m dashboard.lab.anchor_tune` (needs the lab extra)"
            )
        config = engine.config
        tuned = Engine(
            ModelFile(path, _cached_sha256(path)),
            EngineConfig(
                n_ctx=config.n_ctx,
                n_batch=config.n_batch,
                n_threads=config.n_threads,
                n_seq_max=2,
                kv_type=config.kv_type,
            ),
        )
        return cls(tuned, TUNED, owns_engine=True)

    def close(self) -> None:
        if self.owns_engine:
            self.engine.close()

    def prepare(self, run: RunState) -> _Sequences:
        """The prompt's sequences (one text, or its segments); a chat's ``tokens`` are one sequence: nothing to prune."""
        prompt = run.prompt
        return _Sequences(
            [list(prompt.tokens)] if prompt.tokens is not None else prompt_sequences(self.engine, prompt.segments)
        )

    def first_token(self, run: RunState, prompt: _Sequences) -> FirstToken:
        """The anchor-pruned prefill."""
        mark = time.perf_counter()
        done = anchor_prefill(self.engine, prompt.sequences)
        run.breakdown.prefill_ms = ms_since(mark)
        run.breakdown.state_bytes = int(done.kept * self.engine.state_bytes_per_token)  # the KV it keeps
        return FirstToken(done.logits, position=prompt.prompt_tokens)


def open_strategy(board, spec: StrategySpec) -> AnchorServing:
    """The board's anchor strategy ``spec.name`` (``anchors`` on its own engine; ``anchors-tuned``
    loads the anchor-tuned GGUF from ``$EDGECACHE_HOME/lab`` on first use). Never reads or writes
    the cache box."""

    return board.opened(spec, lambda: AnchorServing.open(board.engine, spec.name, lab_dir()))

"""What every serving strategy shares: the result of a run, prompt errors, the decode loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .breakdown import Breakdown, CacheBoxState, Decision
from .engine import Engine
from .messages import StoredEntry
from .sampling import TOP_CANDIDATES, SamplingParams, choose


class PromptError(ValueError):
    """A prompt that cannot be run as given; the message says what to change."""


def ms_since(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def prompt_segments(prompt, max_tokens: int, tokens=None) -> list[str]:
    """A prompt (a string, or its segments in order) as segments; PromptError when it is empty
    (unless its ``tokens`` are given) or asks for no tokens."""
    segments = [prompt] if isinstance(prompt, str) else list(prompt)
    if tokens is None and (not segments or not "".join(segments).strip()):
        raise PromptError("the prompt is empty: give it some text")
    if max_tokens < 1:
        raise PromptError("max_tokens must be at least 1")
    return segments


def segment_tokens(vocabulary, segments: Sequence[str]) -> tuple[list[int], list[int]]:
    """Token ids of a prompt given as segments, and the index where each segment ends. Each
    segment is tokenized on its own (BOS before the first), so its tokens, and its cache key, do
    not depend on the text that follows it."""
    tokens: list[int] = []
    ends: list[int] = []
    for index, segment in enumerate(segments):
        tokens += vocabulary.tokenize(segment, add_bos=index == 0)
        ends.append(len(tokens))
    return tokens, ends


def approximate_breakdown(strategy: str) -> Breakdown:
    """The breakdown of a lab (approximate) run: labelled, and never reading or writing the cache box."""
    breakdown = Breakdown(strategy=strategy)
    breakdown.cache_off(CacheBoxState.OFF, Decision.NO_CACHE)
    return breakdown


def context_error(prompt_tokens: int, max_tokens: int, n_ctx: int) -> PromptError:
    return PromptError(
        f"the prompt has {prompt_tokens} tokens and {max_tokens} more were asked for, but the "
        f"context holds {n_ctx}; shorten the prompt, ask for fewer tokens, or raise EDGECACHE_N_CTX on the board"
    )


@dataclass
class RunResult:
    text: str
    tokens: list[int]
    breakdown: Breakdown
    # Cache-box entries this run used and stored, for the control plane's mirror.
    fetched: list[str] = field(default_factory=list)
    uploaded: list[StoredEntry] = field(default_factory=list)
    modules_hit: list[str] | None = None  # schema runs: the modules served from the cache box

    def as_dict(self) -> dict:
        extra = {"modules_hit": self.modules_hit} if self.modules_hit is not None else {}
        return {"text": self.text, **self.breakdown.as_dict(), **extra}


# Called with each answer token as it is chosen (the first one too) and the text it adds; returning
# False stops the generation there (a client that went away). Streaming builds on it.
OnToken = Callable[[int, str], bool]


class _TextPieces:
    """The text each new token adds (multi-byte characters complete once their last byte arrives)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.engine.detokenize(self.tokens)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the rest
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece


def decode_answer(
    engine: Engine,
    token: int,
    position: int,
    max_tokens: int,
    sampling: SamplingParams,
    rng,
    breakdown: Breakdown,
    started: float,
    top: int = TOP_CANDIDATES,
    on_token: OnToken | None = None,
) -> tuple[list[int], str]:
    """Decode the answer after its first token (R-decode + Sample), stopping at end of generation.

    Fills ``decode_ms``, ``sample_ms``, ``ttlt_ms``, ``generated_tokens`` and the time between
    answer tokens (``tbt_p50_ms``, ``tbt_p99_ms``: from one token chosen to the next, the
    ``on_token`` hook included, as a streaming client sees them); returns the answer's tokens
    (without the end-of-generation token) and its text. ``on_token`` sees each token as it is
    chosen and may stop the generation.
    """
    generated = [token]
    between: list[float] = []  # ms from one answer token chosen to the next
    pieces = _TextPieces(engine) if on_token is not None else None
    going = True
    if pieces is not None and not engine.is_end_of_generation(token):
        going = on_token(token, pieces.add(token)) is not False
    last = time.perf_counter()
    while going and len(generated) < max_tokens and not engine.is_end_of_generation(token):
        mark = time.perf_counter()
        logits = engine.decode_one(token, position)
        breakdown.decode_ms += ms_since(mark)
        position += 1
        mark = time.perf_counter()
        token = choose(logits, sampling, rng, top)
        breakdown.sample_ms += ms_since(mark)
        generated.append(token)
        if engine.is_end_of_generation(token):
            break  # not an answer token: no time between tokens to count
        if pieces is not None:
            going = on_token(token, pieces.add(token)) is not False
        now = time.perf_counter()
        between.append((now - last) * 1000.0)
        last = now
    breakdown.ttlt_ms = ms_since(started)
    if between:
        breakdown.tbt_p50_ms, breakdown.tbt_p99_ms = (float(value) for value in np.percentile(between, [50, 99]))
    if engine.is_end_of_generation(generated[-1]):
        generated.pop()
    breakdown.generated_tokens = len(generated)
    return generated, engine.detokenize(generated)

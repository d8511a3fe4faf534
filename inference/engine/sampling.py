"""Choosing the next token from logits. Pure numpy, testable without a model.

Sampling always works on the ``TOP_CANDIDATES`` most likely tokens, whether the
logits come from a fresh decode or from the top logits stored with a cache entry,
so a full hit samples from exactly the distribution a cold run would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP_CANDIDATES = 64


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (the default, as in the paper)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 1:
            raise ValueError("top_k must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_candidates(logits: np.ndarray, count: int = TOP_CANDIDATES) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, logits) of the ``count`` largest logits, best first. Ties: lower id first."""
    count = min(count, logits.shape[0])
    part = np.argpartition(-logits, count - 1)[:count]
    order = np.lexsort((part, -logits[part]))
    ids = part[order].astype(np.int32)
    return ids, logits[ids].astype(np.float32)


def sample(ids: np.ndarray, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None = None) -> int:
    """Pick one token among candidates ``ids`` (best first) with their ``logits``."""
    if ids.size == 0:
        raise ValueError("no candidate tokens to sample from")
    if params.greedy:
        best = np.flatnonzero(logits == logits.max())
        return int(ids[best].min())
    keep = min(params.top_k, ids.size)
    order = np.argsort(-logits, kind="stable")[:keep]
    scaled = logits[order].astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    cumulative = np.cumsum(probs)
    # min(): a cumulative sum that float rounding leaves just under top_p (1.0 above all) keeps all.
    cutoff = min(keep, int(np.searchsorted(cumulative, params.top_p) + 1))
    probs = probs[:cutoff] / probs[:cutoff].sum()
    rng = rng or np.random.default_rng(params.seed)
    return int(ids[order[rng.choice(cutoff, p=probs)]])


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, count: int = TOP_CANDIDATES) -> int:
    """The next token from a full row of logits (greedy: argmax, whose first maximum is the lowest id)."""
    if params.greedy:
        return int(np.argmax(logits))
    ids, values = top_candidates(logits, count)
    return sample(ids, values, params, rng)

"""Break-even arithmetic: when does fetching a state beat recomputing it? Pure functions.

Fits straight lines to a device's own measurements: prefill time against the tokens
prefilled, and fetch + restore time against the tokens fetched. Where the lines cross
is the prompt length from which fetching wins on that board and link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class LinearFit:
    slope: float  # ms per token
    intercept: float  # ms
    points: int

    def predict(self, tokens: float) -> float:
        return self.intercept + self.slope * tokens


def fit_line(xs: Iterable[float], ys: Iterable[float]) -> LinearFit | None:
    """Least-squares line through (x, y); None with fewer than two distinct x."""
    pairs = [(float(x), float(y)) for x, y in zip(xs, ys)]
    if len({x for x, _ in pairs}) < 2:
        return None
    n = len(pairs)
    mean_x = sum(x for x, _ in pairs) / n
    mean_y = sum(y for _, y in pairs) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in pairs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in pairs)
    slope = sxy / sxx
    return LinearFit(slope, mean_y - slope * mean_x, n)


@dataclass(frozen=True)
class Crossover:
    tokens: float | None  # prompt length where both cost the same (None: they never cross)
    fetch_wins_above: bool  # True: fetching is cheaper for longer prompts than ``tokens``

    def describe(self) -> str:
        if self.tokens is None:
            return "fetching always wins" if self.fetch_wins_above else "recomputing always wins"
        side = "from" if self.fetch_wins_above else "below"
        return f"fetching wins {side} {self.tokens:.0f} tokens"


def crossover(prefill: LinearFit, fetch: LinearFit) -> Crossover:
    """Where ``fetch`` (ms for t tokens fetched) stops or starts beating ``prefill``."""
    slope_gap = prefill.slope - fetch.slope
    if abs(slope_gap) < 1e-12:
        return Crossover(None, fetch.intercept < prefill.intercept)
    tokens = (fetch.intercept - prefill.intercept) / slope_gap
    fetch_wins_above = slope_gap > 0
    if tokens <= 0:
        return Crossover(None, fetch_wins_above)
    return Crossover(tokens, fetch_wins_above)


@dataclass(frozen=True)
class BreakEvenPoints:
    prefill: list[tuple[int, float]]  # (tokens prefilled, prefill_ms)
    fetch: list[tuple[int, float]]  # (tokens fetched, redis_ms = fetch + restore)


def points_from_breakdowns(breakdowns: Iterable[dict]) -> BreakEvenPoints:
    """Measured points of a device's runs (breakdown dicts as stored)."""
    prefill, fetch = [], []
    for b in breakdowns:
        computed = b.get("prompt_tokens", 0) - b.get("matched_tokens", 0)
        if computed > 0 and b.get("prefill_ms", 0) > 0:
            prefill.append((computed, float(b["prefill_ms"])))
        if b.get("matched_tokens", 0) > 0:
            fetch.append((b["matched_tokens"], float(b.get("redis_ms", 0.0))))
    return BreakEvenPoints(prefill, fetch)

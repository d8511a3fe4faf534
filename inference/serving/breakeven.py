"""Break-even arithmetic: when does fetching a state beat recomputing it? Pure functions.

Fits straight lines to a device's own measurements: prefill time against the tokens
prefilled, and fetch + restore time against the tokens fetched. Where the lines cross
is the prompt length from which fetching wins on that board and link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from cachebox.link import LinkProfile


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
    """Measured points of a device's runs (breakdown dicts as stored): prefill against the tokens
    computed, and fetch + restore against the tokens fetched from the cache box. Restores from the
    board's own context, RAM or flash tier (no byte over the link) are no fetch: left out."""
    prefill, fetch = [], []
    for b in breakdowns:
        computed = b.get("prompt_tokens", 0) - b.get("matched_tokens", 0)
        if computed > 0 and b.get("prefill_ms", 0) > 0:
            prefill.append((computed, float(b["prefill_ms"])))
        fetched = _fetched_tokens(b)
        if fetched > 0:
            fetch.append((fetched, float(b.get("redis_ms", 0.0))))
    return BreakEvenPoints(prefill, fetch)


def _fetched_tokens(b: dict) -> int:
    """Prompt tokens a run fetched from the cache box. Runs recorded before boards counted them
    (no ``fetched_tokens``): their matched tokens, unless a board-local tier served them or no
    byte was fetched."""
    if "fetched_tokens" in b:
        return int(b.get("fetched_tokens") or 0)
    if b.get("tier") in ("context", "local", "flash") or b.get("fetched_bytes", 1) == 0:
        return 0
    return int(b.get("matched_tokens") or 0)


def overlap_ms(tokens: float, prefill: LinearFit, fetch: LinearFit) -> float:
    """Time to have ``tokens`` in the context when the front is computed while the back loads,
    both meeting where they finish together (prefill through the origin, fetch with its fixed
    cost): ``min over s of max(prefill(s), fetch(tokens - s))``. Pure."""
    if tokens <= 0:
        return 0.0
    a, b, c = prefill.slope, fetch.intercept, fetch.slope
    if a <= 0:
        return 0.0
    if a * tokens <= b or a + c <= 0:  # computing it all is done before the first byte would arrive
        return a * tokens
    split = (b + c * tokens) / (a + c)
    return a * min(split, tokens)


# -- the per-request policy ------------------------------------------------------------------
POLICIES = ("adaptive", "always", "never")


@dataclass(frozen=True)
class Range:
    """One cached range a fetch may load: ``[start, end)`` and the bytes that would cross the link."""

    start: int
    end: int
    stored_bytes: int


@dataclass(frozen=True)
class FetchPlan:
    """How one request gets the cached ranges ``[floor, end)`` into its context.

    ``split == floor``: load them all (the board waits, up to the deadline). ``floor < split <
    end``: compute ``[floor, split)`` while ``[split, end)`` loads back to front; the two meet
    wherever they really do. ``fetch`` False: compute everything.
    ``arrivals_ms``: when each range is forecast to have arrived, in load order (back to front),
    from the request's start; a range later than ``deadline(index)`` is given up on.
    """

    fetch: bool
    split: int
    predicted_ms: float  # this plan's forecast for [floor, end)
    predicted_fetch_ms: float  # loading all of [floor, end)
    predicted_prefill_ms: float  # computing all of [floor, end): what a fetch saves
    arrivals_ms: tuple[float, ...] = ()
    slack: float = 0.5  # a range may be this much later than forecast (relative) ...
    slack_ms: float = 25.0  # ... plus this much, before the board computes instead of waiting

    def deadline_ms(self, index: int) -> float | None:
        """The latest time (ms from the start) to wait for the ``index``-th range in load order."""
        if index >= len(self.arrivals_ms):
            return None
        return self.arrivals_ms[index] * (1 + self.slack) + self.slack_ms


class OnlineFit:
    """A board's most recent measurements (bounded window) and the line through them.

    ``fixed_ms`` is the cost at zero size (a round trip, say): the line is fitted as
    ``fixed_ms + slope * x`` with only the slope learned. A free intercept fitted to points
    bunched in a narrow range (prompts of similar length) extrapolates wildly, even below
    zero, to short ranges; a rate does not.
    """

    def __init__(self, window: int = 64, fixed_ms: float = 0.0):
        self.window = window
        self.fixed_ms = fixed_ms
        self.points: list[tuple[float, float]] = []

    def add(self, x: float, y: float) -> None:
        self.points.append((float(x), float(y)))
        del self.points[: -self.window]

    def fit(self) -> LinearFit | None:
        if len(self.points) < 2:
            return None
        sxx = sum(x * x for x, _ in self.points)
        sxy = sum(x * (y - self.fixed_ms) for x, y in self.points)
        if sxx <= 0 or sxy <= 0:
            return None  # too noisy to trust yet
        return LinearFit(sxy / sxx, self.fixed_ms, len(self.points))


@dataclass(frozen=True)
class Decision:
    fetch: bool
    predicted_fetch_ms: float
    predicted_prefill_ms: float  # the prefill the fetch would save


class BreakEvenPolicy:
    """Decides per request whether fetching cached tokens beats prefilling them, on this board.

    Prefill time is modelled against tokens and fetch + restore time against bytes, each a
    line fitted to the board's own recent runs. Until there are points, priors stand in:
    a prefill rate measured when the board starts and the link profile (round trip +
    bytes / bandwidth) plus restore at memory speed. A fetch happens only when it is
    predicted to win by ``margin`` (relative) and ``margin_ms`` (absolute).
    """

    def __init__(
        self,
        *,
        prefill_ms_per_token: float = 3.0,
        link: "LinkProfile | None" = None,
        restore_bytes_per_ms: float = 1e6,
        margin: float = 0.05,
        margin_ms: float = 1.0,
        mode: str = "adaptive",
        overlap: bool = True,
    ):
        if mode not in POLICIES:
            raise ValueError(f"unknown policy {mode!r}; choose one of {', '.join(POLICIES)}")
        self.mode = mode
        self.overlap = overlap  # may compute the front of a prompt while the back loads
        self.prior_prefill = prefill_ms_per_token
        self.link = link
        self.restore_bytes_per_ms = restore_bytes_per_ms
        self.margin = margin
        self.margin_ms = margin_ms
        self.prefill = OnlineFit()
        self.fetch = OnlineFit(fixed_ms=(link.rtt_ms if link else 0.0) + 0.5)  # one request per range

    def predict_prefill_ms(self, tokens: int) -> float:
        line = self.prefill.fit()
        return max(0.0, line.predict(tokens) if line else self.prior_prefill * tokens)

    def predict_fetch_ms(self, size_bytes: int) -> float:
        line = self.fetch.fit()
        if line:
            return max(0.0, line.predict(size_bytes))
        transfer = self.link.transfer_ms(size_bytes, round_trips=2) if self.link else 1.0
        return transfer + size_bytes / self.restore_bytes_per_ms

    def decide(self, tokens_saved: int, size_bytes: int) -> Decision:
        fetch_ms, prefill_ms = self.predict_fetch_ms(size_bytes), self.predict_prefill_ms(tokens_saved)
        if self.mode == "always":
            return Decision(True, fetch_ms, prefill_ms)
        if self.mode == "never":
            return Decision(False, fetch_ms, prefill_ms)
        return Decision(fetch_ms * (1 + self.margin) + self.margin_ms < prefill_ms, fetch_ms, prefill_ms)

    def predict_range_ms(self, stored_bytes: int) -> float:
        """One range fetched on its own (one request) and restored."""
        line = self.fetch.fit()
        if line:
            return max(0.0, line.predict(stored_bytes))
        transfer = self.link.transfer_ms(stored_bytes, round_trips=1) if self.link else 0.5
        return transfer + stored_bytes / self.restore_bytes_per_ms

    def plan(self, floor: int, ranges: Sequence[Range]) -> FetchPlan:
        """Compute, load, or both, for the cached ranges ``ranges`` (front to back, contiguous from
        ``floor``). Pure arithmetic over the fitted rates; the loads are one request per range,
        back to front, so the front can be computed meanwhile."""
        if not ranges:
            return FetchPlan(False, floor, 0.0, 0.0, 0.0)
        end = ranges[-1].end
        compute_all = self.predict_prefill_ms(end - floor)
        per_range = [self.predict_range_ms(r.stored_bytes) for r in ranges]
        arrivals, total = [], 0.0
        for cost in reversed(per_range):
            total += cost
            arrivals.append(total)
        load_all = total
        if self.mode == "never":
            return FetchPlan(False, floor, compute_all, load_all, compute_all)
        if self.mode == "always":
            return FetchPlan(True, floor, load_all, load_all, compute_all)  # waits for every range: no deadline
        best_split, best = floor, load_all
        if self.overlap:
            # Split at each range start: the front computed, the ranges from there loaded.
            for index in range(1, len(ranges)):
                split = ranges[index].start
                loaded = arrivals[len(ranges) - index - 1]
                cost = max(self.predict_prefill_ms(split - floor), loaded)
                if cost < best:
                    best_split, best = split, cost
        fetch = best * (1 + self.margin) + self.margin_ms < compute_all
        # Waiting past the forecast by one batch's compute (or 25 ms) before computing: a batch once
        # started cannot stop, so starting one for a range that is merely a little late loses time.
        batch_ms = self.predict_prefill_ms(max(r.end - r.start for r in ranges))
        return FetchPlan(
            fetch,
            best_split if fetch else floor,
            best if fetch else compute_all,
            load_all,
            compute_all,
            tuple(arrivals),
            slack_ms=max(25.0, batch_ms),
        )

    def observe_prefill(self, tokens: int, ms: float) -> None:
        if tokens > 0 and ms > 0:
            self.prefill.add(tokens, ms)

    def observe_fetch(self, size_bytes: int, ms: float) -> None:
        if size_bytes > 0 and ms > 0:
            self.fetch.add(size_bytes, ms)

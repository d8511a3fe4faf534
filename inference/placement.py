"""Cache-aware routing: which board should answer a prompt sent to "any board".

The router picks, among the online boards, the one with the lowest expected time to first
token::

    expected = queued work (runs dispatched to it and not yet reported, less what the
               board has already spent on the one it is running)
             + prefill of the tokens it does not hold, at its rate
             (+ fetching what the cache box holds, at its link's cost, when that is cheaper)

A board's rate is the median of its recent runs' rates (the last ``RATE_SAMPLES``, and only those
younger than ``RATE_MAX_AGE_S``: a board that had a slow spell is tried again once it is over);
without any, the rate it measured when it started (``inference.board.runtime.calibrate``, reported
in its heartbeats); the fleet-wide prior only for a board that reported neither (an older board).
A dispatched run's expected work is what it costs on its board: the prefill of what the board will
not hold, then its answer.

What a board holds is approximated from routing history, as Dynamo's KV router does in its
approximate mode: a board processes its queue in order, so when a new prompt reaches the
engine its context holds the prompt dispatched to it just before, and its RAM tier the
ranges of the prompts before that, newest first, as far as its budget goes. Prompts are
compared by their prefix keys on the 128-token grid (``cachebox.keys``): the longest shared
prefix is the last boundary whose key a board holds, because each key pins every token
before it.

Pure: no I/O, no Django. The control plane (``dashboard.router``) and ``bench fleet`` feed
the same ``FleetIndex`` and call the same ``route``.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from cachebox.keys import off_grid, prefix_keys, range_boundaries
from cachebox.link import LinkProfile
from inference.serving.breakdown import Tier

DEFAULT_PREFILL_MS_PER_TOKEN = 3.0  # a board that reported neither runs nor measured rates (BoardConfig's prior too)
DEFAULT_DECODE_MS_PER_TOKEN = 10.0
DEFAULT_BYTES_PER_TOKEN = 18_500.0  # Gemma-3 270M, f16 KV: what one cached token moves
RAM_RESTORE_MS_PER_TOKEN = 0.007  # copy a RAM-tier entry into the context (bench tiers: 7.3 ms for ~450 tokens)
LOOPBACK = LinkProfile(4000.0, 0.5, "unshaped")  # a cache box on an unshaped link (bench tiers: 8.5 MB in ~20 ms)
HISTORY = 32  # prompts remembered per board
RATE_SAMPLES = 16  # runs a learned rate is the median of
# ... and how old they may be (seconds). A rate is learned only from runs a board gets, and the router
# sends none to a board whose rate looks slow: on ``make run``, 16 runs of pi5 slowed down by compile
# jobs (decode ~500 ms a token, 17.6 measured at start) sent every later run to the paced zero board,
# and pi5 never had a run again to show it was fast. Once its samples are this old the board is
# weighed at the rate it measured at start again, so it gets runs and learns from them. Ten minutes
# keeps a whole window for a board in steady use (16 runs, one every 37 s) and puts a board that had
# a slow spell back in play within minutes of it.
RATE_MAX_AGE_S = 600.0
MIN_COMPUTED_TOKENS = 32  # runs that computed fewer tokens say little about the rate


@dataclass(frozen=True)
class PromptKeys:
    """A prompt's prefix keys (hex) at its range boundaries (ascending; the last is the whole prompt)."""

    boundaries: tuple[int, ...] = ()
    keys: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return self.boundaries[-1] if self.boundaries else 0

    def held(self, keys: "set[str] | frozenset[str] | dict") -> int:
        """How many leading tokens ``keys`` cover: the longest boundary whose key is there."""
        for boundary, key in zip(reversed(self.boundaries), reversed(self.keys)):
            if key in keys:
                return boundary
        return 0

    def ranges(self) -> Iterable[tuple[str, int]]:
        """(key, tokens in its range) for each boundary."""
        previous = 0
        for boundary, key in zip(self.boundaries, self.keys):
            yield key, boundary - previous
            previous = boundary

    def as_dict(self) -> dict:
        return {"boundaries": list(self.boundaries), "keys": list(self.keys)}

    @classmethod
    def from_dict(cls, data) -> "PromptKeys":
        if not isinstance(data, dict):
            return cls()
        boundaries, keys = data.get("boundaries") or [], data.get("keys") or []
        if len(boundaries) != len(keys) or not all(isinstance(b, int) for b in boundaries):
            return cls()
        return cls(tuple(boundaries), tuple(str(key) for key in keys))


def prompt_keys(
    namespace: str, fingerprint: str, tokens: Sequence[int], *, grid: int, extra: Sequence[int] = ()
) -> PromptKeys:
    """The keys a board of model ``fingerprint`` stores and looks up for ``tokens`` (cut at
    ``extra`` besides the grid) in ``namespace``."""
    extra = [cut for cut in extra if cut < len(tokens)]
    boundaries = range_boundaries(len(tokens), grid, off_grid(extra, grid))
    keys = prefix_keys(namespace, fingerprint, tokens, boundaries, grid=grid, extra=extra)
    return PromptKeys(tuple(boundaries), tuple(key.hex() for key in keys))


# -- the cost function ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BoardView:
    """What the router knows of one board for one prompt."""

    name: str
    online: bool = True
    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN
    decode_ms_per_token: float = 0.0  # its answer's pace (0: not weighed)
    queued_ms: float = 0.0  # expected work of the runs dispatched to it and not yet reported
    context_tokens: int = 0  # leading tokens of the prompt its context holds
    ram_tokens: int = 0  # ... its RAM tier holds
    cachebox_tokens: int = 0  # ... the cache box holds for it (its namespace and model)
    link: LinkProfile | None = None  # its link to the cache box (None: unshaped)
    bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN


@dataclass(frozen=True)
class Estimate:
    board: str
    expected_ms: float  # queued_ms + prefill_ms: the time to the first token, roughly
    queued_ms: float
    prefill_ms: float  # prefill of what is not held, plus restoring / fetching what is
    held_tokens: int
    source: str  # a Tier value: where the held part comes from ("" = computed)
    cold_ms: float  # the whole prompt computed there, after its queue
    answer_ms: float = 0.0  # the rest of the answer after its first token, at the board's decode pace

    @property
    def finished_ms(self) -> float:
        """When the whole answer is expected: what the router minimizes."""
        return self.expected_ms + self.answer_ms


def estimate(prompt_tokens: int, board: BoardView, answer_tokens: int = 0) -> Estimate:
    """The expected time to first token of a ``prompt_tokens`` prompt on ``board``, and to the last
    of ``answer_tokens``."""
    rate = max(0.0, board.prefill_ms_per_token)
    local = max(board.context_tokens, board.ram_tokens)
    local = min(local, prompt_tokens)
    restore = 0.0 if board.context_tokens >= local else local * RAM_RESTORE_MS_PER_TOKEN
    options = [
        (
            (prompt_tokens - local) * rate + restore,
            local,
            (Tier.CONTEXT if board.context_tokens >= local else Tier.LOCAL) if local else Tier.NONE,
        )
    ]
    remote = min(board.cachebox_tokens, prompt_tokens)
    if remote > local:
        link = board.link or LOOPBACK
        fetched = (remote - local) * board.bytes_per_token
        fetch = link.transfer_ms(fetched) + (remote - local) * RAM_RESTORE_MS_PER_TOKEN
        options.append(((prompt_tokens - remote) * rate + restore + fetch, remote, Tier.CACHEBOX))
    prefill, held, source = min(options, key=lambda option: option[0])
    queued = max(0.0, board.queued_ms)
    answer = max(0, answer_tokens - 1) * max(0.0, board.decode_ms_per_token)
    return Estimate(
        board.name,
        round(queued + prefill, 3),
        round(queued, 3),
        round(prefill, 3),
        held,
        str(source),
        round(queued + prompt_tokens * rate, 3),
        round(answer, 3),
    )


@dataclass(frozen=True)
class Route:
    """The router's choice: its board, every online board's estimate (best first), and the
    expected saving against a cache-blind choice (the least loaded board computing it all)."""

    board: str
    estimates: tuple[Estimate, ...]
    saving_ms: float

    @property
    def chosen(self) -> Estimate:
        return self.estimates[0]

    def record(self) -> dict:
        """What a run keeps of its routing (JSON)."""
        best = self.chosen
        runner_up = self.estimates[1] if len(self.estimates) > 1 else None
        return {
            "policy": "cache-aware",
            "board": self.board,
            "expected_ms": best.expected_ms,
            "queued_ms": best.queued_ms,
            "prefill_ms": best.prefill_ms,
            "answer_ms": best.answer_ms,
            "held_tokens": best.held_tokens,
            "source": best.source,
            "saving_ms": self.saving_ms,
            "candidates": len(self.estimates),
            "runner_up": runner_up.board if runner_up else "",
            "runner_up_ms": runner_up.expected_ms if runner_up else None,
        }


def route(
    prompt_tokens: int, boards: Sequence[BoardView], *, preferred: str = "", answer_tokens: int = 0
) -> Route | None:
    """The online board expected to finish the answer first (None when no board is online): its
    queue, its prefill of what it does not hold, and ``answer_tokens`` at its decode pace. A board
    that gives the first token sooner but decodes ten times slower loses a long answer (a paced
    Pi Zero 2W holding the prompt in its context took 12 s for 32 tokens a Pi 5 decodes in 0.8 s).

    Ties go to the sooner first token, then to ``preferred`` (a routing hint, e.g. the board that
    served the same ``prompt_cache_key``), then to the earlier board in ``boards`` order.
    """
    online = [(index, board) for index, board in enumerate(boards) if board.online]
    if not online:
        return None
    ranked = sorted(
        ((estimate(prompt_tokens, board, answer_tokens), index, board) for index, board in online),
        key=lambda item: (item[0].finished_ms, item[0].expected_ms, item[2].name != preferred, item[1]),
    )
    estimates = tuple(item[0] for item in ranked)
    blind = min(estimate.cold_ms for estimate in estimates)
    return Route(estimates[0].board, estimates, round(max(0.0, blind - estimates[0].expected_ms), 3))


def learned_rate(samples: Iterable[float], prior: float) -> float:
    """A board's rate (ms per token) from its recent runs: their median, or ``prior`` without any."""
    values = [value for value in samples if value > 0]
    return statistics.median(values) if values else prior


def _young(samples: deque, now: float) -> tuple[deque, float | None]:
    """``samples`` ((when, rate) pairs) without those ``RATE_MAX_AGE_S`` old at ``now`` (undated ones
    kept; ``samples`` itself when none is that old), and when the oldest dated one kept was reported."""
    oldest, kept = None, []
    for sample in samples:
        at = sample[0]
        if at is None or at + RATE_MAX_AGE_S > now:
            kept.append(sample)
            if at is not None and (oldest is None or at < oldest):
                oldest = at
    return (samples if len(kept) == len(samples) else deque(kept, maxlen=RATE_SAMPLES)), oldest


# -- what each board holds, from routing history --------------------------------------------------


@dataclass
class _Dispatched:
    request_id: str
    keys: PromptKeys
    work_ms: float


@dataclass
class _Outstanding:
    work_ms: float  # expected work
    at: float | None  # when it was dispatched (seconds, any clock the caller keeps; None: unknown)


@dataclass
class _BoardHistory:
    recent: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # _Dispatched, oldest first
    outstanding: dict[str, _Outstanding] = field(default_factory=dict)  # request id -> its work, in dispatch order
    last_report_at: float | None = None  # when the board last answered (it took its next run then)
    # (when reported or None, ms per token) of its recent runs, as fed (``FleetIndex.reported``)
    prefill_rates: deque = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))
    decode_rates: deque = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))
    ages_at: float | None = None  # when its oldest dated sample gets too old, as queued (``FleetIndex.age``)
    measured_prefill: float | None = None  # ms per token, as the board measured itself at start
    measured_decode: float | None = None
    prefill_rate: float | None = None  # its rate as last worked out (None: to work out again)


class FleetIndex:
    """What the router knows of each board: the prompts dispatched to it (newest last), the work
    not yet reported, and the rates its reports showed; and which keys the cache box holds.

    Fed with ``dispatched`` when a prompt is sent and ``reported`` when its run comes back; the
    control plane rebuilds one from its Dispatch and InferenceRun rows for each decision.
    """

    def __init__(
        self,
        *,
        prefill_prior: float = DEFAULT_PREFILL_MS_PER_TOKEN,
        decode_prior: float = DEFAULT_DECODE_MS_PER_TOKEN,
        bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN,
    ):
        self.prefill_prior = prefill_prior
        self.decode_prior = decode_prior
        self.bytes_per_token = bytes_per_token
        self.boards: dict[str, _BoardHistory] = {}
        self.cachebox: set[str] = set()  # keys (hex) the cache box is known to hold
        # Kept as the histories change, so that a decision reads the boards that matter to a prompt
        # without walking every board (``dashboard.router.plan`` at 1,000 boards):
        self.busy: set[str] = set()  # boards with runs dispatched and not yet reported
        self.holders: dict[str, dict[str, int]] = {}  # range key -> {board: how many of its remembered prompts have it}
        self.rate_changes: list[str] = []  # boards whose prefill rate changed, in order (``RATE_LOG`` at most)
        self.rate_epoch = 0  # counts the times ``rate_changes`` was emptied: who read it starts over
        # (when a board's oldest dated rate sample gets too old, board), a heap: ``age`` looks at the
        # boards whose samples got too old since it last looked, not at every board. One entry per
        # board with dated samples (more only while an older sample came in after a newer one).
        self.aging: list[tuple[float, str]] = []

    RATE_LOG = 4096

    def _board(self, name: str) -> _BoardHistory:
        history = self.boards.get(name)
        if history is None:  # not ``setdefault``: it built a history (its dicts and deques) at every call
            history = self.boards[name] = _BoardHistory()
        return history

    def measured(self, board: str, *, prefill_ms_per_token: float | None, decode_ms_per_token: float | None) -> None:
        """``board`` measured its own rates when it started (its heartbeat says so): its rates until
        its runs say better, instead of the fleet-wide priors."""
        history = self._board(board)
        prefill = prefill_ms_per_token if prefill_ms_per_token and prefill_ms_per_token > 0 else None
        history.measured_decode = decode_ms_per_token if decode_ms_per_token and decode_ms_per_token > 0 else None
        if prefill != history.measured_prefill:
            history.measured_prefill = prefill
            self._rate_changed(board, history)

    def prefill_rate(self, board: str) -> float:
        history = self._board(board)
        if history.prefill_rate is None:
            history.prefill_rate = learned_rate(
                (rate for _, rate in history.prefill_rates), history.measured_prefill or self.prefill_prior
            )
        return history.prefill_rate

    def _rate_changed(self, board: str, history: _BoardHistory) -> None:
        history.prefill_rate = None
        if len(self.rate_changes) >= self.RATE_LOG:
            self.rate_changes, self.rate_epoch = [], self.rate_epoch + 1
        self.rate_changes.append(board)

    def holding(self, keys: PromptKeys) -> set[str]:
        """The boards whose remembered prompts share a range key with ``keys`` (what ``holdings``
        can find more than nothing of), from the keys' index rather than every board's history."""
        found: set[str] = set()
        for key in keys.keys:
            boards = self.holders.get(key)
            if boards:
                found.update(boards)
        return found

    def _remember_keys(self, board: str, item: _Dispatched, step: int) -> None:
        for key in set(item.keys.keys):
            boards = self.holders.setdefault(key, {})
            count = boards.get(board, 0) + step
            if count > 0:
                boards[board] = count
            else:
                boards.pop(board, None)
                if not boards:
                    del self.holders[key]

    def decode_rate(self, board: str) -> float:
        history = self._board(board)
        return learned_rate((rate for _, rate in history.decode_rates), history.measured_decode or self.decode_prior)

    def age(self, now: float) -> None:
        """Forget the rate samples that are ``RATE_MAX_AGE_S`` old at ``now`` (seconds, the clock of the
        ``at`` given to ``reported``): a board without younger runs is weighed at the rate it measured
        at start again (else the prior), so the router tries it again and it learns from its new runs.

        Cheap enough for every decision: it reads the heap of the boards' next ageing, and only a
        board whose oldest sample got too old since is worked out again (its prefill rate change is
        logged, as a report's is, for whoever keeps boards ranked by it). Samples reported without
        a time never age (a caller that keeps no clock; the control plane dates every run)."""
        aging = self.aging
        while aging and aging[0][0] <= now:
            when, board = heapq.heappop(aging)
            history = self.boards.get(board)
            if history is None or history.ages_at != when:
                continue  # queued before an older sample came in: that one's entry came first
            history.ages_at = None
            prefill, oldest_prefill = _young(history.prefill_rates, now)
            if prefill is not history.prefill_rates:
                history.prefill_rates = prefill
                self._rate_changed(board, history)
            history.decode_rates, oldest_decode = _young(history.decode_rates, now)
            dated = [at for at in (oldest_prefill, oldest_decode) if at is not None]
            if dated:  # each kept sample is younger than ``now`` allows: this entry comes after ``now``
                self._ages_at(board, history, min(dated) + RATE_MAX_AGE_S)

    def _ages_at(self, board: str, history: _BoardHistory, when: float) -> None:
        if history.ages_at is None or when < history.ages_at:
            history.ages_at = when
            heapq.heappush(self.aging, (when, board))

    def dispatched(
        self, board: str, request_id: str, keys: PromptKeys, work_ms: float, *, at: float | None = None
    ) -> None:
        """A prompt was sent to ``board`` (at time ``at``, seconds): it will hold it next, and owes
        ``work_ms`` until it reports."""
        history = self._board(board)
        if len(history.recent) == history.recent.maxlen:
            self._remember_keys(board, history.recent[0], -1)  # the oldest falls out of the window
        item = _Dispatched(request_id, keys, work_ms)
        history.recent.append(item)
        self._remember_keys(board, item, +1)
        history.outstanding[request_id] = _Outstanding(max(0.0, work_ms), at)
        self.busy.add(board)

    def queued_ms(self, board: str, now: float | None = None) -> float:
        """The work ``board`` still owes: its unreported runs' expected work, less, when ``now`` is
        given, the time it has already spent on the oldest one (it serves its queue in order, so it
        took that run when it was dispatched or when the board last answered, whichever is later)."""
        history = self._board(board)
        items = list(history.outstanding.values())
        total = sum(item.work_ms for item in items)
        if now is None or not items or items[0].at is None:
            return total
        began = max(items[0].at, history.last_report_at if history.last_report_at is not None else items[0].at)
        spent = min(items[0].work_ms, max(0.0, (now - began) * 1000.0))
        return round(total - spent, 3)

    def reported(
        self,
        board: str,
        request_id: str,
        *,
        prompt_tokens: int = 0,
        matched_tokens: int = 0,
        prefill_ms: float = 0.0,
        decode_ms: float = 0.0,
        generated_tokens: int = 0,
        stored_keys: Iterable[str] = (),
        failed: bool = False,
        at: float | None = None,
    ) -> None:
        """``board`` answered ``request_id`` (at time ``at``, seconds): its work is done; learn its rates
        (samples of that time, forgotten once ``RATE_MAX_AGE_S`` old, ``age``; never without ``at``);
        note the keys it stored."""
        history = self._board(board)
        if history.outstanding.pop(request_id, None) is not None and at is not None:
            history.last_report_at = at if history.last_report_at is None else max(history.last_report_at, at)
        if not history.outstanding:
            self.busy.discard(board)
        if failed:
            # A failed run left nothing in the engine: forget it as the board's context.
            for item in history.recent:
                if item.request_id == request_id:
                    self._remember_keys(board, item, -1)
            history.recent = deque((item for item in history.recent if item.request_id != request_id), maxlen=HISTORY)
            return
        computed = prompt_tokens - matched_tokens
        learned = False
        if computed >= MIN_COMPUTED_TOKENS and prefill_ms > 0:
            history.prefill_rates.append((at, prefill_ms / computed))
            self._rate_changed(board, history)
            learned = True
        if generated_tokens > 1 and decode_ms > 0:
            history.decode_rates.append((at, decode_ms / (generated_tokens - 1)))
            learned = True
        if learned and at is not None:
            self._ages_at(board, history, at + RATE_MAX_AGE_S)
        self.cachebox.update(stored_keys)

    def work_ms(
        self,
        board: str,
        keys: PromptKeys,
        max_tokens: int,
        link: LinkProfile | None = None,
        *,
        estimate: Estimate | None = None,
    ) -> float:
        """What a prompt occupies ``board`` for: its prefill, its answer and the upload of the ranges
        it computes that the cache box lacks. With ``estimate`` (the router's for this board), the
        prefill of what the board will not hold; without, of the whole prompt."""
        prompt_tokens = keys.tokens
        held = estimate.held_tokens if estimate is not None else 0
        new = prompt_tokens - max(held, keys.held(self.cachebox))
        upload = link.transfer_ms(new * self.bytes_per_token) if link is not None and new > 0 else 0.0
        prefill = prompt_tokens * self.prefill_rate(board) if estimate is None else estimate.prefill_ms
        return prefill + max(0, max_tokens - 1) * self.decode_rate(board) + upload

    def holdings(self, board: str, keys: PromptKeys, ram_budget_bytes: int) -> tuple[int, int]:
        """(context tokens, RAM-tier tokens) of ``keys`` that ``board`` should hold when the prompt reaches it."""
        recent = list(self._board(board).recent)
        if not recent:
            return 0, 0
        context = keys.held(set(recent[-1].keys.keys))
        if ram_budget_bytes <= 0:
            return context, 0
        kept: set[str] = set()
        used = 0.0
        for item in reversed(recent):  # newest first, as the RAM tier's LRU keeps them
            for key, tokens in item.keys.ranges():
                if key in kept:
                    continue
                used += tokens * self.bytes_per_token
                if used > ram_budget_bytes:
                    return context, keys.held(kept)
                kept.add(key)
        return context, keys.held(kept)

    def view(
        self,
        board: str,
        keys: PromptKeys,
        *,
        online: bool = True,
        link: LinkProfile | None = None,
        ram_budget_bytes: int = 0,
        cachebox_tokens: int | None = None,
        now: float | None = None,
    ) -> BoardView:
        """The router's view of ``board`` for a prompt of ``keys`` at time ``now`` (``cachebox_tokens``: what
        the cache box holds for this board, when the caller knows better than the index)."""
        context, ram = self.holdings(board, keys, ram_budget_bytes)
        return BoardView(
            name=board,
            online=online,
            prefill_ms_per_token=self.prefill_rate(board),
            decode_ms_per_token=self.decode_rate(board),
            queued_ms=self.queued_ms(board, now),
            context_tokens=context,
            ram_tokens=ram,
            cachebox_tokens=keys.held(self.cachebox) if cachebox_tokens is None else cachebox_tokens,
            link=link,
            bytes_per_token=self.bytes_per_token,
        )


def estimate_dict(estimate: Estimate) -> dict:
    return asdict(estimate)

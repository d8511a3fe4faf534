"""`bench load`: N boards, one process each, send MMLU prompts to one cache box for a bounded time.

The parent process is the dispatcher. It starts N board processes ("spawn": each loads
its own llama.cpp model with one thread), waits until every model is loaded, then for
``seconds`` hands an MMLU prompt to each idle board, one request at a time per board,
each with an id. A board answers with the fields of its run's breakdown or with an
error. After the clock the parent waits a bounded drain time for the answers still
outstanding, then stops the boards.

Counting: ``runs`` are answers with a breakdown; ``errors`` are answers that are
exceptions plus runs whose breakdown says the cache box was unavailable; ``lost`` are
requests dispatched that got no answer by the end of the drain (a board that died loses
its request). ``hit_ratio`` is matched / prompt tokens over all runs and
``cachebox_mb_per_s`` is (fetched + uploaded bytes) / 1e6 over the measured seconds (from
the start of the clock to the end of the drain).

Messages between the processes are JSON over a pipe. The summary arithmetic at the top
of this module is pure, so it is tested without any process or model.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Callable, Sequence

from cachebox.errors import CacheBoxUnavailable
from cachebox.signing import Keychain, KeyRing, shared_producer_ring
from cachebox.store import CacheBox
from dashboard import mmlu
from dashboard.bench.base import BenchError, Benchmark, topics_named
from dashboard.bench.common import machine_info, percentile
from dashboard.bench.reports import load_report
from inference.board.config import BoardConfig

WINDOW_SECONDS = 10.0
# p99 counts as stable when it does not rise over time: over the windows that start after
# the warm-up (until every board has answered once: with an empty cache box they all
# prefill cold at the same time) and have at least MIN_WINDOW_RUNS runs, no window's p99
# is more than STABLE_P99_RATIO times the lowest p99 of the windows before it. A p99 that
# falls (the cache box warming up further) is not a rise.
STABLE_P99_RATIO = 2.0
MIN_WINDOW_RUNS = 5
DEFAULT_TOPICS = ("astronomy", "high school physics", "college biology")
# Breakdown fields a board sends back for each run.
RUN_FIELDS = (
    "ttft_ms",
    "ttlt_ms",
    "matched_tokens",
    "prompt_tokens",
    "fetched_bytes",
    "uploaded_bytes",
    "cachebox",
    "case",
    "decision",
    "rejected_entries",
    "false_positives",
)


class LoadError(RuntimeError):
    """The load run could not start or carry on (a board failed to load, ...)."""


# -- pure summary arithmetic -------------------------------------------------------------------
def _ratio(numerator: float, denominator: float, digits: int = 4) -> float:
    return round(numerator / denominator, digits) if denominator else 0.0


def time_windows(runs: Sequence[dict], duration_s: float, window_s: float = WINDOW_SECONDS) -> list[dict]:
    """TTFT percentiles of the runs dispatched in each ``window_s`` slice of ``[0, duration_s)``.

    Each run needs ``t_s`` (dispatch time from the start of the clock) and ``ttft_ms``; the
    last window is shorter when ``duration_s`` is not a multiple of ``window_s``.
    """
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    count = max(1, math.ceil(duration_s / window_s - 1e-9))
    buckets: list[list[dict]] = [[] for _ in range(count)]
    for run in runs:
        index = min(count - 1, max(0, int(run["t_s"] // window_s)))
        buckets[index].append(run)
    rows = []
    for index, bucket in enumerate(buckets):
        ttfts = [run["ttft_ms"] for run in bucket]
        prompt = sum(run.get("prompt_tokens", 0) for run in bucket)
        rows.append(
            {
                "start_s": round(index * window_s, 3),
                "end_s": round(min((index + 1) * window_s, duration_s), 3),
                "runs": len(bucket),
                "ttft_ms_p50": percentile(ttfts, 50),
                "ttft_ms_p99": percentile(ttfts, 99),
                "hit_ratio": _ratio(sum(run.get("matched_tokens", 0) for run in bucket), prompt),
            }
        )
    return rows


def warmup_seconds(runs: Sequence[dict], boards: Sequence[str]) -> float | None:
    """When every board had answered once (from the start of the clock); None if one never did."""
    first: dict[str, float] = {}
    for run in runs:
        done = run["t_s"] + run.get("latency_ms", run["ttft_ms"]) / 1000.0
        first[run["board"]] = min(done, first.get(run["board"], done))
    names = set(boards) | set(first)
    if not names or any(name not in first for name in names):
        return None
    return round(max(first.values()), 3)


def p99_stability(
    windows: Sequence[dict],
    warmup_s: float | None,
    *,
    min_runs: int = MIN_WINDOW_RUNS,
    threshold: float = STABLE_P99_RATIO,
) -> dict:
    """Does p99 rise over time? Compares the windows that start after the warm-up and have ``min_runs`` runs."""
    after = [w for w in windows if warmup_s is not None and w["start_s"] >= warmup_s]
    compared = [w for w in after if w["runs"] >= min_runs and w["ttft_ms_p99"] is not None]
    values = [w["ttft_ms_p99"] for w in compared]
    rise = None
    if len(values) >= 2 and min(values) > 0:
        rise = round(max(value / min(values[:index]) for index, value in enumerate(values) if index), 3)
    return {
        "warmup_s": warmup_s,
        "windows_compared": [w["start_s"] for w in compared],
        "max_rise": rise,
        "threshold": threshold,
        "min_runs": min_runs,
        # Fewer than two comparable windows: nothing says it is unstable, nothing says it is stable.
        "stable": None if rise is None else rise <= threshold,
        "rule": (
            f"over the windows starting after every board answered once, with >= {min_runs} runs: "
            f"no window's p99 above {threshold:g} x the lowest p99 before it"
        ),
    }


def summarize(
    runs: Sequence[dict],
    failures: Sequence[dict],
    lost: int,
    *,
    duration_s: float,
    measured_s: float,
    boards: Sequence[str] = (),
    window_s: float = WINDOW_SECONDS,
) -> dict:
    """The figures of a load run.

    ``runs``: one dict per answer with a breakdown (``board``, ``t_s``, ``latency_ms`` and
    the RUN_FIELDS); ``failures``: one dict per answer that is an error (``board``,
    ``error``); ``lost``: requests never answered; ``boards``: every board's name, so
    that a board with no answer shows up too.
    """
    unavailable = sum(1 for run in runs if run.get("cachebox") == "unavailable")
    ttfts = [run["ttft_ms"] for run in runs]
    latencies = [run["latency_ms"] for run in runs if "latency_ms" in run]
    prompt_tokens = sum(run["prompt_tokens"] for run in runs)
    matched_tokens = sum(run["matched_tokens"] for run in runs)
    moved = sum(run["fetched_bytes"] + run["uploaded_bytes"] for run in runs)
    per_board = []
    others = ({run["board"] for run in runs} | {f["board"] for f in failures}) - set(boards)
    for name in list(boards) + sorted(others):
        mine = [run for run in runs if run["board"] == name]
        per_board.append(
            {
                "board": name,
                "runs": len(mine),
                "errors": sum(1 for f in failures if f["board"] == name)
                + sum(1 for run in mine if run.get("cachebox") == "unavailable"),
                "ttft_ms_p50": percentile([run["ttft_ms"] for run in mine], 50),
                "ttft_ms_p99": percentile([run["ttft_ms"] for run in mine], 99),
            }
        )
    windows = time_windows(runs, duration_s, window_s)
    warmup = warmup_seconds(runs, boards)
    stability = p99_stability(windows, warmup)
    steady = [run["ttft_ms"] for run in runs if warmup is not None and run["t_s"] >= warmup]
    errors = len(failures) + unavailable
    return {
        "runs": len(runs),
        "errors": errors,
        "lost": lost,
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "ttft_ms_max": round(max(ttfts), 3) if ttfts else None,
        # Runs dispatched after the warm-up: what a board sees once the cache box is in use.
        "after_warmup": {
            "runs": len(steady),
            "ttft_ms_p50": percentile(steady, 50),
            "ttft_ms_p99": percentile(steady, 99),
        },
        "latency_ms_p50": percentile(latencies, 50),
        "latency_ms_p99": percentile(latencies, 99),
        "hit_ratio": _ratio(matched_tokens, prompt_tokens),
        "cachebox_mb_per_s": round(moved / 1e6 / measured_s, 3) if measured_s > 0 else 0.0,
        "cachebox_mb": round(moved / 1e6, 3),
        "measured_seconds": round(measured_s, 3),
        "runs_per_second": round(len(runs) / measured_s, 3) if measured_s > 0 else 0.0,
        "exceptions": len(failures),
        "cachebox_unavailable": unavailable,
        "prompt_tokens": prompt_tokens,
        "matched_tokens": matched_tokens,
        "cases": dict(Counter(run.get("case", "") for run in runs)),
        "decisions": dict(Counter(run.get("decision", "") for run in runs)),
        "rejected_entries": sum(run.get("rejected_entries", 0) for run in runs),
        "false_positives": sum(run.get("false_positives", 0) for run in runs),
        "per_board": per_board,
        "windows": windows,
        "p99_stability": stability,
        "target_met": errors == 0 and lost == 0 and stability["stable"] is True,
        "error_messages": sorted({f["error"] for f in failures})[:20],
    }


# -- prompts ----------------------------------------------------------------------------------
def prompt_pool(topics: Sequence[str], shots: int, per_topic: int) -> list[dict]:
    """MMLU prompts as segments: ``per_topic`` questions of each topic, sharing its instruction and examples."""

    pool = []
    for topic in topics:
        for number, prompt in enumerate(mmlu.build_prompts(topic, shots, per_topic)):
            pool.append({"topic": prompt.target.topic, "number": number, "segments": prompt.segments})
    return pool


# -- messages: JSON over a pipe ------------------------------------------------------------------
def _send(conn, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn) -> dict:
    return json.loads(conn.recv_bytes())


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# -- a board process ----------------------------------------------------------------------------
def board_main(index: int, conn, namespace: str, max_tokens: int, ring: dict) -> None:
    """One board: load the model, then answer requests until told to stop (``ring``: its signing keys)."""
    # Ctrl-C reaches the whole process group: the dispatcher alone decides when boards stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name = f"load-{index}"
    board = None
    try:
        from inference.board.runtime import Board  # lazy: the board runtime only when a bench runs a board

        keyring = shared_producer_ring(KeyRing.from_dict(ring))  # no control plane here: the ring's holders sign alike
        started = time.perf_counter()
        config = BoardConfig.from_env(device=name, namespace=namespace, threads=1)
        board = Board.start(
            config, keys=Keychain(lambda ns: keyring if keyring.covers(ns) else None), background_sync=True
        )
        ready = {"type": "ready", "board": name, "pid": os.getpid(), "load_s": round(time.perf_counter() - started, 2)}
        if index == 0:
            ready["machine"] = machine_info(board)
        _send(conn, ready)
    except Exception as exc:  # report why, then exit: the dispatcher gives up on the run
        try:
            _send(conn, {"type": "failed", "board": name, "error": _describe(exc)})
        except OSError:
            pass
        if board is not None:
            board.close()
        return
    try:
        while True:
            try:
                message = _recv(conn)
            except (EOFError, OSError):
                break  # the dispatcher is gone
            if message.get("type") != "run":
                break  # "stop"
            try:
                result = board.run(message["segments"], max_tokens=max_tokens)
                breakdown = result.breakdown.as_dict()
                reply = {
                    "type": "result",
                    "id": message["id"],
                    "breakdown": {key: breakdown.get(key) for key in RUN_FIELDS},
                }
            except Exception as exc:
                reply = {"type": "error", "id": message["id"], "error": _describe(exc)}
            try:
                _send(conn, reply)
            except OSError:
                break
    finally:
        board.close()
        conn.close()


# -- the dispatcher -------------------------------------------------------------------------------
@dataclass
class _Slot:
    name: str
    process: multiprocessing.process.BaseProcess
    conn: object
    ready: bool = False
    alive: bool = True
    busy: int | None = None  # id of the request it is working on
    info: dict = field(default_factory=dict)


@dataclass
class _Request:
    id: int
    slot: _Slot
    prompt: int
    t_s: float
    sent: float


@contextmanager
def _sigint_ignored():
    """Children started meanwhile inherit an ignored SIGINT from their first instruction on."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to do
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class LoadRun:
    """Start the boards, dispatch for ``seconds``, drain, stop; ``run()`` returns the document."""

    def __init__(
        self,
        devices: int,
        seconds: float,
        pool: Sequence[dict],
        *,
        namespace: str,
        ring: dict,
        max_tokens: int = 4,
        drain_seconds: float = 60.0,
        ready_timeout: float = 600.0,
        seed: int = 0,
        on_ready: Callable[[int], None] | None = None,
        on_tick: Callable[[float, dict], None] | None = None,
    ):
        if devices < 1 or seconds <= 0 or not pool:
            raise ValueError("need at least one board, a positive duration and some prompts")
        self.devices = devices
        self.seconds = seconds
        self.pool = list(pool)
        self.namespace = namespace
        self.ring = ring  # the namespace's signing keys (KeyRing.to_dict()), handed to each board process
        self.max_tokens = max_tokens
        self.drain_seconds = drain_seconds
        self.ready_timeout = ready_timeout
        self.rng = random.Random(seed)
        self.on_ready = on_ready
        self.on_tick = on_tick
        self.slots: list[_Slot] = []
        self.runs: list[dict] = []
        self.failures: list[dict] = []
        self.outstanding: dict[int, _Request] = {}
        self.lost: list[int] = []
        self.deaths: list[dict] = []
        self.dispatched = 0
        self.seen_prompts: set[int] = set()
        self.repeats = 0
        self.start = 0.0

    # -- public ------------------------------------------------------------------------------
    def run(self) -> dict:
        grace = 15.0  # a board finishes the run it is on before it reads "stop"
        try:
            self._start_boards()
            machine = self._await_ready()
            measured = self._dispatch()
        except KeyboardInterrupt:
            grace = 1.0  # Ctrl-C: do not wait for the runs under way
            raise
        finally:
            self._shutdown(grace)
        lost = len(self.lost) + len(self.outstanding)
        names = [slot.name for slot in self.slots]
        document = summarize(self.runs, self.failures, lost, duration_s=self.seconds, measured_s=measured, boards=names)
        document.update(
            {
                "devices": self.devices,
                "seconds": self.seconds,
                "drain_seconds": self.drain_seconds,
                "dispatched": self.dispatched,
                "distinct_prompts": len(self.seen_prompts),
                "repeated_prompts": self.repeats,
                "pool_size": len(self.pool),
                "max_tokens": self.max_tokens,
                "namespace": self.namespace,
                "board_deaths": self.deaths,
                "board_load_s": {slot.name: slot.info.get("load_s") for slot in self.slots},
                "samples": [
                    {
                        "t_s": run["t_s"],
                        "board": run["board"],
                        "ttft_ms": run["ttft_ms"],
                        "case": run["case"],
                        "cachebox": run["cachebox"],
                    }
                    for run in self.runs
                ],
                "machine": machine,
            }
        )
        return document

    # -- steps ---------------------------------------------------------------------------------
    def _start_boards(self) -> None:
        context = multiprocessing.get_context("spawn")
        with _sigint_ignored():
            for index in range(self.devices):
                parent_end, child_end = context.Pipe(duplex=True)
                process = context.Process(
                    target=board_main,
                    args=(index, child_end, self.namespace, self.max_tokens, self.ring),
                    name=f"load-{index}",
                    daemon=True,
                )
                process.start()
                child_end.close()
                self.slots.append(_Slot(f"load-{index}", process, parent_end))

    def _await_ready(self) -> dict:
        deadline = time.monotonic() + self.ready_timeout
        machine: dict = {}
        while not all(slot.ready for slot in self.slots):
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = ", ".join(slot.name for slot in self.slots if not slot.ready)
                raise LoadError(f"boards not ready after {self.ready_timeout:g} s: {waiting}")
            pending = [slot for slot in self.slots if not slot.ready]
            by_object = {}
            for slot in pending:
                by_object[slot.conn] = slot
                by_object[slot.process.sentinel] = slot
            for obj in wait(list(by_object), timeout=min(left, 1.0)):
                slot = by_object[obj]
                if slot.ready:
                    continue
                message = self._read(slot)
                if message is None:
                    raise LoadError(f"board {slot.name} exited while loading (exit code {slot.process.exitcode})")
                if message.get("type") == "failed":
                    raise LoadError(f"board {slot.name} failed to start: {message.get('error')}")
                if message.get("type") == "ready":
                    slot.ready = True
                    slot.info = message
                    machine = message.get("machine") or machine
                    if self.on_ready:
                        self.on_ready(sum(s.ready for s in self.slots))
        return machine

    def _dispatch(self) -> float:
        """Hand out prompts until the clock ends, then drain; returns the measured seconds."""
        self.start = time.monotonic()
        stop_at = self.start + self.seconds
        drain_until = stop_at + self.drain_seconds
        while True:
            now = time.monotonic()
            if now < stop_at:
                for slot in self.slots:
                    if slot.alive and slot.busy is None:
                        self._send_request(slot, now)
            elif not self.outstanding or now >= drain_until:
                break
            if not any(slot.alive for slot in self.slots):
                break
            self._tick(now)
            limit = stop_at if now < stop_at else drain_until
            self._receive(timeout=max(0.0, min(0.25, limit - now)))
        end = time.monotonic()
        self._tick(end, final=True)
        return end - self.start

    def _send_request(self, slot: _Slot, now: float) -> None:
        prompt = self.rng.randrange(len(self.pool))
        request = _Request(self.dispatched, slot, prompt, round(now - self.start, 3), now)
        self.dispatched += 1
        if prompt in self.seen_prompts:
            self.repeats += 1
        self.seen_prompts.add(prompt)
        try:
            _send(slot.conn, {"type": "run", "id": request.id, "segments": self.pool[prompt]["segments"]})
        except OSError:
            self.lost.append(request.id)
            self._bury(slot, now)
            return
        slot.busy = request.id
        self.outstanding[request.id] = request

    def _receive(self, timeout: float) -> None:
        by_object = {}
        for slot in self.slots:
            if slot.alive:
                by_object[slot.conn] = slot
                by_object[slot.process.sentinel] = slot
        if not by_object:
            return
        for obj in wait(list(by_object), timeout=timeout):
            slot = by_object[obj]
            if not slot.alive:
                continue
            if obj is slot.conn:
                message = self._read(slot)
                if message is None:
                    self._bury(slot, time.monotonic())
                else:
                    self._answer(slot, message)
            else:
                # The process exited: take what it sent before, then count it out.
                while slot.alive and self._poll(slot):
                    message = self._read(slot)
                    if message is None:
                        break
                    self._answer(slot, message)
                self._bury(slot, time.monotonic())

    def _answer(self, slot: _Slot, message: dict) -> None:
        request = self.outstanding.pop(message.get("id"), None)
        if request is None:
            return  # not a request of this run (or already given up on)
        slot.busy = None
        now = time.monotonic()
        if message.get("type") == "result":
            self.runs.append(
                {
                    "board": slot.name,
                    "t_s": request.t_s,
                    "latency_ms": round((now - request.sent) * 1000.0, 3),
                    "prompt": request.prompt,
                    **message["breakdown"],
                }
            )
        else:
            self.failures.append(
                {"board": slot.name, "t_s": request.t_s, "error": str(message.get("error", "unknown error"))}
            )

    def _bury(self, slot: _Slot, now: float) -> None:
        """A board that died: its request, if any, is lost."""
        if not slot.alive:
            return
        slot.alive = False
        if slot.busy is not None and slot.busy in self.outstanding:
            self.outstanding.pop(slot.busy)
            self.lost.append(slot.busy)
        slot.busy = None
        slot.process.join(timeout=0.1)
        self.deaths.append({"board": slot.name, "t_s": round(now - self.start, 3), "exitcode": slot.process.exitcode})

    @staticmethod
    def _read(slot: _Slot) -> dict | None:
        try:
            return _recv(slot.conn)
        except (EOFError, OSError, ValueError):
            return None

    @staticmethod
    def _poll(slot: _Slot) -> bool:
        try:
            return slot.conn.poll(0)
        except (EOFError, OSError):
            return False

    def _tick(self, now: float, final: bool = False) -> None:
        if self.on_tick is None:
            return
        unavailable = sum(1 for run in self.runs if run.get("cachebox") == "unavailable")
        self.on_tick(
            now - self.start,
            {
                "runs": len(self.runs),
                "errors": len(self.failures) + unavailable,
                "outstanding": len(self.outstanding),
                "lost": len(self.lost),
                "draining": now - self.start >= self.seconds,
                "final": final,
            },
        )

    def _shutdown(self, grace: float = 15.0) -> None:
        """Ask every board to stop, wait a bounded time, then terminate (and kill) the stragglers."""
        for slot in self.slots:
            if slot.process.is_alive():
                try:
                    _send(slot.conn, {"type": "stop"})
                except OSError:
                    pass
        deadline = time.monotonic() + grace
        for slot in self.slots:
            slot.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for slot in self.slots:
            if slot.process.is_alive():
                slot.process.terminate()
        for slot in self.slots:
            slot.process.join(timeout=5.0)
            if slot.process.is_alive():
                slot.process.kill()
                slot.process.join(timeout=5.0)
            try:
                slot.conn.close()
            except OSError:
                pass


# -- the command (python manage.py bench load) ---------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--devices", type=int, default=8, help="board processes (1 llama.cpp thread each; default 8)")
    parser.add_argument("--seconds", type=float, default=60, help="how long prompts are dispatched (default 60)")
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument(
        "--topics", nargs="+", default=None, metavar="TOPIC", help="MMLU topics the prompts come from (default: 3)"
    )
    parser.add_argument(
        "--prompts", type=int, default=8, help="questions per topic in the pool prompts are drawn from (default 8)"
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per run")
    parser.add_argument(
        "--drain", type=float, default=60, help="seconds to wait for outstanding answers after the clock"
    )


def run(ctx, *, devices, seconds, shots, topics, prompts, max_tokens, drain, **options) -> dict:
    if devices < 1 or seconds <= 0 or prompts < 1 or max_tokens < 1 or drain < 0 or not 0 <= shots <= 8:
        raise BenchError(
            "--devices, --prompts and --max-tokens must be at least 1, --seconds positive, --drain >= 0, --shots 0 to 8"
        )
    chosen = topics_named(topics or DEFAULT_TOPICS)
    try:
        pool = prompt_pool(chosen, shots, prompts)
    except (mmlu.UnknownTopic, ValueError, FileNotFoundError) as exc:
        raise BenchError(str(exc))
    url = ctx.cachebox_url()  # the embedded Valkey starts here, once, not in N boards at a time
    store = CacheBox(url)
    namespace = f"bench-load-{int(time.time())}"
    bars = {"loading": ctx.progress(total=devices, desc=f"bench load: loading {devices} boards", unit="board")}

    def ready(count: int) -> None:
        bars["loading"].update(count - bars["loading"].n)

    def tick(elapsed: float, state: dict) -> None:
        if "clock" not in bars:
            bars["loading"].close()
            bars["clock"] = ctx.progress(
                total=int(math.ceil(seconds)),
                desc=f"bench load ({devices} boards)",
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s{postfix}",
            )
        bar = bars["clock"]
        if state["draining"]:
            bar.set_description(f"bench load ({devices} boards): draining")
        bar.set_postfix(runs=state["runs"], errors=state["errors"], out=state["outstanding"], refresh=False)
        bar.update(max(0, min(bar.total, int(elapsed)) - bar.n))
        if state["final"]:
            bar.refresh()

    runner = LoadRun(
        devices,
        seconds,
        pool,
        namespace=namespace,
        ring=ctx.keyring(namespace),
        max_tokens=max_tokens,
        drain_seconds=drain,
        on_ready=ready,
        on_tick=tick,
    )
    # Ctrl-C must stop the boards even when started from a shell that ignores SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        document = runner.run()
    except LoadError as exc:
        raise BenchError(str(exc))
    except KeyboardInterrupt:
        raise BenchError("interrupted: every board was stopped, nothing saved")
    finally:
        for bar in bars.values():
            bar.close()
        try:
            store.flush(namespace)
        except CacheBoxUnavailable:
            pass
    document.update(
        {
            "topics": chosen,
            "shots": shots,
            "prompts_per_topic": prompts,
            "cachebox": {
                "kind": "embedded valkey" if ctx.embedded_cachebox else f"REDIS_URL ({url.split(':', 1)[0]})",
                "url": store.safe_url,
            },
        }
    )
    document["summary"] = (
        f"{devices} boards x {seconds:g} s: {document['runs']} runs, {document['errors']} errors, {document['lost']} lost; "
        f"TTFT p50 {document['ttft_ms_p50']} ms, p99 {document['ttft_ms_p99']} ms; hit ratio {document['hit_ratio']}; "
        f"{document['cachebox_mb_per_s']} MB/s to and from the cache box."
    )
    return document


def lines(doc: dict) -> list[str]:
    stable = doc["p99_stability"]
    out = [
        f"\n{doc['summary']}",
        f"cache box: {doc['cachebox']['kind']} at {doc['cachebox']['url']}; {doc['dispatched']} dispatched, "
        f"{doc['repeated_prompts']} exact repeats; cases {doc['cases']}; measured {doc['measured_seconds']:.1f} s",
        f"{'window':>12}{'runs':>6}{'p50 ms':>10}{'p99 ms':>10}{'hit':>7}",
    ]
    for w in doc["windows"]:
        p50 = "-" if w["ttft_ms_p50"] is None else f"{w['ttft_ms_p50']:.1f}"
        p99 = "-" if w["ttft_ms_p99"] is None else f"{w['ttft_ms_p99']:.1f}"
        label = f"{w['start_s']:g}-{w['end_s']:g} s"
        out.append(f"{label:>12}{w['runs']:>6}{p50:>10}{p99:>10}{w['hit_ratio']:>7.2f}")
    out.append("runs per board: " + ", ".join(f"{b['board']} {b['runs']}" for b in doc["per_board"]))
    starts = ", ".join(f"{start:g}" for start in stable["windows_compared"]) or "none"
    steady = doc["after_warmup"]
    out.append(
        f"warm-up (until every board answered once): {stable['warmup_s']} s; after it {steady['runs']} runs, "
        f"TTFT p50 {steady['ttft_ms_p50']} ms, p99 {steady['ttft_ms_p99']} ms\n"
        f"p99 stability over the windows after it with >= {stable['min_runs']} runs (start s: {starts}): largest rise over an "
        f"earlier window {stable['max_rise']} (stable if <= {stable['threshold']:g}): {stable['stable']}\n"
        f"target (0 errors, 0 lost, stable p99) met: {doc['target_met']}"
    )
    out += [f"error: {message}" for message in doc["error_messages"]]
    out += [
        f"board {death['board']} died at {death['t_s']} s (exit code {death['exitcode']})"
        for death in doc["board_deaths"]
    ]
    return out


def headline(doc: dict) -> str:
    return (
        f"{doc['devices']} boards, {doc['seconds']} s: {doc['runs']} runs, {doc['errors']} errors, {doc['lost']} lost, "
        f"TTFT p50 {doc['ttft_ms_p50']} ms / p99 {doc['ttft_ms_p99']} ms, hit ratio {doc['hit_ratio']}"
    )


def _report(path, doc: dict):
    return load_report(path, doc)


BENCH = Benchmark(
    name="load",
    format=1,
    help="N boards (one process each) send MMLU prompts to one cache box for a bounded time",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=_report,
    headline=headline,
)

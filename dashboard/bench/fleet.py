"""bench fleet: random, round-robin and cache-aware routing of one arrival stream over N boards.

N in-process boards (one llama.cpp thread each, each with its own engine, context and RAM
tier, all sharing one model file) on one emulated link to one cache box. Prompts of several
MMLU topics arrive interleaved (a seeded shuffle), one every ``interval`` seconds, and are
dispatched on arrival to one board's own queue, as the control plane does; each board serves
its queue in order in its own thread. Each policy runs the same stream, in a fresh namespace,
after every board's context was moved on. Cache-aware routing calls ``inference.placement.route``
over a ``FleetIndex`` fed exactly as the control plane feeds it (what was dispatched where,
what came back), so the bench measures the control plane's function.

TTFT here is from arrival: the wait in the board's queue plus the board's own TTFT.
``ttft_ms_p90`` is ``common.percentile`` (linear between ranks) from format 1 on; documents
without a format took the nearest rank.
"""

from __future__ import annotations

import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from cachebox.keys import parse_entry_key_name
from cachebox.link import LINK_PRESETS
from dashboard import mmlu
from dashboard.bench.base import BenchError, Benchmark, topics_named
from dashboard.bench.common import machine_info, median, percentile
from dashboard.bench.html_report import write_report
from inference.placement import FleetIndex, prompt_keys, route

POLICIES = ("random", "round-robin", "cache-aware")
DEFAULT_TOPICS = ("astronomy", "high_school_biology", "world_religions", "marketing")
FILLER = ["A prompt about something else entirely, to move the board's context on."]


@dataclass
class _Job:
    index: int
    topic: str
    segments: list[str]
    keys: dict  # board name -> PromptKeys (every board shares the model and the namespace here)
    request_id: str = ""
    arrived: float = 0.0
    board: str = ""


def idle_while_waiting(records: list[dict], boards: list[str]) -> float:
    """Seconds during which some board was idle while a run waited in another board's queue."""
    events = []
    for r in records:
        events += [
            (r["arrived_s"], "arrive", r["board"]),
            (r["started_s"], "start", r["board"]),
            (r["finished_s"], "finish", r["board"]),
        ]
    order = {"finish": 0, "arrive": 1, "start": 2}
    events.sort(key=lambda e: (e[0], order[e[1]]))
    waiting = {board: 0 for board in boards}
    busy = {board: False for board in boards}
    total, last = 0.0, None
    for at, kind, board in events:
        if last is not None and any(waiting.values()) and not all(busy.values()):
            total += at - last  # a run waits in a queue while some board has nothing to do
        last = at
        if kind == "arrive":
            waiting[board] += 1
        elif kind == "start":
            waiting[board] -= 1
            busy[board] = True
        else:
            busy[board] = False
    return round(total, 3)


def _fleet_index(boards) -> FleetIndex:
    """The fleet index cache-aware routing consults, told each board's own measured rates."""
    index = FleetIndex(prefill_prior=sum(b.config.prefill_ms_per_token for b in boards) / len(boards))
    for board in boards:  # what each measured of itself at start, as its heartbeats tell the control plane
        if board.rates is not None:
            index.measured(
                board.config.device,
                prefill_ms_per_token=board.rates.prefill_ms_per_token,
                decode_ms_per_token=board.rates.decode_ms_per_token,
            )
    return index


def _reset_boards(boards, namespace: str) -> None:
    """Move every board's context on and clear its RAM tier, so that every policy starts alike."""
    for board in boards:  # every policy starts with the same (empty) local tiers
        board.run(FILLER, max_tokens=1, namespace=namespace, upload=False)
        if board.prefix.ram is not None:
            board.prefix.ram.clear()


def _reported(index: FleetIndex, name: str, job: _Job, result, b, finished: float) -> None:
    """Tell the index what came back of ``job`` on board ``name`` (``b`` its breakdown, None if it failed)."""
    if b is not None:
        stored = [parse_entry_key_name(entry.name)[2].hex() for entry in result.uploaded]
        index.reported(
            name,
            job.request_id,
            prompt_tokens=b.prompt_tokens,
            matched_tokens=b.matched_tokens,
            prefill_ms=b.prefill_ms,
            decode_ms=b.decode_ms,
            generated_tokens=b.generated_tokens,
            stored_keys=stored,
            at=finished,
        )
    else:
        index.reported(name, job.request_id, failed=True, at=finished)


def _record(job: _Job, name: str, error: str, started: float, finished: float, b) -> dict:
    """One run's record: its times (perf_counter), TTFT from arrival, where its state came from, bytes moved."""
    return {
        "index": job.index,
        "topic": job.topic,
        "board": name,
        "error": error,
        "arrived_s": job.arrived,
        "started_s": started,
        "finished_s": finished,
        "wait_ms": round((started - job.arrived) * 1000.0, 3),
        "service_ttft_ms": b.ttft_ms if b else 0.0,
        "ttft_ms": round((started - job.arrived) * 1000.0 + (b.ttft_ms if b else 0.0), 3),
        "tier": str(b.tier) if b else "",
        "case": str(b.case) if b else "",
        "decision": str(b.decision) if b else "",
        "matched_tokens": b.matched_tokens if b else 0,
        "prompt_tokens": b.prompt_tokens if b else 0,
        "fetched_bytes": b.fetched_bytes if b else 0,
        "uploaded_bytes": b.uploaded_bytes if b else 0,
    }


def _serve(
    board,
    name: str,
    jobs: queue.Queue,
    index: FleetIndex,
    lock: threading.Lock,
    records: list[dict],
    *,
    max_tokens: int,
    namespace: str,
    progress: Callable[[], None] | None,
) -> None:
    """One board's worker: serve its queue in order until None, telling the index of each run and recording it."""
    while True:
        job = jobs.get()
        if job is None:
            return
        started = time.perf_counter()
        error = ""
        try:
            result = board.run(job.segments, max_tokens=max_tokens, namespace=namespace)
            b = result.breakdown
        except Exception as exc:  # a bench run reports it, and the fleet goes on
            error, result, b = f"{type(exc).__name__}: {exc}", None, None
        finished = time.perf_counter()
        with lock:
            _reported(index, name, job, result, b, finished)
            records.append(_record(job, name, error, started, finished, b))
        if progress:
            progress()


def _choose(
    policy: str, job: _Job, names: list[str], index: FleetIndex, rng: random.Random, *, link, ram_budget_bytes: int
) -> tuple:
    """The board ``policy`` sends ``job`` to, its estimate (None: cache-blind) and the decision's record (cache-aware only)."""
    if policy == "random":
        return rng.choice(names), None, None  # a cache-blind policy: the whole prompt's prefill
    if policy == "round-robin":
        return names[job.index % len(names)], None, None
    views = [
        index.view(name, job.keys[name], link=link, ram_budget_bytes=ram_budget_bytes, now=job.arrived)
        for name in names
    ]
    decision = route(job.keys[names[0]].tokens, views)
    record = {
        k: v
        for k, v in decision.record().items()
        if k in ("board", "expected_ms", "queued_ms", "held_tokens", "source", "saving_ms")
    }
    return decision.board, decision.chosen, record


def _policy_summary(policy: str, records: list[dict], names: list[str], t0: float, decisions: list[dict]) -> dict:
    """The policy's figures from its runs' records (their times made relative to the stream's start ``t0``)."""
    records.sort(key=lambda r: r["index"])
    served = [r for r in records if not r["error"]]
    ttfts = [r["ttft_ms"] for r in served]
    service = [r["service_ttft_ms"] for r in served]
    tiers = {}
    for r in served:
        tier = r["tier"] or "computed"
        tiers[tier] = tiers.get(tier, 0) + 1
    makespan = max(r["finished_s"] for r in records) - t0 if records else 0.0
    idle = idle_while_waiting(records, names)
    for r in records:  # relative times for the JSON
        for key in ("arrived_s", "started_s", "finished_s"):
            r[key] = round(r[key] - t0, 4)
    return {
        "policy": policy,
        "runs": len(records),
        "errors": len(records) - len(served),
        "ttft_ms_p50": median(ttfts),
        "ttft_ms_p90": percentile(ttfts, 90),
        "service_ttft_ms_p50": median(service),
        "wait_ms_p50": median(r["wait_ms"] for r in served),
        "hit_ratio_by_tier": {tier: round(count / len(served), 4) for tier, count in sorted(tiers.items())}
        if served
        else {},
        "matched_tokens_total": sum(r["matched_tokens"] for r in served),
        "prompt_tokens_total": sum(r["prompt_tokens"] for r in served),
        "fetched_mb": round(sum(r["fetched_bytes"] for r in served) / 1e6, 2),
        "uploaded_mb": round(sum(r["uploaded_bytes"] for r in served) / 1e6, 2),
        "runs_per_board": {name: sum(1 for r in records if r["board"] == name) for name in names},
        "makespan_s": round(makespan, 3),
        "idle_while_waiting_s": idle,
        "idle_while_waiting_share": round(idle / makespan, 4) if makespan else 0.0,
        "decisions": decisions,
        "records": records,
    }


def run_policy(
    boards,
    jobs: list[_Job],
    policy: str,
    *,
    interval_s: float,
    namespace: str,
    link,
    max_tokens: int,
    ram_budget_bytes: int,
    seed: int,
    progress: Callable[[], None] | None = None,
) -> dict:
    """One policy over one arrival stream: each board serves its own queue while the jobs are dispatched on arrival."""
    names = [board.config.device for board in boards]
    by_name = dict(zip(names, boards))
    index = _fleet_index(boards)
    lock = threading.Lock()
    queues = {name: queue.Queue() for name in names}
    records: list[dict] = []
    rng = random.Random(seed)
    decisions: list[dict] = []
    _reset_boards(boards, namespace)
    workers = [
        threading.Thread(
            target=_serve,
            args=(by_name[name], name, queues[name], index, lock, records),
            kwargs={"max_tokens": max_tokens, "namespace": namespace, "progress": progress},
            name=f"fleet-{name}",
            daemon=True,
        )
        for name in names
    ]
    for worker in workers:
        worker.start()
    t0 = time.perf_counter()
    try:
        for job in jobs:
            delay = t0 + job.index * interval_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            job.arrived = time.perf_counter()
            job.request_id = str(uuid.uuid4())
            with lock:
                chosen, chosen_estimate, record = _choose(
                    policy, job, names, index, rng, link=link, ram_budget_bytes=ram_budget_bytes
                )
                if record is not None:
                    decisions.append(record)
                index.dispatched(
                    chosen,
                    job.request_id,
                    job.keys[chosen],
                    index.work_ms(chosen, job.keys[chosen], max_tokens, link, estimate=chosen_estimate),
                    at=job.arrived,
                )
            job.board = chosen
            queues[chosen].put(job)
    finally:
        for name in names:
            queues[name].put(None)
        for worker in workers:
            worker.join()
    return _policy_summary(policy, records, names, t0, decisions)


def build_jobs(boards, prompts_by_topic: dict[str, list], *, namespace: str, seed: int) -> list[_Job]:
    """The arrival stream: every topic's prompts, interleaved by a seeded shuffle."""
    first = boards[0]
    jobs = []
    for topic, prompts in prompts_by_topic.items():
        for prompt in prompts:
            tokens, cuts = first.prefix.layout(prompt.segments)
            keys = {
                board.config.device: prompt_keys(
                    namespace, board.engine.fingerprint, tokens, grid=board.prefix.chunk_tokens, extra=cuts
                )
                for board in boards
            }
            jobs.append(_Job(0, topic, prompt.segments, keys))
    random.Random(seed).shuffle(jobs)
    for number, job in enumerate(jobs):
        job.index = number
    return jobs


def run_fleet(
    boards,
    prompts_by_topic: dict[str, list],
    *,
    link,
    link_name: str,
    max_tokens: int = 4,
    interval_s: float | None = None,
    spacing: float = 1.0,
    ram_budget_bytes: int = 0,
    seed: int = 7,
    namespace_prefix: str = "bench-fleet",
    progress: Callable[[], None] | None = None,
) -> dict:
    """Each policy over the same arrival stream; ``interval_s`` defaults to ``spacing`` x one cold TTFT (one board alone)."""
    sample = next(iter(prompts_by_topic.values()))[0]
    cold = [boards[0].run(sample.segments, max_tokens=1, use_cache=False).breakdown.ttft_ms for _ in range(2)][-1]
    interval = interval_s if interval_s is not None else spacing * cold / 1000.0
    results = {}
    namespaces = []
    try:
        for number, policy in enumerate(POLICIES):
            namespace = f"{namespace_prefix}-{uuid.uuid4().hex[:8]}"
            namespaces.append(namespace)
            jobs = build_jobs(boards, prompts_by_topic, namespace=namespace, seed=seed)
            results[policy] = run_policy(
                boards,
                jobs,
                policy,
                interval_s=interval,
                namespace=namespace,
                link=link,
                max_tokens=max_tokens,
                ram_budget_bytes=ram_budget_bytes,
                seed=seed + number,
                progress=progress,
            )
    finally:
        for namespace in namespaces:
            try:
                boards[0].store.flush(namespace)
            except Exception:  # the cache box gone at the end: nothing to clean
                pass
            for board in boards:
                if board.catalogs is not None:
                    board.catalogs.forget(namespace)
    rr, ca = results["round-robin"], results["cache-aware"]
    speedup = round(rr["ttft_ms_p50"] / ca["ttft_ms_p50"], 3) if ca["ttft_ms_p50"] else None
    return {
        "boards": len(boards),
        "link": link_name,
        "link_label": (link.label or f"{link.bandwidth_mbps} Mbit/s") if link else "unshaped (loopback)",
        "topics": list(prompts_by_topic),
        "prompts": sum(len(p) for p in prompts_by_topic.values()),
        "max_tokens": max_tokens,
        "ram_tier_mb": round(ram_budget_bytes / 2**20, 1),
        "cold_ttft_ms_alone": round(cold, 3),
        "interval_ms": round(interval * 1000.0, 3),
        "policies": results,
        "median_ttft_round_robin_over_cache_aware": speedup,
        "target_met": bool(speedup and speedup >= 2.0),
    }


def fleet_report(path, doc: dict):
    """The HTML report: TTFT percentiles and where each policy's states came from."""
    import plotly.graph_objects as go

    policies = doc["policies"]
    names = list(policies)
    ttft = go.Figure()
    ttft.add_bar(x=names, y=[policies[p]["ttft_ms_p50"] for p in names], name="median TTFT")
    ttft.add_bar(x=names, y=[policies[p]["ttft_ms_p90"] for p in names], name="p90 TTFT")
    ttft.update_layout(
        title=f"TTFT from arrival, {doc['boards']} boards, {doc['link_label']} (ms)",
        barmode="group",
        yaxis_title="ms",
        template="plotly_white",
    )
    tiers = sorted({tier for p in names for tier in policies[p]["hit_ratio_by_tier"]})
    by_tier = go.Figure(
        [
            go.Bar(name=tier, x=names, y=[policies[p]["hit_ratio_by_tier"].get(tier, 0.0) for p in names])
            for tier in tiers
        ]
    )
    by_tier.update_layout(
        title="Where each run's prompt state came from (share of runs)", barmode="stack", template="plotly_white"
    )
    over_time = go.Figure()
    for p in names:
        records = policies[p]["records"]
        over_time.add_scatter(
            x=[r["arrived_s"] for r in records],
            y=[r["ttft_ms"] for r in records],
            mode="markers",
            name=p,
            text=[f"{r['board']} {r['tier'] or 'computed'}" for r in records],
        )
    over_time.update_layout(
        title="TTFT of every run by arrival time",
        xaxis_title="s",
        yaxis_title="ms",
        yaxis_type="log",
        template="plotly_white",
    )
    rows = [
        {
            "policy": p,
            **{
                k: policies[p][k]
                for k in (
                    "ttft_ms_p50",
                    "ttft_ms_p90",
                    "service_ttft_ms_p50",
                    "wait_ms_p50",
                    "idle_while_waiting_s",
                    "fetched_mb",
                    "uploaded_mb",
                    "errors",
                )
            },
            "tiers": ", ".join(f"{t or 'computed'} {v}" for t, v in policies[p]["hit_ratio_by_tier"].items()),
            "runs per board": ", ".join(f"{b} {n}" for b, n in policies[p]["runs_per_board"].items()),
        }
        for p in names
    ]
    return write_report(
        path,
        f"bench fleet: {doc['boards']} boards, {doc['link']}",
        doc.get("summary", ""),
        [ttft, by_tier, over_time],
        {"Policies": rows},
        doc,
    )


# -- the command (python manage.py bench fleet) --------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--boards", type=int, default=4, help="in-process boards, 1 llama.cpp thread each (default 4)")
    parser.add_argument(
        "--topics", nargs="+", default=None, metavar="TOPIC", help="MMLU topics, interleaved (default: 4)"
    )
    parser.add_argument("--prompts", type=int, default=40, help="prompts in the stream, over all topics (default 40)")
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--link", default="wifi4", help="link preset between boards and cache box (default wifi4; none: loopback)"
    )
    parser.add_argument(
        "--ram-mb",
        type=int,
        default=None,
        help="each board's RAM tier in MB (default: the board default, EDGECACHE_RAM_TIER_MB)",
    )
    parser.add_argument(
        "--spacing",
        type=float,
        default=1.0,
        help="arrivals every this many cold TTFTs of one board alone (default 1.0)",
    )
    parser.add_argument("--seed", type=int, default=7)


def _ram_tier_bytes(board) -> int:
    """The RAM tier a board got (without --ram-mb its memory plan sized it; 0: none)."""
    ram = board.prefix.ram
    return ram.entries.budget_bytes if ram is not None else 0


def run(ctx, *, boards, topics, prompts, shots, max_tokens, link, ram_mb, spacing, seed, **options) -> dict:
    from contextlib import ExitStack

    if boards < 2 or prompts < boards or max_tokens < 1 or spacing <= 0 or not 0 <= shots <= 8:
        raise BenchError(
            "--boards must be at least 2, --prompts at least --boards, --max-tokens at least 1, --spacing positive, --shots 0 to 8"
        )
    if link not in LINK_PRESETS:
        raise BenchError(f"--link must be one of {', '.join(LINK_PRESETS)}")
    chosen = topics_named(topics or DEFAULT_TOPICS)
    try:
        per_topic = [
            prompts // len(chosen) + (1 if index < prompts % len(chosen) else 0) for index in range(len(chosen))
        ]
        by_topic = {topic: mmlu.build_prompts(topic, shots, count) for topic, count in zip(chosen, per_topic) if count}
    except (mmlu.UnknownTopic, ValueError, FileNotFoundError) as exc:
        raise BenchError(str(exc))
    profile = LINK_PRESETS[link]
    base = ctx.config.with_(
        threads=1, link=profile, ram_tier_bytes=ram_mb * 1024 * 1024 if ram_mb is not None else None, context_reuse=True
    )
    with ExitStack() as stack:
        started = [
            stack.enter_context(
                ctx.board(base.with_(device=f"fleet-{number}"), cachebox_only=False, background_sync=True)
            )
            for number in ctx.progress(
                iterable=range(boards), desc=f"bench fleet: loading {boards} boards", unit="board"
            )
        ]
        with ctx.progress(total=len(POLICIES) * prompts, desc=f"bench fleet ({link})", unit="run") as bar:
            document = run_fleet(
                started,
                by_topic,
                link=profile,
                link_name=link,
                max_tokens=max_tokens,
                spacing=spacing,
                ram_budget_bytes=_ram_tier_bytes(started[0]),
                seed=seed,
                progress=bar.update,
            )
        document.update({"shots": shots, "seed": seed, "machine": machine_info(started[0])})
    document["summary"] = (
        f"Median TTFT round-robin / cache-aware = {document['median_ttft_round_robin_over_cache_aware']} (target 2x: {document['target_met']}); "
        f"{document['boards']} boards on {document['link_label']}."
    )
    return document


def lines(doc: dict) -> list[str]:
    out = [
        f"\n{doc['boards']} boards, {doc['link_label']}, RAM tier {doc['ram_tier_mb']} MB; {doc['prompts']} prompts of "
        f"{len(doc['topics'])} topics, one every {doc['interval_ms']:.0f} ms (cold TTFT alone {doc['cold_ttft_ms_alone']:.0f} ms)",
        f"{'policy':<13}{'TTFT p50':>10}{'p90':>10}{'service p50':>13}{'wait p50':>10}{'idle+waiting':>14}  tiers",
    ]
    for name, row in doc["policies"].items():
        tiers = ", ".join(f"{tier} {share:.2f}" for tier, share in row["hit_ratio_by_tier"].items())
        p90 = "-" if row["ttft_ms_p90"] is None else f"{row['ttft_ms_p90']:.1f}"
        out.append(
            f"{name:<13}{row['ttft_ms_p50']:>10.1f}{p90:>10}{row['service_ttft_ms_p50']:>13.1f}{row['wait_ms_p50']:>10.1f}{row['idle_while_waiting_s']:>12.2f} s  {tiers}"
            + (f"  ({row['errors']} errors)" if row["errors"] else "")
        )
    out.append(doc["summary"])
    return out


BENCH = Benchmark(
    name="fleet",
    format=1,
    help="random, round-robin and cache-aware routing of one MMLU arrival stream over N in-process boards",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=fleet_report,
)

"""Exactness of reuse: a cached answer is the cold answer.

Two measurements, side by side in one run:
- the cost of cutting every prefill on a fixed absolute grid (what makes resumed prefills
  bit-exact), against plain prefill in ``n_batch`` batches, for several grid sizes; and the
  logits at the last position, cold against restored-then-resumed at the last grid point
  before the end (bitwise, per prompt);
- greedy agreement of served answers with the same prompt computed cold (no cache), over
  MMLU topics whose prompts share their instruction and examples: the first prompt of a
  topic misses and stores, the others are partial hits on its ranges, then every prompt
  runs again as a full hit.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Callable

import numpy as np

from dashboard.bench.base import BenchError, Benchmark, topics_named
from dashboard.bench.common import machine_info, median
from dashboard.bench.reports import exact_report
from dashboard.mmlu import MMLUPrompt, build_prompts
from inference.engine.llama import MAIN_SEQ

GRIDS = (64, 128, 256)


def _grid_cuts(grid: int, count: int) -> list[int]:
    return list(range(grid, count, grid))


def cut_costs(
    engine,
    prompts: list[MMLUPrompt],
    tokenize,
    *,
    grids=GRIDS,
    board_grid: int = 128,
    repeats: int = 2,
    progress=None,
    layout=None,
) -> dict:
    """Median cold prefill time per grid (and without cuts), and on the board's grid plus every
    segment's end (the instruction and each example end a batch: why segment ends are not cuts),
    measured interleaved in random order."""
    segmented = f"every {board_grid} + segment ends"
    last = f"every {board_grid} + last segment and paragraph starts"  # what the board does (``layout``: PrefixServing.layout)
    variants = {
        "n_batch only": None,
        **{f"every {grid}": grid for grid in grids},
        last: board_grid,
        segmented: board_grid,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    order_rng = random.Random(0)
    for _ in range(repeats):
        for prompt in prompts:
            tokens, ends = tokenize(prompt.segments)
            order = list(variants.items())
            order_rng.shuffle(order)
            for name, grid in order:
                cuts = _grid_cuts(grid, len(tokens)) if grid else ()
                if name == segmented:
                    cuts = sorted({*cuts, *ends[:-1]})
                elif name == last:
                    cuts = sorted({*cuts, *(layout(prompt.segments)[1] if layout is not None else ends[-2:-1])})
                with engine.lock:
                    engine.clear()
                    started = time.perf_counter()
                    engine.prefill(tokens, 0, logits_at={len(tokens) - 1}, cuts=cuts)
                    times[name].append((time.perf_counter() - started) * 1000.0)
            if progress:
                progress()
    base = median(times["n_batch only"])
    return {
        name: {"prefill_ms": median(values), "ratio_to_uncut": round(median(values) / base, 4) if base else None}
        for name, values in times.items()
    }


def resumed_logits_identical(engine, tokens: list[int], grid: int, extra=()) -> tuple[bool, float]:
    """Cold prefill vs restore of ``[0, r)`` + prefill of the rest, r the last cut before the end
    (a grid point, or where the last segment or paragraph begins), both cut as the board cuts them."""
    count = len(tokens)
    cuts = sorted({*_grid_cuts(grid, count), *(cut for cut in extra if 0 < cut < count)})
    resume = cuts[-1] if cuts else 0
    with engine.lock:
        engine.clear()
        cold = engine.prefill(tokens, 0, logits_at={count - 1}, cuts=cuts)[count - 1]
        state = engine.export_range(0, resume) if resume else b""
        engine.clear()
        if resume:
            engine.import_range(state)
        warm = engine.prefill(tokens[resume:], resume, logits_at={count - 1}, cuts=cuts)[count - 1]
        engine.remove(MAIN_SEQ)
    return bool(np.array_equal(cold, warm)), float(np.max(np.abs(cold - warm)))


def run_exact(
    board,
    topics: list[str],
    per_topic: int,
    shots: int,
    *,
    max_tokens: int = 8,
    progress: Callable[[], None] | None = None,
) -> dict:
    prompts_by_topic = {topic: build_prompts(topic, shots, per_topic) for topic in topics}
    every = [prompt for prompts in prompts_by_topic.values() for prompt in prompts]
    grid = board.prefix.chunk_tokens
    tokenize = board.prefix.tokenize
    costs = cut_costs(
        board.engine, every[: min(len(every), 24)], tokenize, board_grid=grid, progress=None, layout=board.prefix.layout
    )
    identical, max_diff = 0, 0.0
    rows = []
    for topic, prompts in prompts_by_topic.items():
        namespace = f"bench-exact-{uuid.uuid4().hex[:10]}"
        try:
            for phase in ("first pass", "again"):
                for prompt in prompts:
                    cold = board.run(prompt.segments, max_tokens=max_tokens, use_cache=False)
                    served = board.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)
                    if phase == "first pass":
                        tokens, cuts = board.prefix.layout(prompt.segments)
                        same, diff = resumed_logits_identical(board.engine, tokens, grid, cuts)
                        identical += same
                        max_diff = max(max_diff, diff)
                    b = served.breakdown
                    rows.append(
                        {
                            "topic": topic,
                            "phase": phase,
                            "case": str(b.case),
                            "matched_tokens": b.matched_tokens,
                            "prompt_tokens": b.prompt_tokens,
                            "agree": served.tokens == cold.tokens,
                            "first_token_agrees": served.tokens[:1] == cold.tokens[:1],
                            "cold_ttft_ms": cold.breakdown.ttft_ms,
                            "ttft_ms": b.ttft_ms,
                        }
                    )
                    if progress:
                        progress()
        finally:
            board.store.flush(namespace)
            board.catalogs.forget(namespace)

    def agreement(case: str) -> dict:
        chosen = [row for row in rows if row["case"] == case]
        return {
            "runs": len(chosen),
            "greedy_agreement": round(sum(row["agree"] for row in chosen) / len(chosen), 4) if chosen else None,
            "median_ttft_ms": median(row["ttft_ms"] for row in chosen),
            "median_cold_ttft_ms": median(row["cold_ttft_ms"] for row in chosen),
            "median_matched_tokens": median(row["matched_tokens"] for row in chosen),
        }

    return {
        "grid": grid,
        "max_tokens": max_tokens,
        "prompts": len(every),
        "topics": topics,
        "cut_costs": costs,
        "resumed_logits_bitwise_identical": f"{identical}/{len(every)}",
        "resumed_logits_max_abs_diff": max_diff,
        "by_case": {case: agreement(case) for case in ("miss", "partial", "full")},
        "greedy_agreement_all": round(sum(row["agree"] for row in rows) / len(rows), 4) if rows else None,
        "rows": rows,
    }


# -- the command (python manage.py bench exact) --------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--topics", nargs="+", default=["astronomy", "high_school_biology", "world_religions"], metavar="TOPIC"
    )
    parser.add_argument("--prompts", type=int, default=34, help="questions per topic (default 34: 102 over 3 topics)")
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8, help="greedy tokens compared per run")


def run(ctx, *, topics, prompts, shots, max_tokens, **options) -> dict:
    chosen = topics_named(topics)
    if prompts < 2:
        raise BenchError("--prompts must be at least 2 (the first prompt of a topic stores, the others hit)")
    with ctx.board() as board:
        with ctx.progress(
            total=2 * prompts * len(chosen), desc=f"bench exact ({len(chosen)} topics, {shots}-shot)", unit="run"
        ) as bar:
            document = run_exact(board, chosen, prompts, shots, max_tokens=max_tokens, progress=bar.update)
        document.update({"shots": shots, "machine": machine_info(board)})
    return document


def lines(doc: dict) -> list[str]:
    out = [f"\ngrid {doc['grid']} tokens; cold prefill, median ms (ratio to n_batch batches):"]
    for name, row in doc["cut_costs"].items():
        out.append(f"  {name:<14} {row['prefill_ms']:9.1f}  x{row['ratio_to_uncut']}")
    out.append(
        f"resumed logits bitwise identical to cold: {doc['resumed_logits_bitwise_identical']} (max |diff| {doc['resumed_logits_max_abs_diff']})"
    )
    for case, row in doc["by_case"].items():
        out.append(
            f"  {case:<8} {row['runs']:4d} runs  greedy agreement {row['greedy_agreement']}  TTFT {row['median_ttft_ms']} ms (cold {row['median_cold_ttft_ms']} ms)"
        )
    return out


def headline(doc: dict) -> str:
    return f"greedy agreement with cold {doc['greedy_agreement_all']}; resumed logits bitwise identical {doc['resumed_logits_bitwise_identical']}"


BENCH = Benchmark(
    name="exact",
    format=1,
    help="a cached answer is the cold answer: agreement by case, and what the batch cuts cost",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=exact_report,
    headline=headline,
)

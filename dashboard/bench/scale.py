"""`bench scale`: cold and full-hit TTFT from 128 to 2048 prompt tokens (how each cost grows)."""

from __future__ import annotations

import uuid
from typing import Callable

from dashboard.bench.base import Benchmark
from dashboard.bench.common import machine_info, median
from dashboard.bench.reports import scale_report

LENGTHS = (128, 256, 512, 1024, 2048)


def filler(tokens_wanted: int, tokenize) -> str:
    """Unstructured text of about ``tokens_wanted`` tokens (no shared prefix between lengths)."""
    words, text = [], ""
    index = 0
    while True:
        words.append(f"item {index} of the inventory is a {['red', 'green', 'blue', 'grey'][index % 4]} box.")
        text = " ".join(words)
        if len(tokenize(text)) >= tokens_wanted:
            return text
        index += 1


def run_scale(board, *, repeats: int = 3, lengths=LENGTHS, progress: Callable[[], None] | None = None) -> dict:
    rows = []
    for length in lengths:
        if length + 8 > board.engine.n_ctx:
            continue
        text = filler(length, lambda t: board.engine.tokenize(t, add_bos=True))
        cold, hit, state = [], [], 0
        for _ in range(repeats):
            namespace = f"bench-scale-{uuid.uuid4().hex[:10]}"
            try:
                first = board.run(text, max_tokens=1, namespace=namespace)
                second = board.run(text, max_tokens=1, namespace=namespace)
            finally:
                board.store.flush(namespace)
                board.catalogs.forget(namespace)
            assert second.breakdown.case == "full", second.breakdown.case
            cold.append(first.breakdown.ttft_ms)
            hit.append(second.breakdown.ttft_ms)
            state = second.breakdown.fetched_bytes
            tokens = first.breakdown.prompt_tokens
        rows.append(
            {
                "prompt_tokens": tokens,
                "cold_ttft_ms": median(cold),
                "hit_ttft_ms": median(hit),
                "ratio": round(median(hit) / median(cold), 4),
                "state_bytes": state,
                "bytes_per_token": round(state / tokens, 1),
            }
        )
        if progress:
            progress()
    return {"lengths": rows, "repeats": repeats}


# -- the command (python manage.py bench scale) --------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=3)


def run(ctx, *, repeats, **options) -> dict:
    with ctx.board() as board:
        with ctx.progress(total=len(LENGTHS), desc="bench scale", unit="length") as bar:
            document = run_scale(board, repeats=repeats, progress=bar.update)
        document["machine"] = machine_info(board)
    document["summary"] = "Cold prefill grows with the prompt; a hit costs the bytes moved and restored."
    return document


def lines(doc: dict) -> list[str]:
    out = [f"\n{'tokens':>8}{'cold TTFT':>12}{'hit TTFT':>12}{'ratio':>8}{'state MB':>10}"]
    for row in doc["lengths"]:
        out.append(
            f"{row['prompt_tokens']:>8}{row['cold_ttft_ms']:>12.1f}{row['hit_ttft_ms']:>12.1f}{row['ratio']:>8.3f}{row['state_bytes'] / 1e6:>10.2f}"
        )
    return out


def headline(doc: dict) -> str:
    return f"{len(doc['lengths'])} prompt lengths"


BENCH = Benchmark(
    name="scale",
    format=1,
    help="cold and full-hit TTFT from 128 to 2048 prompt tokens",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=scale_report,
    headline=headline,
)

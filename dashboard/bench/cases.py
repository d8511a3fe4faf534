"""The paper's experiment (section 5, tables 2-4): five cache cases per MMLU prompt.

Case 1: cold, empty cache box. Case 2: the instruction is cached. Case 3: instruction +
first example. Case 4: instruction + all examples. Case 5: the whole prompt (full hit).
Each case runs in a namespace of its own, seeded with exactly that prefix, so the cases
do not feed each other; the namespaces are flushed afterwards.
"""

from __future__ import annotations

import uuid
from typing import Callable

from dashboard.bench.base import Benchmark, prompts_of
from dashboard.bench.common import machine_info, median
from dashboard.bench.reports import cases_report
from dashboard.mmlu import MMLUPrompt, parse_answer
from inference.serving.breakdown import STACK_FIELDS, Breakdown

CASE_NAMES = {
    "1": "miss",
    "2": "instruction",
    "3": "instruction + first example",
    "4": "instruction + all examples",
    "5": "full hit",
}


def seed_segments(prompt: MMLUPrompt, case: str) -> list[str] | None:
    """The prefix that must be in the cache box before the measured run of ``case``."""
    shots = len(prompt.examples)
    return {
        "1": None,
        "2": prompt.segments[:1],
        "3": prompt.segments[: 1 + min(1, shots)],
        "4": prompt.segments[: 1 + shots],
        "5": prompt.segments,
    }[case]


def run_cases(
    board, prompts: list[MMLUPrompt], *, max_tokens: int = 4, progress: Callable[[], None] | None = None
) -> dict:
    """Measure every case on every prompt; returns the JSON document (medians over prompts)."""
    runs: dict[str, list[Breakdown]] = {case: [] for case in CASE_NAMES}
    tokens: dict[str, list[list[int]]] = {case: [] for case in CASE_NAMES}
    answers: dict[str, list[str | None]] = {case: [] for case in CASE_NAMES}
    for prompt in prompts:
        for case in CASE_NAMES:
            namespace = f"bench-{uuid.uuid4().hex[:12]}"
            try:
                seed = seed_segments(prompt, case)
                if seed is not None:
                    board.run(seed, max_tokens=1, namespace=namespace)
                result = board.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)
            finally:
                board.store.flush(namespace)
                board.catalogs.forget(namespace)
            runs[case].append(result.breakdown)
            tokens[case].append(result.tokens)
            answers[case].append(parse_answer(result.text))
        if progress:
            progress()

    truth = [prompt.target.answer for prompt in prompts]
    agreement = sum(a == b for a, b in zip(tokens["1"], tokens["5"])) / len(prompts)
    cases = {case: {"name": CASE_NAMES[case], **summarize(runs[case])} for case in CASE_NAMES}
    cold, full = cases["1"]["ttft_ms"], cases["5"]["ttft_ms"]
    return {
        "cases": cases,
        "greedy_agreement": round(agreement, 4),
        "accuracy": {
            case: round(sum(a == t for a, t in zip(answers[case], truth)) / len(truth), 4) for case in ("1", "5")
        },
        "ttft_ratio_full_to_cold": round(full / cold, 4) if cold else None,
        "bytes_per_cached_token": round(cases["5"]["state_bytes"] / max(1, cases["5"]["matched_tokens"]), 1),
        "catalog_lookup_ms": median(run.bloom_ms for case_runs in runs.values() for run in case_runs),
        "n": len(prompts),
    }


def summarize(runs: list[Breakdown]) -> dict:
    return {
        "ttft_ms": median(r.ttft_ms for r in runs),
        "ttlt_ms": median(r.ttlt_ms for r in runs),
        "breakdown_ms": {
            field: median(getattr(r, field) for r in runs)
            for field in (*STACK_FIELDS, "fetch_ms", "verify_ms", "restore_ms", "upload_ms")
        },
        "matched_tokens": median(r.matched_tokens for r in runs),
        "prompt_tokens": median(r.prompt_tokens for r in runs),
        "state_bytes": median(r.state_bytes for r in runs),
        "cases_seen": {name: sum(r.case == name for r in runs) for name in ("miss", "partial", "full")},
    }


# -- the command (python manage.py bench cases) --------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--topic", default="astronomy", help="MMLU topic (see `bench topics`)")
    parser.add_argument("--prompts", type=int, default=20, help="number of target questions")
    parser.add_argument("--shots", type=int, default=5, help="few-shot examples per prompt")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per run")


def run(ctx, *, topic, prompts, shots, max_tokens, **options) -> dict:
    selected = prompts_of(topic, shots, prompts)
    with ctx.board() as board:
        with ctx.progress(
            total=len(selected), desc=f"bench cases ({selected[0].target.topic}, {shots}-shot)", unit="prompt"
        ) as bar:
            document = run_cases(board, selected, max_tokens=max_tokens, progress=bar.update)
        document.update(
            {
                "topic": selected[0].target.topic,
                "shots": shots,
                "max_tokens": max_tokens,
                "machine": machine_info(board),
            }
        )
    return document


def lines(doc: dict) -> list[str]:
    out = [
        f"\nMedians over {doc['n']} prompts ({doc['topic']}, {doc['shots']}-shot), milliseconds:",
        f"{'case':<32}{'TTFT':>9}{'TTLT':>9}{'Token':>8}{'Bloom':>7}{'P-dec':>9}{'Redis':>8}{'R-dec':>8}{'Sample':>8}{'matched':>9}{'tokens':>8}{'MB':>7}",
    ]
    for case, row in doc["cases"].items():
        b = row["breakdown_ms"]
        out.append(
            f"{case + ' ' + row['name']:<32}{row['ttft_ms']:>9.1f}{row['ttlt_ms']:>9.1f}{b['token_ms']:>8.2f}{b['bloom_ms']:>7.3f}"
            f"{b['prefill_ms']:>9.1f}{b['redis_ms']:>8.1f}{b['decode_ms']:>8.1f}{b['sample_ms']:>8.2f}"
            f"{row['matched_tokens']:>9.0f}{row['prompt_tokens']:>8.0f}{row['state_bytes'] / 1e6:>7.2f}"
        )
    out.append(
        f"full-hit TTFT / cold TTFT = {doc['ttft_ratio_full_to_cold']}; greedy agreement = {doc['greedy_agreement']}; "
        f"accuracy case 1 = {doc['accuracy']['1']}, case 5 = {doc['accuracy']['5']}; "
        f"bytes per cached token = {doc['bytes_per_cached_token']}; catalog lookup median = {doc['catalog_lookup_ms']} ms"
    )
    full = doc["cases"].get("5", {}).get("breakdown_ms", {})
    if "verify_ms" in full:
        out.append(
            f"full hit: signature and digest checks {full['verify_ms']:.2f} ms of {full['redis_ms']:.1f} ms fetch + restore"
        )
    return out


def headline(doc: dict) -> str:
    return f"full hit / cold TTFT {doc['ttft_ratio_full_to_cold']}, greedy agreement {doc['greedy_agreement']}, n={doc['n']}"


BENCH = Benchmark(
    name="cases",
    format=1,
    help="cases 1-5 of the paper on MMLU prompts",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=cases_report,
    headline=headline,
)

"""``bench kernels``: how far a state computed by one kernel class is from another class's own cold run.

Boards of different kernel classes (``inference.engine.kernels``) never share states as exact. A namespace
may share them anyway (approximate, opt-in); this measures what that costs in agreement, for every
ordered pair of classes this machine can run: the project's llama.cpp build (AVX2 on x86-64) and the
other builds of the same sources the CPU runs, SSE4.2 kernels on any x86-64 CPU and AVX-512 ones
where it has them (``dashboard.bench.llama_kernels``, loaded with ``LLAMA_CPP_LIB_PATH``). One
process can load only one llama.cpp, so each class computes in a worker process of its own (``python -m
dashboard.bench.kernels worker``), and they exchange states and logits through files.

For every MMLU prompt and class B, B's own **cold run** (prefilled on the board's 128-token grid and
cuts, then 32 greedy tokens) is the reference. For every class A (A = B too: the control, which must
agree bitwise), B then:
- **resume**: restores A's state of the prompt up to its last cut and computes the rest (what a
  partial hit does), then 32 greedy tokens;
- **full hit**: takes A's logits at the prompt's last position (what a full hit samples its first token from).
Compared with B's cold run: the first token, the greedy answer over 32 tokens, the MMLU verdict, the
largest |difference| of the last position's logits and the KL divergence KL(cold || served).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cachebox.keys import grid_cuts
from dashboard.bench import llama_kernels
from dashboard.bench.base import BenchError, Benchmark, topics_named
from dashboard.bench.common import host_info
from dashboard.bench.html_report import write_report
from dashboard.mmlu import build_prompts, parse_answer
from inference.engine.bindings import kernel_class, library_path
from inference.engine.llama import Engine, EngineConfig
from inference.engine.model_file import resolve_model
from inference.serving.run import text_layout

GRID = 128
MIN_QUESTIONS = 50


# -- pure: the comparisons -----------------------------------------------------------------------
def kl_divergence(reference: np.ndarray, other: np.ndarray) -> float:
    """KL(softmax(reference) || softmax(other)) in nats, computed in float64."""
    p_log = _log_softmax(np.asarray(reference, dtype=np.float64))
    q_log = _log_softmax(np.asarray(other, dtype=np.float64))
    return float(max(0.0, np.sum(np.exp(p_log) * (p_log - q_log))))


def _log_softmax(values: np.ndarray) -> np.ndarray:
    shifted = values - values.max()
    return shifted - np.log(np.sum(np.exp(shifted)))


def compare(cold: dict, served: dict, cold_logits: np.ndarray, served_logits: np.ndarray) -> dict:
    """One prompt: ``served`` (tokens, verdict) against the class's own ``cold`` run."""
    diff = np.abs(np.asarray(cold_logits, dtype=np.float64) - np.asarray(served_logits, dtype=np.float64))
    return {
        "first_token": bool(int(np.argmax(cold_logits)) == int(np.argmax(served_logits))),
        "greedy": served.get("tokens") == cold.get("tokens") if "tokens" in served else None,
        "verdict": served.get("verdict") == cold.get("verdict") if "verdict" in served else None,
        "max_abs_logit_diff": float(diff.max()),
        "kl": kl_divergence(cold_logits, served_logits),
        "bitwise": bool(np.array_equal(cold_logits, served_logits)),
    }


def summarize(rows: list[dict]) -> dict:
    """Agreement rates and logit distances over a pair's prompts."""

    def rate(name: str):
        values = [row[name] for row in rows if row.get(name) is not None]
        return round(sum(values) / len(values), 4) if values else None

    diffs = [row["max_abs_logit_diff"] for row in rows]
    kls = [row["kl"] for row in rows]
    return {
        "prompts": len(rows),
        "first_token_agreement": rate("first_token"),
        "greedy_agreement": rate("greedy"),
        "mmlu_verdict_agreement": rate("verdict"),
        "bitwise_logits": rate("bitwise"),
        "max_abs_logit_diff": round(max(diffs), 4) if diffs else None,
        "median_max_abs_logit_diff": round(float(np.median(diffs)), 4) if diffs else None,
        "mean_kl": round(float(np.mean(kls)), 6) if kls else None,
        "max_kl": round(float(np.max(kls)), 6) if kls else None,
    }


# -- the worker: one class, one process ---------------------------------------------------------
def _worker(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(args.prompts).read_text())
    engine = Engine(resolve_model(), EngineConfig(n_ctx=2048, n_threads=args.threads))
    kernels = kernel_class()
    (out / "class.json").write_text(
        json.dumps({**kernels.as_dict(), "library": library_path(), "fingerprint": engine.fingerprint})
    )

    def greedy(first: int, position: int) -> list[int]:
        tokens = [first]
        while len(tokens) < args.max_tokens and not engine.is_end_of_generation(tokens[-1]):
            logits = engine.decode_one(tokens[-1], position)
            position += 1
            tokens.append(int(np.argmax(logits)))
        return tokens

    def layout(index: int):
        tokens, extra = text_layout(engine, prompts[index]["segments"])
        cuts = grid_cuts(len(tokens), GRID, 0, extra)
        return tokens, cuts, (cuts[-1] if cuts else 0)

    if args.phase == "cold":
        for index in range(len(prompts)):
            tokens, cuts, resume = layout(index)
            with engine.lock:
                engine.clear()
                logits = engine.prefill(tokens, 0, logits_at={len(tokens) - 1}, cuts=cuts)[len(tokens) - 1]
                (out / f"state-{index}.bin").write_bytes(engine.export_range(0, resume) if resume else b"")
                np.save(out / f"logits-{index}.npy", logits)
                answer = greedy(int(np.argmax(logits)), len(tokens))
                engine.clear()
            text = engine.detokenize(answer)
            (out / f"cold-{index}.json").write_text(
                json.dumps(
                    {"tokens": answer, "text": text, "verdict": parse_answer(text), "resume": resume, "n": len(tokens)}
                )
            )
        return

    for source in args.sources:  # phase "served": restore every class's states, compare with this class's cold runs
        source = Path(source)
        name = json.loads((source / "class.json").read_text())["name"]
        rows = {"resume": [], "full": []}
        for index in range(len(prompts)):
            cold = json.loads((out / f"cold-{index}.json").read_text())
            cold_logits = np.load(out / f"logits-{index}.npy")
            tokens, cuts, resume = layout(index)
            with engine.lock:
                engine.clear()
                state = (source / f"state-{index}.bin").read_bytes()
                if state:
                    engine.import_range(state)
                logits = engine.prefill(tokens[resume:], resume, logits_at={len(tokens) - 1}, cuts=cuts)[
                    len(tokens) - 1
                ]
                answer = greedy(int(np.argmax(logits)), len(tokens))
                engine.clear()
            text = engine.detokenize(answer)
            served = {"tokens": answer, "verdict": parse_answer(text)}
            rows["resume"].append(
                {
                    "prompt": index,
                    **compare(cold, served, cold_logits, logits),
                    "verdict_cold": cold["verdict"],
                    "verdict_served": served["verdict"],
                }
            )
            rows["full"].append(
                {"prompt": index, **compare(cold, {}, cold_logits, np.load(source / f"logits-{index}.npy"))}
            )
        (out / f"served-from-{name}.json").write_text(json.dumps(rows))


# -- the command (python manage.py bench kernels) ------------------------------------------------
def classes_here() -> list[tuple[str, str | None]]:
    """(label, LLAMA_CPP_LIB_PATH) of every build this machine can run: the project's, then the others."""
    found: list[tuple[str, str | None]] = [("project build", None)]
    for variant in llama_kernels.VARIANTS:
        if llama_kernels.cpu_runs(variant):
            found.append((variant, variant))
    return found


def add_arguments(parser) -> None:
    parser.add_argument("--topics", nargs="+", default=["astronomy", "high_school_biology"], metavar="TOPIC")
    parser.add_argument(
        "--questions",
        type=int,
        default=MIN_QUESTIONS,
        help=f"MMLU questions in all, spread over the topics (at least {MIN_QUESTIONS})",
    )
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens compared per run")
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp threads of each worker (0: every core)")
    parser.add_argument(
        "--allow-few", action="store_true", help="allow fewer questions than the bench's floor (a smoke run)"
    )


def run(ctx, *, topics, questions, shots, max_tokens, threads, allow_few=False, **options) -> dict:
    if questions < MIN_QUESTIONS and not allow_few:
        raise BenchError(f"--questions must be at least {MIN_QUESTIONS} (MMLU verdicts over fewer say little)")
    chosen = topics_named(topics)
    per_topic = [
        questions // len(chosen) + (1 if index < questions % len(chosen) else 0) for index in range(len(chosen))
    ]
    prompts = [
        prompt for topic, count in zip(chosen, per_topic) if count for prompt in build_prompts(topic, shots, count)
    ]
    builds = []
    for label, variant in classes_here():
        folder = None
        if variant is not None:
            ctx.write(
                f"llama.cpp with {variant} kernels: {'cached' if llama_kernels.built(variant) else 'building it once (minutes)'}..."
            )
            try:
                folder = str(llama_kernels.ensure(variant, ctx.write))
            except llama_kernels.BuildUnavailable as exc:
                ctx.write(f"skipping the {variant} build: {exc}")
                continue
        builds.append((label, folder))
    if len(builds) < 2:
        ctx.write("only one kernel class runs here: the table holds its control pair alone")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as work:
        work = Path(work)
        (work / "prompts.json").write_text(
            json.dumps([{"segments": p.segments, "expected": p.target.answer} for p in prompts])
        )
        outs = [work / f"class-{index}" for index in range(len(builds))]
        with ctx.progress(
            total=2 * len(builds), desc=f"bench kernels ({len(builds)} classes, {len(prompts)} prompts)", unit="pass"
        ) as bar:
            for phase in ("cold", "served"):
                for (label, folder), out in zip(builds, outs):
                    _run_worker(phase, folder, out, work / "prompts.json", outs, max_tokens, threads)
                    bar.update()
        classes = [json.loads((out / "class.json").read_text()) for out in outs]
        pairs, full = [], []
        for target, out in zip(classes, outs):
            for source in classes:
                rows = json.loads((out / f"served-from-{source['name']}.json").read_text())
                pairs.append({"from": source["name"], "to": target["name"], **summarize(rows["resume"])})
                full.append({"from": source["name"], "to": target["name"], **summarize(rows["full"])})
                if source["name"] != target["name"]:
                    pairs[-1]["verdicts"] = [(row["verdict_cold"], row["verdict_served"]) for row in rows["resume"]]
    return {
        "classes": classes,
        "prompts": len(prompts),
        "topics": chosen,
        "shots": shots,
        "max_tokens": max_tokens,
        "grid": GRID,
        "resume": pairs,
        "full_hit": full,
        "seconds": round(time.perf_counter() - started, 1),
        "machine": _machine(threads),
    }


def _machine(threads: int) -> dict:
    host = host_info()
    return {
        **{key: host[key] for key in ("hostname", "platform", "cpu", "cpu_count", "python", "git_commit", "date")},
        "threads": threads or os.cpu_count(),
    }


def _run_worker(
    phase: str, folder: str | None, out: Path, prompts: Path, sources: list[Path], max_tokens: int, threads: int
) -> None:
    env = {key: value for key, value in os.environ.items() if key != "LLAMA_CPP_LIB_PATH"}
    if folder is not None:
        env["LLAMA_CPP_LIB_PATH"] = folder
    command = [
        sys.executable,
        "-m",
        "dashboard.bench.kernels",
        "worker",
        phase,
        "--out",
        str(out),
        "--prompts",
        str(prompts),
        "--max-tokens",
        str(max_tokens),
        "--threads",
        str(threads),
        "--sources",
        *map(str, sources),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2])
    if done.returncode:
        raise BenchError(
            f"the {phase} worker of {folder or 'the project build'} failed (exit {done.returncode}): {done.stderr[-1500:]}"
        )


def lines(doc: dict) -> list[str]:
    out = [
        f"\n{doc['prompts']} MMLU prompts ({', '.join(doc['topics'])}, {doc['shots']}-shot), grid {doc['grid']}; "
        f"against the restoring class's own cold run:"
    ]
    out.append(
        f"  {'state from':<18} {'restored by':<18} {'mode':<9} {'1st token':>9} {'greedy32':>9} {'MMLU':>6} {'bitwise':>8} {'max|dlogit|':>11} {'mean KL':>9}"
    )
    for mode, rows in (("resume", doc["resume"]), ("full hit", doc["full_hit"])):
        for row in rows:
            greedy = "-" if row["greedy_agreement"] is None else f"{row['greedy_agreement']:.3f}"
            verdict = "-" if row["mmlu_verdict_agreement"] is None else f"{row['mmlu_verdict_agreement']:.3f}"
            out.append(
                f"  {row['from']:<18} {row['to']:<18} {mode:<9} {row['first_token_agreement']:>9.3f} {greedy:>9} {verdict:>6} "
                f"{row['bitwise_logits']:>8.3f} {row['max_abs_logit_diff']:>11.4f} {row['mean_kl']:>9.2e}"
            )
    return out


def headline(doc: dict) -> str:
    cross = [row for row in doc["resume"] if row["from"] != row["to"]]
    if not cross:
        return f"one kernel class here ({doc['classes'][0]['name']}): control only"
    worst = min(cross, key=lambda row: row["greedy_agreement"] or 0)
    return (
        f"cross-class resume ({worst['from']} -> {worst['to']}): first token {worst['first_token_agreement']}, greedy-32 {worst['greedy_agreement']}, "
        f"MMLU verdicts {worst['mmlu_verdict_agreement']}, max |dlogit| {worst['max_abs_logit_diff']}"
    )


def report(path, doc: dict):
    import plotly.graph_objects as go

    labels = [f"{row['from']} -> {row['to']}" for row in doc["resume"]]
    agreement = go.Figure(
        [
            go.Bar(name=name, x=labels, y=[row[key] or 0 for row in doc["resume"]])
            for name, key in (
                ("first token", "first_token_agreement"),
                ("greedy 32", "greedy_agreement"),
                ("MMLU verdict", "mmlu_verdict_agreement"),
            )
        ]
    )
    agreement.update_layout(
        title="Agreement with the restoring class's own cold run (resume from the state of another class)",
        barmode="group",
        yaxis_range=[0, 1.05],
        template="plotly_white",
    )
    distance = go.Figure(
        [
            go.Bar(
                x=labels,
                y=[row["max_abs_logit_diff"] for row in doc["resume"]],
                text=[f"KL {row['mean_kl']:.2e}" for row in doc["resume"]],
            )
        ]
    )
    distance.update_layout(
        title="Largest |difference| of the last position's logits (resume)",
        yaxis_title="|dlogit|",
        template="plotly_white",
    )
    summary = headline(doc) + f". Classes: {', '.join(c['name'] + ' (' + c['digest'] + ')' for c in doc['classes'])}."
    tables = {
        "Resume (restore up to the last cut, compute the rest)": [
            {k: v for k, v in row.items() if k != "verdicts"} for row in doc["resume"]
        ],
        "Full hit (first token from the source's logits)": doc["full_hit"],
        "Classes": [{k: v for k, v in c.items() if k != "features"} for c in doc["classes"]],
    }
    return write_report(path, "bench kernels", summary, [agreement, distance], tables, doc)


BENCH = Benchmark(
    name="kernels",
    format=1,
    help="approximate sharing across kernel classes: agreement of a state of one class restored by another with its own cold run",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=report,
    headline=headline,
)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="bench kernels' worker: one kernel class's runs (internal)")
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker")
    worker.add_argument("phase", choices=("cold", "served"))
    worker.add_argument("--out", required=True)
    worker.add_argument("--prompts", required=True)
    worker.add_argument("--max-tokens", type=int, default=32)
    worker.add_argument("--threads", type=int, default=0)
    worker.add_argument("--sources", nargs="*", default=[])
    _worker(parser.parse_args())

"""bench lab: the reference engine against llama.cpp, and KV prediction (seed 001) for each k
against full prefill and the paper's applicable baselines, on the same prompts.

For each k: TTFT ratio to full prefill (5-shot MMLU prompts), greedy first-token agreement with
the base model, MMLU accuracy paired with the base, next-token KL(base || strategy) on held-out
text. Baselines: the auxiliary model alone answering (its own logits), and the base model with
a truncated prompt (BOS + the last k/n_layer of the tokens: about the auxiliary's prefill cost).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from dashboard import mmlu
from dashboard.bench.base import BenchError, Benchmark
from dashboard.bench.common import machine_info, median
from dashboard.bench.html_report import write_report
from dashboard.lab import texts
from inference.engine.llama import Engine
from inference.engine.model_file import resolve_model
from inference.lab.kv_prediction import KVPredictionServing, PredictorFileError, lab_dir


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    p = np.exp(shifted)
    return p / p.sum()


def kl_divergence(reference_logits: np.ndarray, other_logits: np.ndarray) -> float:
    """KL(p_reference || p_other) in nats over the whole vocabulary."""
    p, q = _softmax(reference_logits), _softmax(other_logits)
    return float(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30))))


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def base_logits(engine: Engine, tokens: list[int]) -> tuple[np.ndarray, float]:
    """Full prefill: logits after the prompt and the time to them (ms)."""
    engine.clear()
    started = time.perf_counter()
    logits = engine.prefill(tokens, 0, logits_at={len(tokens) - 1})[len(tokens) - 1]
    elapsed = _ms(started)
    engine.clear()
    return logits, elapsed


def truncated_tokens(tokens: list[int], fraction: float, bos: int | None) -> list[int]:
    """BOS (when the model has one) and the last ``fraction`` of the other tokens."""
    body = tokens[1:] if bos is not None and tokens and tokens[0] == bos else tokens
    keep = max(1, round(len(body) * fraction))
    return ([bos] if bos is not None else []) + body[-keep:]


def answer_letter(engine: Engine, logits: np.ndarray) -> str | None:
    return mmlu.parse_answer(engine.detokenize([int(np.argmax(logits))]))


def reference_agreement(
    engine: Engine, reference, prompts: list[str], progress: Callable[[int], None] | None = None
) -> dict:
    """Greedy next-token agreement and logit differences, reference engine vs llama.cpp."""
    agree = near = 0
    diffs = []
    for text in prompts:
        tokens = engine.tokenize(text, add_bos=True)
        served, _ = base_logits(engine, tokens)
        ours = reference.forward(tokens).logits[0].numpy()
        top = int(np.argmax(ours))
        agree += int(top == int(np.argmax(served)))
        near += int(served[top] >= served.max() - 0.5)
        diffs.append(float(np.max(np.abs(ours - served))))
        if progress:
            progress(1)
    n = len(prompts)
    return {
        "prompts": n,
        "greedy_agreement": round(agree / n, 4),
        "agreement_up_to_near_ties": round(near / n, 4),  # the reference's token is within 0.5 of llama.cpp's best
        "max_abs_logit_diff": round(max(diffs), 4),
        "median_max_abs_logit_diff": round(float(np.median(diffs)), 4),
    }


def run_lab(
    engine: Engine,
    strategies: dict[int, KVPredictionServing],
    prompts: list[mmlu.MMLUPrompt],
    heldout: list[str],
    *,
    reference=None,
    reference_prompts: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    n_layer = strategies[next(iter(strategies))].predictor.n_layer if strategies else 18
    bos = engine.bos
    document: dict = {"prompts": len(prompts), "heldout_texts": len(heldout), "ks": sorted(strategies)}
    if reference is not None and reference_prompts:
        document["reference"] = reference_agreement(engine, reference, reference_prompts, progress)

    # MMLU: TTFT, first token, answer, for the base and every strategy/baseline.
    rows = {"base": {"ttft_ms": [], "token": [], "correct": []}}
    for k in strategies:
        for name in (f"kvp{k}", f"aux{k}", f"trunc{k}"):
            rows[name] = {"ttft_ms": [], "token": [], "correct": []}

    def record(name: str, logits: np.ndarray, ms: float, prompt: mmlu.MMLUPrompt) -> None:
        rows[name]["ttft_ms"].append(ms)
        rows[name]["token"].append(int(np.argmax(logits)))
        rows[name]["correct"].append(answer_letter(engine, logits) == prompt.target.answer)

    prompt_tokens = []
    for prompt in prompts:
        tokens = engine.tokenize(prompt.text, add_bos=True)
        prompt_tokens.append(len(tokens))
        logits, ms = base_logits(engine, tokens)
        record("base", logits, ms, prompt)
        for k, strategy in strategies.items():
            started = time.perf_counter()
            predicted, _ = strategy.prefill_logits(tokens)
            record(f"kvp{k}", predicted, _ms(started), prompt)
            aux_logits, ms = base_logits(strategy.aux, tokens)
            record(f"aux{k}", aux_logits, ms, prompt)
            logits, ms = base_logits(engine, truncated_tokens(tokens, k / n_layer, bos))
            record(f"trunc{k}", logits, ms, prompt)
        if progress:
            progress(1)

    # Held-out text: next-token KL against the base at a cut three quarters into each text.
    kls = {name: [] for name in rows if name != "base"}
    for text in heldout:
        tokens = engine.tokenize(text, add_bos=True)
        tokens = tokens[: max(2, (3 * len(tokens)) // 4)]
        reference_logits, _ = base_logits(engine, tokens)
        for k, strategy in strategies.items():
            kls[f"kvp{k}"].append(kl_divergence(reference_logits, strategy.prefill_logits(tokens)[0]))
            kls[f"aux{k}"].append(kl_divergence(reference_logits, base_logits(strategy.aux, tokens)[0]))
            kls[f"trunc{k}"].append(
                kl_divergence(reference_logits, base_logits(engine, truncated_tokens(tokens, k / n_layer, bos))[0])
            )
        if progress:
            progress(1)

    base = rows["base"]
    base_ttft = median(base["ttft_ms"])
    base_accuracy = float(np.mean(base["correct"]))
    document["median_prompt_tokens"] = median(prompt_tokens)
    document["base"] = {"median_ttft_ms": base_ttft, "accuracy": round(base_accuracy, 4)}
    table = []
    for k in sorted(strategies):
        for kind, label in (
            ("kvp", f"KV prediction (k={k})"),
            ("aux", f"auxiliary alone (k={k})"),
            ("trunc", f"truncated prompt ({k}/{n_layer})"),
        ):
            row = rows[f"{kind}{k}"]
            agree = np.mean(np.array(row["token"]) == np.array(base["token"]))
            both = sum(a and b for a, b in zip(row["correct"], base["correct"]))
            only_base = sum(b and not a for a, b in zip(row["correct"], base["correct"]))
            only_this = sum(a and not b for a, b in zip(row["correct"], base["correct"]))
            ttft = median(row["ttft_ms"])
            table.append(
                {
                    "method": label,
                    "kind": kind,
                    "k": k,
                    "median_ttft_ms": ttft,
                    "ttft_ratio": round(ttft / base_ttft, 4) if base_ttft else None,
                    "first_token_agreement": round(float(agree), 4),
                    "accuracy": round(float(np.mean(row["correct"])), 4),
                    "accuracy_retention": round(float(np.mean(row["correct"])) / base_accuracy, 4)
                    if base_accuracy
                    else None,
                    "paired": {"both_correct": both, "only_base": only_base, "only_this": only_this},
                    "heldout_kl_mean": round(float(np.mean(kls[f"{kind}{k}"])), 4) if heldout else None,
                    "heldout_kl_median": round(float(np.median(kls[f"{kind}{k}"])), 4) if heldout else None,
                }
            )
    document["table"] = table
    return document


# -- report ---------------------------------------------------------------------------------------
PAPER_SOURCE = "Horton et al., KV Prediction for Improved Time to First Token (Apple), table 3 and figures 3 and 5"
# Paper figures quoted as data (table 3: OpenELM 1.1B base, multiple-choice average accuracy):
PAPER_TABLE3 = [
    {"model": "OE 1.1B (base)", "avg_accuracy": 63.43, "ttft_reduction": 1.0},
    {"model": "OE1.1B-KVP-LP-0.75", "avg_accuracy": 62.21, "ttft_reduction": 1.34},
    {"model": "OE 1.1B-0.75 (layer-pruned alone)", "avg_accuracy": 59.90, "ttft_reduction": 1.34},
    {"model": "OE1.1B-KVP-LP-0.50", "avg_accuracy": 60.75, "ttft_reduction": 1.93},
    {"model": "OE 1.1B-0.50 (layer-pruned alone)", "avg_accuracy": 57.55, "ttft_reduction": 1.93},
    {"model": "OE1.1B-KVP-LP-0.25", "avg_accuracy": 56.85, "ttft_reduction": 3.59},
    {"model": "OE 1.1B-0.25 (layer-pruned alone)", "avg_accuracy": 53.31, "ttft_reduction": 3.59},
]
DIFFERENCES = (
    "Differs from the paper: the auxiliary model is the base model's first k blocks, not trained (the paper fine-tunes "
    "layer-pruned or smaller models end to end); the predictors are per-layer linear maps fitted by ridge regression on the "
    "auxiliary's last-layer K/V (no base-model loss, no consistency-loss training); the base is Gemma-3 270M Q4_K_M on a "
    "2-core CPU through llama.cpp, not OpenELM 1.1B/3B; accuracy is 5-shot MMLU by the greedy first token."
)


def lab_report(path, doc: dict):
    import plotly.graph_objects as go

    figures = []
    styles = {
        "kvp": ("KV prediction", "circle"),
        "aux": ("auxiliary alone", "x"),
        "trunc": ("base, truncated prompt", "square"),
    }
    for metric, title in (
        ("first_token_agreement", "greedy first-token agreement with the base"),
        ("heldout_kl_mean", "next-token KL(base || method), held-out text"),
    ):
        figure = go.Figure()
        for kind, (name, symbol) in styles.items():
            rows = [row for row in doc["table"] if row["kind"] == kind]
            figure.add_trace(
                go.Scatter(
                    x=[1 / row["ttft_ratio"] if row["ttft_ratio"] else None for row in rows],
                    y=[row[metric] for row in rows],
                    mode="lines+markers+text",
                    name=name,
                    marker={"symbol": symbol, "size": 10},
                    text=[f"k={row['k']}" for row in rows],
                    textposition="top center",
                )
            )
        figure.add_trace(
            go.Scatter(
                x=[1.0],
                y=[1.0 if metric == "first_token_agreement" else 0.0],
                mode="markers",
                name="base (full prefill)",
                marker={"size": 12, "symbol": "star"},
            )
        )
        figure.update_layout(
            title=f"Efficiency-accuracy trade-off: {title}",
            xaxis_title="TTFT speed-up over full prefill (x)",
            yaxis_title=metric.replace("_", " "),
        )
        figures.append(figure)
    summary = f"{doc['prompts']} five-shot MMLU prompts, {doc['heldout_texts']} held-out texts. " + DIFFERENCES
    tables = {
        "Each k and its baselines": [
            {k: v for k, v in row.items() if k != "paired"} | row["paired"] for row in doc["table"]
        ]
    }
    if "reference" in doc:
        tables["Reference engine against llama.cpp"] = [doc["reference"]]
    tables[f"Paper (quoted as data): {PAPER_SOURCE}"] = PAPER_TABLE3
    return write_report(path, "bench lab: KV prediction (seed 001)", summary, figures, tables, doc)


# -- the command (python manage.py bench lab) ----------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--ks", nargs="+", type=int, default=[3, 6, 9], metavar="K", help="auxiliary layers to try (default 3 6 9)"
    )
    parser.add_argument("--prompts", type=int, default=300, help="5-shot MMLU prompts over all topics (default 300)")
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--heldout", type=int, default=57, help="held-out texts for the next-token KL (default 57)")
    parser.add_argument(
        "--reference-prompts",
        type=int,
        default=200,
        help="0-shot MMLU prompts the reference engine is checked on (0: skip)",
    )
    parser.add_argument(
        "--calibration-docs",
        type=int,
        default=57,
        help="calibration documents when a predictor must be fitted (default 57, one per topic)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="llama.cpp threads (default: the board's; 1 keeps timings steady on a shared machine)",
    )


def run(ctx, *, ks, prompts, shots, heldout, reference_prompts, calibration_docs, threads, **options) -> dict:
    from types import SimpleNamespace

    # lazy: the lab (torch) only here; manage.py bench imports every bench
    from dashboard.lab.fitting import ensure_predictors
    from inference.board.runtime import engine_config  # lazy: the board runtime only when a bench runs a board

    if prompts < 1 or heldout < 0 or reference_prompts < 0 or not ks or any(not 1 <= k < 18 for k in ks):
        raise BenchError(
            "--prompts must be at least 1, --heldout and --reference-prompts >= 0, every k between 1 and 17"
        )
    try:
        selected = texts.evaluation_prompts(prompts, shots)
        heldout_texts = texts.heldout_prompts(heldout)
        reference_texts = [p.text for p in texts.evaluation_prompts(reference_prompts, 0)] if reference_prompts else []
    except (ValueError, FileNotFoundError) as exc:
        raise BenchError(str(exc))
    config = ctx.config
    engine = Engine(
        resolve_model(config.model or None), engine_config(config.with_(threads=threads) if threads > 0 else config)
    )
    strategies = {}
    try:
        reference = None
        if reference_texts or any(
            not (lab_dir() / f"kvp-{engine.model_file.sha256[:16]}-k{k}.npz").exists() for k in ks
        ):
            try:
                # lazy: the lab extra (torch) only here; manage.py bench imports every bench
                from inference.lab.reference import ReferenceModel
            except ImportError as exc:
                raise BenchError(str(exc))
            ctx.write("loading the reference engine (dequantizing the GGUF)...")
            reference = ReferenceModel.load(engine.model_file.path, threads=engine.config.threads())
        with ctx.progress(total=calibration_docs, desc="fitting KV predictors (if missing)", unit="doc") as bar:
            ensure_predictors(
                engine.model_file,
                ks,
                lab_dir(),
                lambda text: engine.tokenize(text, add_bos=True),
                max_documents=calibration_docs,
                progress=bar.update,
                reference=reference,
            )
        try:
            strategies = {k: KVPredictionServing.open(engine, k, lab_dir()) for k in ks}
        except PredictorFileError as exc:
            raise BenchError(str(exc))
        with ctx.progress(
            total=len(reference_texts) + len(selected) + len(heldout_texts),
            desc=f"bench lab (k = {' '.join(map(str, ks))})",
            unit="prompt",
        ) as bar:
            document = run_lab(
                engine,
                strategies,
                selected,
                heldout_texts,
                reference=reference,
                reference_prompts=reference_texts,
                progress=bar.update,
            )
        document.update(
            {
                "shots": shots,
                "calibration": {k: s.predictor.calibration for k, s in strategies.items()},
                "machine": machine_info(SimpleNamespace(engine=engine, store=None)),
            }
        )
    finally:
        for strategy in strategies.values():
            strategy.close()
        engine.close()
    document["summary"] = "KV prediction against full prefill, the auxiliary alone and a truncated prompt."
    return document


def lines(doc: dict) -> list[str]:
    out = []
    if "reference" in doc:
        r = doc["reference"]
        out.append(
            f"\nreference engine vs llama.cpp on {r['prompts']} prompts: greedy agreement {r['greedy_agreement']}, "
            f"up to near-ties {r['agreement_up_to_near_ties']}; max |logit diff| {r['max_abs_logit_diff']} (median {r['median_max_abs_logit_diff']})"
        )
    out.append(
        f"\nbase: median TTFT {doc['base']['median_ttft_ms']} ms over {doc['prompts']} prompts, accuracy {doc['base']['accuracy']}"
    )
    out.append(f"{'method':<30}{'TTFT ms':>9}{'ratio':>7}{'agree':>7}{'acc':>7}{'KL':>8}")
    for row in doc["table"]:
        out.append(
            f"{row['method']:<30}{row['median_ttft_ms']:>9.1f}{row['ttft_ratio']:>7.3f}{row['first_token_agreement']:>7.3f}{row['accuracy']:>7.3f}"
            f"{(row['heldout_kl_mean'] if row['heldout_kl_mean'] is not None else float('nan')):>8.3f}"
        )
    return out


def headline(doc: dict) -> str:
    rows = [row for row in doc["table"] if row.get("kind") == "kvp"]
    return "KV prediction (lab): " + "; ".join(
        f"k={row['k']} TTFT x{row['ttft_ratio']}, agreement {row['first_token_agreement']}, KL {row['heldout_kl_mean']}"
        for row in rows
    )


BENCH = Benchmark(
    name="lab",
    format=1,
    help="the reference engine against llama.cpp; KV prediction (seed 001) for each k against full prefill",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=lab_report,
    headline=headline,
)

"""bench lab-exit: early exit with KV fill (seed 002) on the reference engine, across thresholds.

For each confidence measure (top-prob, similarity), threshold, exit head (plain: the model's own;
lens: ridge-fitted adapters) and with or without KV fill, on the same 5-shot MMLU prompts decoded
in batches of B against the same engine at full depth: decode tokens/s and its ratio to full
depth, the share of tokens leaving at each exit (the batch's and each sequence's own), agreement
of ``--tokens`` greedy tokens with full depth (token by token, and whole-sequence exact match),
and MMLU accuracy of the first answer token (which is itself a decode step that may exit).

Timing: every batch is prefilled once, then decoded by every configuration in a shuffled order;
tokens/s counts this process's CPU time (with one torch thread, the decoding's own time), so other
processes sharing the core do not move the ratios; wall-clock tokens/s is kept beside it.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Callable, Sequence

from dashboard import mmlu
from dashboard.bench.base import BenchError, Benchmark
from dashboard.bench.common import machine_info
from dashboard.bench.html_report import write_report
from dashboard.lab import texts
from inference.engine.llama import EngineConfig, Vocabulary
from inference.engine.model_file import resolve_model
from inference.lab.kv_prediction import lab_dir

# Paper figures quoted as data (Miao et al., "An Efficient Inference Framework for Early-exit Large
# Language Models", section 5.1 and table 1): tokens/s on one RTX 4090, techniques in the order the
# paper lists them (softmax response, hidden-state similarity, classifier).
PAPER_SOURCE = (
    "Miao et al., An Efficient Inference Framework for Early-exit LLMs (Peking University), section 5.1 and table 1"
)
PAPER_THROUGHPUT = [
    {
        "model": "T5-v1.1-small (CALM)",
        "full_vllm_tokens_per_s": 1046.47,
        "softmax": 1081.04,
        "similarity": 1165.73,
        "classifier": 1065.13,
    },
    {
        "model": "T5-v1.1-base (CALM)",
        "full_vllm_tokens_per_s": 1117.96,
        "softmax": 1777.96,
        "similarity": 1402.78,
        "classifier": 1191.98,
    },
]
PAPER_TABLE1 = [
    {
        "model": "T5-v1.1-small",
        "technique": "softmax",
        "threshold": 0.85,
        "rouge_l_to_full": 0.7670,
        "exit_rate_percent": 53.82,
    },
    {
        "model": "T5-v1.1-small",
        "technique": "classifier",
        "threshold": 0.9,
        "rouge_l_to_full": 0.6731,
        "exit_rate_percent": 66.50,
    },
    {
        "model": "T5-v1.1-base",
        "technique": "softmax",
        "threshold": 0.85,
        "rouge_l_to_full": 0.7493,
        "exit_rate_percent": 53.09,
    },
    {
        "model": "T5-v1.1-base",
        "technique": "classifier",
        "threshold": 0.92,
        "rouge_l_to_full": 0.6868,
        "exit_rate_percent": 59.06,
    },
    {
        "model": "T5-v1.1-base",
        "technique": "state (similarity)",
        "threshold": 0.95,
        "rouge_l_to_full": 0.6284,
        "exit_rate_percent": 56.53,
    },
]
DIFFERS_FROM_PAPER = [
    "Model: Gemma-3 270M, decoder-only, 18 layers, a 262k-word tied output embedding; the paper uses CALM "
    "(T5 v1.1 small/base, encoder-decoder) fine-tuned for early exit. Nothing here is trained to exit: the exit head "
    "is the model's own final norm and output embedding, or (head 'lens') that head after one linear adapter per "
    "exit fitted by closed-form ridge regression on calibration text; no dedicated exit classifier.",
    "Engine: the lab's PyTorch float32 reference engine on one CPU core; the baseline is the same engine at full "
    "depth (the paper: its vLLM prototype against vLLM, on an RTX 4090).",
    "Confidence: the exit head's top probability (the paper's softmax response is top-1 minus top-2) and the cosine "
    "between the residual stream entering and leaving the exit layer (as the paper); one constant threshold, not "
    "CALM's decaying one; exits at a few depths only (default 12, 14, 16 of 18), not after every layer.",
    "KV fill as the paper: each skipped layer's keys and values from the exit hidden state through that layer's own "
    "norm, k/v projections (and k-norm, RoPE). 'Without KV fill' leaves those cells out: deeper layers of later "
    "tokens cannot attend the exited position.",
    "Batches: fixed batches of B sequences decoded together for a fixed number of tokens (an end-of-generation token "
    "is just a token); no iteration-level scheduling (sequences neither join nor leave a batch).",
    "Task and quality: 5-shot MMLU (accuracy of the first answer token) and agreement of greedy tokens with full "
    "depth, not CNN/DM summaries and ROUGE-L. Prefill is full depth over all prompt tokens but the last, which is "
    "the first decode step (so the first answer token may exit, as every token of the paper's decoder may).",
    "Cost structure: one token at full depth reads ~0.4 GB of block weights and ~0.67 GB of output embedding, so "
    "skipping layers can save at most about 40% of a step, and top-prob pays one more head for every exit it tries "
    "and does not take.",
]


def _configs(measures: dict[str, Sequence[float]], exits: tuple[int, ...], lens: bool):
    # lazy: the lab (torch) only here; manage.py bench imports every bench
    from inference.lab.early_exit import ExitPolicy

    configs = []
    for measure, thresholds in measures.items():
        for threshold in thresholds:
            configs.append(ExitPolicy(measure, threshold, exits))
            configs.append(ExitPolicy(measure, threshold, exits, kv_fill=False))
            if lens:
                configs.append(ExitPolicy(measure, threshold, exits, head="lens"))
    return configs


def _key(policy) -> str:
    return "full" if policy is None else policy.label


def _batches(items: list, size: int) -> list[list]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def run_exit_study(
    decoder,
    vocabulary,
    prompts: list[mmlu.MMLUPrompt],
    mmlu_prompts: list[mmlu.MMLUPrompt],
    configs: list,
    *,
    batch: int,
    tokens: int,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """The curve for one batch size. ``prompts`` are decoded for ``tokens`` greedy tokens by every
    configuration and at full depth (speed, exits, agreement, MMLU); ``mmlu_prompts`` only for
    their first answer token (MMLU accuracy on more questions)."""
    n_layer = decoder.config.n_layer
    policies = [None, *configs]
    shuffle = random.Random(seed)
    record = {
        _key(p): {"tokens": [], "decode_s": 0.0, "wall_s": 0.0, "generated": 0, "depths": [], "ready": [], "first": []}
        for p in policies
    }
    for kind, chosen, steps in (("decode", prompts, tokens), ("first", mmlu_prompts, 1)):
        for group in _batches(chosen, batch):
            token_lists = [vocabulary.tokenize(p.text, add_bos=True) for p in group]
            caches = [decoder.prefill(t[:-1], spare=steps + 1) for t in token_lists]
            last = [t[-1] for t in token_lists]
            order = list(policies)
            shuffle.shuffle(order)
            for policy in order:
                generation = decoder.decode([cache.clone() for cache in caches], last, steps, policy)
                row = record[_key(policy)]
                row["first"] += [sequence[0] for sequence in generation.tokens]
                if kind == "decode":
                    row["tokens"] += generation.tokens
                    row["decode_s"] += generation.decode_cpu_s
                    row["wall_s"] += generation.decode_s
                    row["generated"] += steps * len(group)
                    row["depths"] += [depth for depth in generation.depths for _ in group]
                    row["ready"] += [depth for step in generation.ready for depth in step]
            if progress:
                progress(len(group))
    targets = [p.target.answer for p in [*prompts, *mmlu_prompts]]

    def accuracy(first: list[int]) -> float:
        return round(
            sum(mmlu.parse_answer(vocabulary.detokenize([t])) == answer for t, answer in zip(first, targets))
            / len(targets),
            4,
        )

    full = record["full"]
    full_speed = full["generated"] / full["decode_s"] if full["decode_s"] else 0.0
    full_wall = full["generated"] / full["wall_s"] if full["wall_s"] else 0.0
    curve = []
    for policy in configs:
        row = record[_key(policy)]
        speed = row["generated"] / row["decode_s"] if row["decode_s"] else 0.0
        same = [[a == b for a, b in zip(mine, theirs)] for mine, theirs in zip(row["tokens"], full["tokens"])]
        prefixes = [next((i for i, equal in enumerate(s) if not equal), len(s)) for s in same]
        depths = list(policy.exits) + [n_layer]
        curve.append(
            {
                "measure": policy.measure,
                "threshold": policy.threshold,
                "kv_fill": policy.kv_fill,
                "head": policy.head,
                "batch": batch,
                "label": policy.label,
                "tokens_per_s": round(speed, 3),
                "speedup": round(speed / full_speed, 4) if full_speed else None,
                "tokens_per_wall_s": round(row["generated"] / row["wall_s"], 3) if row["wall_s"] else None,
                "speedup_wall": round(row["generated"] / row["wall_s"] / full_wall, 4)
                if row["wall_s"] and full_wall
                else None,
                "exit_rate_by_layer": {str(d): round(row["depths"].count(d) / len(row["depths"]), 4) for d in depths},
                "exit_rate_alone_by_layer": {
                    str(d): round(row["ready"].count(d) / len(row["ready"]), 4) for d in depths
                },
                "mean_layers": round(sum(row["depths"]) / len(row["depths"]), 3),
                "mean_layers_alone": round(sum(row["ready"]) / len(row["ready"]), 3),
                "agreement_token": round(sum(map(sum, same)) / sum(map(len, same)), 4),
                "exact_match_32": round(sum(all(s) for s in same) / len(same), 4),
                "mean_agreeing_prefix": round(sum(prefixes) / len(prefixes), 2),
                "mmlu_accuracy": accuracy(row["first"]),
            }
        )
    return {
        "batch": batch,
        "full_depth": {
            "tokens_per_s": round(full_speed, 3),
            "tokens_per_wall_s": round(full_wall, 3),
            "mmlu_accuracy": accuracy(full["first"]),
            "decode_cpu_s": round(full["decode_s"], 3),
            "decode_wall_s": round(full["wall_s"], 3),
            "tokens": full["generated"],
        },
        "curve": curve,
    }


# -- the command (python manage.py bench lab-exit) --------------------------------------------------
def add_arguments(parser) -> None:
    # lazy: the lab (torch) only here; manage.py bench imports every bench
    from inference.lab.early_exit import DEFAULT_EXITS

    parser.add_argument(
        "--prompts",
        type=int,
        default=12,
        help="5-shot MMLU prompts decoded for --tokens greedy tokens by every configuration (default 12)",
    )
    parser.add_argument(
        "--mmlu-prompts",
        type=int,
        default=36,
        help="further prompts decoded for their first answer token only: MMLU accuracy (default 36)",
    )
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared with full depth (default 32)")
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[4],
        metavar="B",
        help="sequences decoded together (default 4; e.g. 1 4)",
    )
    parser.add_argument(
        "--exits",
        type=int,
        nargs="+",
        default=list(DEFAULT_EXITS),
        metavar="DEPTH",
        help="exit after this many layers (default 12 14 16)",
    )
    parser.add_argument(
        "--top-prob",
        type=float,
        nargs="*",
        default=[0.5, 0.8, 0.95],
        metavar="T",
        help="top-probability thresholds (default 0.5 0.8 0.95)",
    )
    parser.add_argument(
        "--similarity",
        type=float,
        nargs="*",
        default=[0.97, 0.98, 0.99],
        metavar="T",
        help="cosine thresholds (default 0.97 0.98 0.99)",
    )
    parser.add_argument(
        "--lens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also exit through ridge-fitted adapters (fitted on first use; default on)",
    )
    parser.add_argument(
        "--calibration-docs",
        type=int,
        default=24,
        help="calibration documents when the adapters must be fitted (default 24)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: steady timings on a shared machine)"
    )


def run(
    ctx,
    *,
    prompts,
    mmlu_prompts,
    shots,
    tokens,
    batch,
    exits,
    top_prob,
    similarity,
    lens,
    calibration_docs,
    threads,
    **options,
) -> dict:
    from types import SimpleNamespace

    if prompts < 1 or mmlu_prompts < 0 or tokens < 1 or any(b < 1 for b in batch) or threads < 1:
        raise BenchError("--prompts, --tokens, --batch and --threads must be at least 1, --mmlu-prompts at least 0")
    if not top_prob and not similarity:
        raise BenchError("give at least one threshold (--top-prob or --similarity)")
    try:
        # lazy (all three): the lab extra (torch) for this bench alone; manage.py bench imports every bench
        from dashboard.lab.fitting import fit_lens  # lazy: see above
        from inference.lab.early_exit import EarlyExitDecoder, ExitLens, lens_path  # lazy: see above
        from inference.lab.reference import ReferenceModel  # lazy: see above

        exits = tuple(sorted(set(exits)))
        configs = _configs({"top-prob": top_prob, "similarity": similarity}, exits, lens)  # each policy checks itself
        chosen = texts.evaluation_prompts(prompts + mmlu_prompts, shots)
    except (ImportError, ValueError, FileNotFoundError) as exc:
        raise BenchError(str(exc))
    decoded, first_only = chosen[:prompts], chosen[prompts:]
    model = resolve_model(ctx.config.model or None)
    vocabulary = Vocabulary.load(model)
    ctx.write("loading the reference engine (dequantizing the GGUF)...")
    reference = ReferenceModel.load(model.path, threads=threads)
    if any(d >= reference.config.n_layer for d in exits):
        raise BenchError(f"exits must be below the model's {reference.config.n_layer} layers")
    exit_lens = None
    if lens:
        path = lens_path(lab_dir(), model.sha256)
        exit_lens = ExitLens.load(path, fingerprint=model.sha256) if path.exists() else None
        if exit_lens is None or not set(exits) <= set(exit_lens.depths):
            documents = texts.calibration_documents(
                lambda text: vocabulary.tokenize(text, add_bos=True), max_tokens=384
            )[:calibration_docs]
            with ctx.progress(total=len(documents), desc="fitting exit adapters", unit="doc") as bar:
                exit_lens = fit_lens(
                    reference,
                    documents,
                    exits,
                    model.sha256,
                    source="MMLU calibration questions (dashboard.lab.texts)",
                    progress=bar.update,
                )
            exit_lens.save(path)
    decoder = EarlyExitDecoder(reference, exit_lens)
    started = time.perf_counter()
    runs = []
    for size in batch:
        with ctx.progress(
            total=len(chosen), desc=f"bench lab-exit (batch {size}, {len(configs) + 1} configurations)", unit="prompt"
        ) as bar:
            runs.append(
                run_exit_study(
                    decoder, vocabulary, decoded, first_only, configs, batch=size, tokens=tokens, progress=bar.update
                )
            )
    machine = machine_info(
        SimpleNamespace(
            engine=SimpleNamespace(config=EngineConfig(n_threads=threads), model_file=model, n_ctx=0, pacer=None),
            store=None,
        )
    )
    import torch

    machine.update(
        {
            "engine": "lab reference engine (PyTorch float32, CPU)",
            "torch": torch.__version__,
            "kv_type": "float16-rounded float32",
        }
    )
    document = {
        "machine": machine,
        "shots": shots,
        "prompts": len(decoded),
        "mmlu_prompts": len(decoded) + len(first_only),
        "tokens": tokens,
        "timing": "tokens_per_s and speedup from this process's CPU time (one torch thread); tokens_per_wall_s and speedup_wall from the wall clock",
        "exits": list(exits),
        "n_layer": reference.config.n_layer,
        "lens": exit_lens.calibration if exit_lens is not None else None,
        "full_depth": runs[0]["full_depth"],
        "full_depth_by_batch": {str(run["batch"]): run["full_depth"] for run in runs},
        # Training-free exits (the model's own head) in "curve"; through the fitted adapters in "curve_lens".
        "curve": [row for run in runs for row in run["curve"] if row["head"] == "plain"],
        "curve_lens": [row for run in runs for row in run["curve"] if row["head"] == "lens"],
        "differs_from_paper": DIFFERS_FROM_PAPER,
        "paper": {"source": PAPER_SOURCE, "throughput": PAPER_THROUGHPUT, "table1": PAPER_TABLE1},
        "seconds": round(time.perf_counter() - started, 1),
    }
    document["summary"] = summary(document)
    return document


def _all_rows(doc: dict) -> list[dict]:
    return [*doc["curve"], *doc.get("curve_lens", [])]


def summary(doc: dict) -> str:
    best = max((row for row in _all_rows(doc) if row["kv_fill"]), key=lambda row: row["speedup"] or 0, default=None)
    text = (
        f"{doc['prompts']} five-shot MMLU prompts x {doc['tokens']} greedy tokens (accuracy on {doc['mmlu_prompts']}), "
        f"batches of {', '.join(doc['full_depth_by_batch'])}; full depth {doc['full_depth']['tokens_per_s']} tokens per CPU second, "
        f"MMLU {doc['full_depth']['mmlu_accuracy']}."
    )
    if best is not None:
        text += f" Fastest with KV fill: {best['label']} at x{best['speedup']} (token agreement {best['agreement_token']}, MMLU {best['mmlu_accuracy']})."
    faithful = max(
        (
            row
            for row in _all_rows(doc)
            if row["agreement_token"] >= 0.9 and row["exit_rate_by_layer"][str(doc["n_layer"])] < 1.0
        ),
        key=lambda row: row["speedup"] or 0,
        default=None,
    )
    if faithful is not None:
        text += f" Fastest that exits and keeps token agreement >= 0.9: {faithful['label']} at x{faithful['speedup']} (agreement {faithful['agreement_token']})."
    else:
        text += " No configuration that exits keeps token agreement >= 0.9."
    return text


def lines(doc: dict) -> list[str]:
    out = []
    for size, full in doc["full_depth_by_batch"].items():
        out.append(f"\nbatch {size}: full depth {full['tokens_per_s']} tokens/s, MMLU {full['mmlu_accuracy']}")
    exits = [str(d) for d in doc["exits"]] + [str(doc["n_layer"])]
    out.append(f"({doc['seconds']} s)")
    out.append(
        f"{'B':>2} {'configuration':<46}{'tok/s':>7}{'x':>7}{'agree':>7}{'exact':>7}{'MMLU':>7}  exit rate "
        + "/".join(exits)
    )
    for row in _all_rows(doc):
        rates = "/".join(f"{row['exit_rate_by_layer'][d]:.2f}" for d in exits)
        out.append(
            f"{row['batch']:>2} {row['label']:<46}{row['tokens_per_s']:>7.2f}{row['speedup']:>7.3f}{row['agreement_token']:>7.3f}"
            f"{row['exact_match_32']:>7.3f}{row['mmlu_accuracy']:>7.3f}  {rates}"
        )
    return out


# -- report -------------------------------------------------------------------------------------------
def exit_report(path, doc: dict):
    import plotly.graph_objects as go

    def series(rows):
        groups: dict[tuple, list] = {}
        for row in rows:
            groups.setdefault((row["batch"], row["measure"], row["head"], row["kv_fill"]), []).append(row)
        for (batch, measure, head, fill), members in sorted(groups.items(), key=lambda item: str(item[0])):
            name = f"{measure}, {head} head, {'KV fill' if fill else 'no KV fill'}" + (
                f", B={batch}" if len(doc["full_depth_by_batch"]) > 1 else ""
            )
            yield name, sorted(members, key=lambda row: row["threshold"]), ("circle" if fill else "x")

    figures = []
    for metric, title, full_value in (
        ("agreement_token", f"token agreement with full depth ({doc['tokens']} greedy tokens)", 1.0),
        ("exact_match_32", f"exact match of all {doc['tokens']} tokens with full depth", 1.0),
        ("mmlu_accuracy", "MMLU accuracy (first answer token)", doc["full_depth"]["mmlu_accuracy"]),
    ):
        figure = go.Figure()
        for name, rows, symbol in series(_all_rows(doc)):
            figure.add_trace(
                go.Scatter(
                    x=[row["speedup"] for row in rows],
                    y=[row[metric] for row in rows],
                    mode="lines+markers+text",
                    name=name,
                    marker={"symbol": symbol, "size": 9},
                    text=[f"{row['threshold']:g}" for row in rows],
                    textposition="top center",
                )
            )
        figure.add_trace(
            go.Scatter(
                x=[1.0],
                y=[full_value],
                mode="markers",
                name="full depth (reference engine)",
                marker={"size": 13, "symbol": "star"},
            )
        )
        figure.update_layout(
            title=f"Speed-quality curve, early exit (lab, approximate): {title}",
            xaxis_title="decode tokens/s relative to full depth (x)",
            yaxis_title=metric.replace("_", " "),
        )
        figures.append(figure)
    rates = go.Figure()
    exits = [str(d) for d in doc["exits"]] + [str(doc["n_layer"])]
    labels = [f"{row['label']} B={row['batch']}" for row in _all_rows(doc)]
    for depth in exits:
        rates.add_trace(
            go.Bar(
                x=labels,
                y=[row["exit_rate_by_layer"][depth] for row in _all_rows(doc)],
                name=f"after {depth} layers" + (" (no exit)" if depth == exits[-1] else ""),
            )
        )
    rates.update_layout(
        barmode="stack",
        title="Where tokens left the network (early exit, lab): share per exit depth",
        yaxis_title="share of decoded tokens",
    )
    figures.append(rates)
    table = [
        {
            "label": row["label"],
            "B": row["batch"],
            "tokens/s": row["tokens_per_s"],
            "speedup": row["speedup"],
            "speedup (wall clock)": row.get("speedup_wall"),
            "mean layers": row["mean_layers"],
            "mean layers alone": row["mean_layers_alone"],
            "agreement": row["agreement_token"],
            "exact match": row["exact_match_32"],
            "MMLU": row["mmlu_accuracy"],
            **{f"exit@{d}": row["exit_rate_by_layer"][d] for d in exits},
        }
        for row in _all_rows(doc)
    ]
    tables = {
        "Full depth (the same engine, no exits)": [
            {"batch": b, **full} for b, full in doc["full_depth_by_batch"].items()
        ],
        "Every configuration (approximate; labelled as a board run would be)": table,
        "Differs from the paper": [{"difference": text} for text in doc["differs_from_paper"]],
        f"Paper (quoted as data): {PAPER_SOURCE}, throughput": PAPER_THROUGHPUT,
        "Paper (quoted as data): table 1": PAPER_TABLE1,
    }
    return write_report(
        path, "bench lab-exit: early exit with KV fill (seed 002)", doc.get("summary", ""), figures, tables, doc
    )


def headline(doc: dict) -> str:
    speedups = [
        point.get("speedup")
        for point in doc.get("curve") or []
        if isinstance(point, dict) and isinstance(point.get("speedup"), (int, float))
    ]
    return f"early exit with KV fill (lab): {len(doc.get('curve') or [])} settings, speed-up up to {max(speedups, default=0):.2f}x (see the Lab page)"


BENCH = Benchmark(
    name="lab-exit",
    format=1,
    help="early exit with KV fill (seed 002) on the reference engine: speed-quality curve across thresholds",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=exit_report,
    headline=headline,
)

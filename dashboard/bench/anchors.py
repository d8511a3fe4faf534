"""bench lab-anchors: anchor tokens (seed 004) against the plain path, on the same 5-shot MMLU prompts.

Four variants: the base model with its full KV (the plain path), the base model pruned to
anchors (training-free), the anchor-tuned model (``dashboard.lab.anchor_tune``) with its full
KV, and the tuned model pruned. For each prompt and variant: KV bytes the prompt keeps, bytes
of the stored prefix entry (everything before the question: the instruction and the
demonstrations; pruned, only BOS and their anchors), TTFT (prefill to first token on this
machine), decode speed after it, the greedy answer (MMLU accuracy; agreement with the base
model's full-KV first token). On the first ``link_prompts`` prompts, TTFT when the prefix entry
comes from the cache box over the emulated Wi-Fi 4 link (the real store, the socket shaped):
fetch, restore, prefill the question; ``cached_ttft_ms`` is that time less the fetch (the entry
already on the board).

Entries are written for that measurement only, under ``LAB_KEY_SPACE`` (``ec:lab:anchors:...``),
a key space no exact lookup reads (entries are ``ec:e:...``/``ec:m:...``), with a short TTL,
and deleted after each measurement. One baseline beside them: the base model with the
demonstrations left out (instruction and question only), about the pruned variant's KV size:
what anchors carry beyond having no demonstrations at all.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Sequence

import numpy as np

from cachebox.keys import KEY_PREFIX
from cachebox.link import LINK_PRESETS
from cachebox.store import CacheBox
from dashboard import mmlu
from dashboard.bench.base import BenchError, Benchmark
from dashboard.bench.common import machine_info, median
from dashboard.bench.html_report import write_report
from dashboard.lab import texts
from inference.engine.llama import Engine, EngineConfig
from inference.engine.model_file import ModelFile, _cached_sha256, resolve_model
from inference.lab.anchors import anchor_prefill, prefix_entry, prompt_sequences, tuned_path
from inference.lab.kv_prediction import lab_dir

LAB_KEY_SPACE = f"{KEY_PREFIX}:lab:anchors"
VARIANTS = ("base-full", "base-pruned", "tuned-full", "tuned-pruned")
LABELS = {
    "base-full": "base model, full KV (plain path)",
    "base-pruned": "base model, anchors only (training-free, approximate)",
    "tuned-full": "anchor-tuned model, full KV",
    "tuned-pruned": "anchor-tuned model, anchors only (approximate)",
    "base-no-demos": "base model, demonstrations left out (instruction + question)",
}
DIFFERS_FROM_PAPER = [
    "Model: Gemma-3 270M (Q4_K_M GGUF, llama.cpp on a 2-core CPU), not Llama2-7B on GPUs; its sliding-window layers (window 512) see anchors only within the window, as they would see any token.",
    "Training: LoRA (rank 16, q/k/v/output projections) on one CPU core for about an hour, about 130 thousand tokens of the Python language reference shipped with CPython, by self-distillation (KL to the base model with full attention; the student under the anchor mask, and with full attention in part of the steps so that it stays the base model where nothing is pruned; see fine_tune); the paper continues pre-training the whole of Llama2-7B on about 1 billion RedPajama tokens with the language-model loss.",
    "Anchors: the last token of each existing sequence (the instruction and each demonstration end in a blank line; sentences in the tuning text), as the paper's AnLLM-EP uses an existing endpoint; no new <AC> token is added (AnLLM-AC), because that needs a new embedding and a tokenizer change the served GGUF would not share.",
    "Mask: anchors also see earlier anchors (the paper's anchors see only their own sequence), because llama.cpp prefills a sequence's anchor in the same batch as its other tokens; training used the same mask.",
    "Pruning happens at sequence ends of the prompt only; generated tokens are never pruned (MMLU answers are one token) and the current sequence (the question) is kept whole.",
    "Evaluation: 5-shot MMLU by the greedy first token (paper: OBQA, WinoGrande, ARC, PIQA, HellaSwag, SciQ, BoolQ by option likelihood); speed is TTFT on one llama.cpp thread and over an emulated Wi-Fi 4 link, where the paper reports an inference acceleration ratio against recomputing the prefix.",
    "The tuned model's adapted projections may be stored at Q8_0 (the base file has Q5_0/Q4_K there) when that keeps more of the tune: see fine_tune.exports.",
]
# The paper's table 1(b), five-shot averages over its eight tasks, quoted as data.
PAPER_SOURCE = "Anchor-based Large Language Models (seed 004), table 1(b): five-shot averages"
PAPER_TABLE = [
    {"model": "Llama2-7B", "accuracy": 69.1, "kv_reduction": None},
    {"model": "Llama2-7B + AnSAN (training-free pruning)", "accuracy": 52.1, "kv_reduction": None},
    {"model": "AnLLM-EP (endpoint anchors)", "accuracy": 67.8, "kv_reduction": None},
    {"model": "AnLLM-EP + AnSAN", "accuracy": 65.6, "kv_reduction": 0.90},
    {"model": "AnLLM-AC (<AC> anchors)", "accuracy": 68.5, "kv_reduction": None},
    {"model": "AnLLM-AC + AnSAN", "accuracy": 67.5, "kv_reduction": 0.99},
]


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def measure(engine: Engine, sequences: Sequence[Sequence[int]], pruned: bool, decode_tokens: int) -> dict:
    """One prompt on one variant: TTFT, first token, kept cells, KV bytes, the prefix entry's
    blobs, decode speed. Leaves the engine empty."""
    n = sum(len(tokens) for tokens in sequences)
    prefix_end = n - len(sequences[-1])
    engine.clear()
    started = time.perf_counter()
    if pruned:
        done = anchor_prefill(engine, sequences)
        logits, kept = done.logits, done.kept
    else:
        logits = engine.prefill([token for tokens in sequences for token in tokens], 0, logits_at={n - 1})[n - 1]
        kept = n
    token = int(np.argmax(logits))
    ttft_ms = _ms(started)
    entry = prefix_entry(engine, prefix_end) if prefix_end else []
    mark = time.perf_counter()
    next_token, position = token, n
    for _ in range(decode_tokens):
        next_token = int(np.argmax(engine.decode_one(next_token, position)))
        position += 1
    decode_s = time.perf_counter() - mark
    engine.clear()
    return {
        "ttft_ms": ttft_ms,
        "token": token,
        "kept": kept,
        "kv_bytes": int(round(kept * engine.state_bytes_per_token)),
        "entry": entry,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
    }


def lab_entry_names(count: int) -> list[str]:
    """Fresh names in the lab's own key space (never an exact entry's)."""
    run = uuid.uuid4().hex[:12]
    return [f"{LAB_KEY_SPACE}:{run}:{index}" for index in range(count)]


def linked_ttft(
    engine: Engine, store, shaped_store, entry: Sequence[bytes], question: Sequence[int], start: int
) -> tuple[float, float, int]:
    """TTFT with the prefix entry fetched over ``shaped_store``'s link: (ttft ms, fetch ms, first token).
    The entry is written beforehand through the unshaped ``store`` and deleted afterwards."""
    names = lab_entry_names(len(entry))
    store.put_entries(list(zip(names, entry)), ttl=300)
    engine.clear()
    try:
        started = time.perf_counter()
        blobs = shaped_store.read_entries(names)
        fetch_ms = _ms(started)
        if any(blob is None for blob in blobs):
            raise RuntimeError("the cache box lost a lab entry between writing and reading it")
        for blob in blobs:
            engine.import_range(blob)
        n = start + len(question)
        logits = engine.prefill(list(question), start, logits_at={n - 1})[n - 1]
        token = int(np.argmax(logits))
        return _ms(started), fetch_ms, token
    finally:
        engine.clear()
        store.delete(names)


def run_anchors(
    engines: dict[str, Engine],
    prompts: Sequence[mmlu.MMLUPrompt],
    *,
    decode_tokens: int = 8,
    store=None,
    shaped_store=None,
    link_prompts: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """``engines``: {"base": engine, "tuned": engine (optional)}. Returns the document's rows and per-prompt figures."""
    records: dict[str, dict[str, list]] = {}
    variants = [v for v in VARIANTS if v.split("-")[0] in engines] + ["base-no-demos"]
    for variant in variants:
        records[variant] = {
            key: []
            for key in (
                "ttft_ms",
                "token",
                "correct",
                "kv_bytes",
                "entry_bytes",
                "decode_tokens_per_s",
                "kept",
                "wifi4_ttft_ms",
                "wifi4_fetch_ms",
                "wifi4_token",
                "letter",
            )
        }
    base = engines["base"]
    prompt_tokens = []
    for index, prompt in enumerate(prompts):
        for model, engine in engines.items():
            sequences = prompt_sequences(engine, prompt.segments)
            prefix_end = sum(len(tokens) for tokens in sequences[:-1])
            for pruned in (False, True):
                variant = f"{model}-{'pruned' if pruned else 'full'}"
                result = measure(engine, sequences, pruned, decode_tokens)
                row = records[variant]
                for key in ("ttft_ms", "token", "kv_bytes", "decode_tokens_per_s", "kept"):
                    row[key].append(result[key])
                row["entry_bytes"].append(sum(len(blob) for blob in result["entry"]))
                letter = mmlu.parse_answer(engine.detokenize([result["token"]]))
                row["correct"].append(letter == prompt.target.answer)
                row["letter"].append(letter is not None)
                if index < link_prompts and store is not None and shaped_store is not None and result["entry"]:
                    ttft, fetch, token = linked_ttft(
                        engine, store, shaped_store, result["entry"], sequences[-1], prefix_end
                    )
                    row["wifi4_ttft_ms"].append(ttft)
                    row["wifi4_fetch_ms"].append(fetch)
                    row["wifi4_token"].append(token == result["token"])
            if model == "base":
                prompt_tokens.append(sum(len(tokens) for tokens in sequences))
                no_demos = [sequences[0], sequences[-1]]
                result = measure(engine, no_demos, False, 0)
                row = records["base-no-demos"]
                for key in ("ttft_ms", "token", "kv_bytes", "kept"):
                    row[key].append(result[key])
                row["entry_bytes"].append(sum(len(blob) for blob in result["entry"]))
                letter = mmlu.parse_answer(base.detokenize([result["token"]]))
                row["correct"].append(letter == prompt.target.answer)
                row["letter"].append(letter is not None)
        if progress:
            progress(1)
    reference = records["base-full"]
    full_kv = median(reference["kv_bytes"])
    rows = []
    for variant in variants:
        row = records[variant]
        agree = np.array(row["token"]) == np.array(reference["token"])
        both = sum(a and b for a, b in zip(row["correct"], reference["correct"]))
        only_base = sum(b and not a for a, b in zip(row["correct"], reference["correct"]))
        only_this = sum(a and not b for a, b in zip(row["correct"], reference["correct"]))
        out = {
            "variant": variant,
            "label": LABELS[variant],
            "approximate": variant != "base-full",
            "prompts": len(row["token"]),
            "kv_bytes": int(median(row["kv_bytes"])),
            "entry_bytes": int(median(row["entry_bytes"])),
            "kv_reduction": round(1.0 - median(row["kv_bytes"]) / full_kv, 4) if full_kv else 0.0,
            "kept_cells": median(row["kept"]),
            "ttft_ms": median(row["ttft_ms"]),
            "decode_tokens_per_s": round(median(row["decode_tokens_per_s"]), 2) if row["decode_tokens_per_s"] else None,
            "mmlu_accuracy": round(float(np.mean(row["correct"])), 4),
            "agreement": round(float(np.mean(agree)), 4),
            # A pruned variant against the same model with its full KV: what pruning alone changes.
            "agreement_with_own_full": round(
                float(np.mean(np.array(row["token"]) == np.array(records[variant.split("-")[0] + "-full"]["token"]))), 4
            )
            if variant in VARIANTS
            else None,
            "letter_rate": round(float(np.mean(row["letter"])), 4),  # first tokens that are an answer letter (A-D)
            "paired_with_base_full": {"both_correct": both, "only_base_full": only_base, "only_this": only_this},
            "wifi4_ttft_ms": median(row["wifi4_ttft_ms"]) if row["wifi4_ttft_ms"] else None,
            "wifi4_fetch_ms": median(row["wifi4_fetch_ms"]) if row["wifi4_fetch_ms"] else None,
            # The same runs without the link: the entry already on the board (restore + the question's prefill).
            "cached_ttft_ms": median(t - f for t, f in zip(row["wifi4_ttft_ms"], row["wifi4_fetch_ms"]))
            if row["wifi4_ttft_ms"]
            else None,
            "wifi4_prompts": len(row["wifi4_ttft_ms"]),
            "wifi4_same_first_token": round(float(np.mean(row["wifi4_token"])), 4) if row["wifi4_token"] else None,
        }
        rows.append(out)
    main = [row for row in rows if row["variant"] in VARIANTS]
    baselines = [row for row in rows if row["variant"] not in VARIANTS]
    return {
        "prompts": len(prompts),
        "median_prompt_tokens": median(prompt_tokens),
        "rows": main,
        "baselines": baselines,
    }


# -- command --------------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=100, help="5-shot MMLU prompts over all topics (default 100)")
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=8,
        help="greedy tokens decoded after the first, for the decode speed (default 8)",
    )
    parser.add_argument(
        "--link-prompts",
        type=int,
        default=10,
        help="prompts whose prefix entry is also fetched over the emulated link (default 10; 0: none, no cache box needed)",
    )
    parser.add_argument("--link", default="wifi4", help="link preset for those fetches (default wifi4, the paper's)")
    parser.add_argument(
        "--threads", type=int, default=1, help="llama.cpp threads (default 1: steady timings on a shared machine)"
    )


def run(ctx, *, prompts, shots, decode_tokens, link_prompts, link, threads, **options) -> dict:
    from types import SimpleNamespace

    # lazy: the lab's tuning (torch) only here; manage.py bench imports every bench
    from dashboard.lab.anchor_tune import record_path

    if prompts < 1 or threads < 1 or decode_tokens < 0 or link_prompts < 0:
        raise BenchError("--prompts and --threads must be at least 1, --decode-tokens and --link-prompts at least 0")
    if LINK_PRESETS.get(link) is None:
        raise BenchError(
            f"--link must be one of {', '.join(name for name, profile in LINK_PRESETS.items() if profile)}"
        )
    try:
        chosen = texts.evaluation_prompts(prompts, shots)
    except (ValueError, FileNotFoundError) as exc:
        raise BenchError(str(exc))
    store = shaped = None
    if link_prompts:
        url = ctx.cachebox_url(hint="or pass --link-prompts 0")
        store = CacheBox(url, timeout=60)
        shaped = CacheBox(url, link=LINK_PRESETS[link], timeout=60)
    config = EngineConfig(n_ctx=2048, n_threads=threads, n_seq_max=2)
    engines = {"base": Engine(resolve_model(), config)}
    fine_tune: dict
    path = tuned_path(lab_dir(), engines["base"].model_file.sha256)
    if path.exists():
        engines["tuned"] = Engine(ModelFile(path, _cached_sha256(path)), config)
        record = record_path(path)
        fine_tune = json.loads(record.read_text()) if record.exists() else {"path": str(path), "record": "missing"}
    else:
        fine_tune = {
            "status": f"no anchor-tuned model at {path}: run `python -m dashboard.lab.anchor_tune` (lab extra); tuned rows left out"
        }
        ctx.write(fine_tune["status"])
    try:
        with ctx.progress(
            total=len(chosen), desc=f"bench lab-anchors ({', '.join(engines)}; {threads} thread(s))", unit="prompt"
        ) as bar:
            document = run_anchors(
                engines,
                chosen,
                decode_tokens=decode_tokens,
                store=store,
                shaped_store=shaped,
                link_prompts=link_prompts,
                progress=bar.update,
            )
        machine = machine_info(SimpleNamespace(engine=engines["base"], store=shaped))
    finally:
        for engine in engines.values():
            engine.close()
    document = {
        "machine": machine,
        "shots": shots,
        "link": link,
        "link_label": LINK_PRESETS[link].label,
        **document,
        "fine_tune": fine_tune,
        "differs_from_paper": DIFFERS_FROM_PAPER,
    }
    return document


def lines(document: dict) -> list[str]:
    out = [
        f"\n{document['prompts']} five-shot MMLU prompts (median {document['median_prompt_tokens']:.0f} tokens), {document['machine']['threads']} llama.cpp thread(s)"
    ]
    out.append(
        f"{'variant':<15}{'KV bytes':>11}{'entry':>11}{'KV cut':>8}{'TTFT ms':>9}{'tok/s':>7}{'MMLU':>7}{'agree':>7}{'own':>6}{'A-D':>6}{'cached TTFT':>13}{'Wi-Fi 4 TTFT':>14}"
    )
    for row in document["rows"] + document["baselines"]:
        wifi = f"{row['wifi4_ttft_ms']:.0f}" if row["wifi4_ttft_ms"] is not None else "-"
        cached = f"{row['cached_ttft_ms']:.0f}" if row["cached_ttft_ms"] is not None else "-"
        own = f"{row['agreement_with_own_full']:.2f}" if row["agreement_with_own_full"] is not None else "-"
        speed = f"{row['decode_tokens_per_s']:.1f}" if row["decode_tokens_per_s"] else "-"
        out.append(
            f"{row['variant']:<15}{row['kv_bytes']:>11,}{row['entry_bytes']:>11,}{row['kv_reduction']:>8.1%}{row['ttft_ms']:>9.0f}{speed:>7}{row['mmlu_accuracy']:>7.3f}{row['agreement']:>7.3f}{own:>6}{row['letter_rate']:>6.2f}{cached:>13}{wifi:>14}"
        )
    return out


def anchors_report(path, doc: dict):
    import plotly.graph_objects as go

    rows = doc["rows"] + doc.get("baselines", [])
    names = [row["variant"] for row in rows]
    quality = go.Figure(
        [
            go.Bar(name="MMLU accuracy", x=names, y=[row["mmlu_accuracy"] for row in rows]),
            go.Bar(name="first-token agreement with base-full", x=names, y=[row["agreement"] for row in rows]),
        ]
    )
    quality.update_layout(
        title="Anchors (seed 004): answer quality per variant (all but base-full are approximate)",
        barmode="group",
        yaxis_title="fraction of prompts",
    )
    sizes = go.Figure(
        [
            go.Bar(name="KV bytes per prompt", x=names, y=[row["kv_bytes"] for row in rows]),
            go.Bar(name="prefix entry bytes (on the link)", x=names, y=[row["entry_bytes"] for row in rows]),
        ]
    )
    sizes.update_layout(
        title="Anchors (seed 004): KV kept and entry size (log scale)",
        barmode="group",
        yaxis_type="log",
        yaxis_title="bytes",
    )
    linked = [row for row in rows if row.get("wifi4_ttft_ms") is not None]
    speed = go.Figure(
        [
            go.Bar(name="TTFT, prefill on the board", x=names, y=[row["ttft_ms"] for row in rows]),
            go.Bar(
                name="TTFT, prefix entry already on the board (restore + question)",
                x=[row["variant"] for row in linked],
                y=[row["cached_ttft_ms"] for row in linked],
            ),
            go.Bar(
                name=f"TTFT, prefix entry over {doc.get('link_label', 'the emulated link')} (emulated)",
                x=[row["variant"] for row in linked],
                y=[row["wifi4_ttft_ms"] for row in linked],
            ),
        ]
    )
    speed.update_layout(
        title="Anchors (seed 004): time to first token, computed here or fetched over the emulated link",
        barmode="group",
        yaxis_title="ms",
    )
    summary = (
        f"{doc['prompts']} five-shot MMLU prompts, median {doc.get('median_prompt_tokens', 0):.0f} tokens; {doc['machine'].get('threads')} llama.cpp thread(s). "
        "Pruned variants keep only BOS, each demonstration's anchor and the question; their states never enter the exact cache. "
        "Differs from the paper: " + " ".join(doc.get("differs_from_paper", []))
    )
    table = [
        {k: v for k, v in row.items() if k != "paired_with_base_full"} | row["paired_with_base_full"] for row in rows
    ]
    fine_tune = {k: v for k, v in doc.get("fine_tune", {}).items() if k not in ("exports",)}
    tables = {
        "Variants": table,
        "Fine-tune": [fine_tune] if fine_tune else [],
        f"Paper (quoted as data): {PAPER_SOURCE}": PAPER_TABLE,
    }
    return write_report(
        path, "bench lab-anchors: anchor tokens (seed 004)", summary, [quality, sizes, speed], tables, doc
    )


def headline(doc: dict) -> str:
    variants = [row.get("variant") for row in doc.get("rows") or [] if isinstance(row, dict)]
    return f"anchor tokens (lab): {', '.join(map(str, variants))} (see the Lab page)"


BENCH = Benchmark(
    name="lab-anchors",
    format=1,
    help="anchor tokens (seed 004): KV and entry bytes, speed, MMLU accuracy, base and anchor-tuned, full and pruned",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=anchors_report,
    headline=headline,
)

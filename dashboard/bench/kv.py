"""`bench kv`: smaller states, measured. Two questions, one run.

1. **Codecs** (lossless): bytes per cached token of every KV type under each codec of
   ``cachebox.codec``, compression and decompression time, and whether decoding pays on the
   emulated Wi-Fi 4 link: (restore + decode time) / (transfer time saved).
2. **Quantized KV** (lossy: another model configuration, with its own fingerprint): q8_0 and
   q4_0 against f16 on the same MMLU prompts, paired: greedy agreement of the first token and
   of the parsed answer, accuracy of each, and the next-token KL divergence from f16 on
   held-out text (MMLU questions of topics the prompts do not use).

Each KV type gets its own engine on the same model file; every prefill cuts on the grid.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import numpy as np

from cachebox import codec
from cachebox.keys import grid_cuts
from cachebox.link import LINK_PRESETS
from dashboard import mmlu
from dashboard.bench.base import BenchError, Benchmark, prompts_of, topics_named
from dashboard.bench.common import machine_info, median, percentile
from dashboard.bench.reports import kv_report
from dashboard.mmlu import MMLUPrompt, parse_answer
from inference.engine.llama import MAIN_SEQ, Engine, EngineConfig

KV_TYPES = ("f16", "q8_0", "q4_0")
GRID = 128


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    values = logits.astype(np.float64)
    values -= values.max()
    return values - np.log(np.exp(values).sum())


def kl_divergence(reference: np.ndarray, other: np.ndarray) -> float:
    """KL(reference || other) of the next-token distributions given by two logit vectors, in nats."""
    p_log, q_log = _log_softmax(reference), _log_softmax(other)
    return float(np.sum(np.exp(p_log) * (p_log - q_log)))


def _greedy(engine: Engine, tokens: list[int], max_tokens: int) -> tuple[list[int], str]:
    last = len(tokens) - 1
    with engine.lock:
        engine.clear()
        logits = engine.prefill(tokens, 0, logits_at={last}, cuts=grid_cuts(len(tokens), GRID))[last]
        out = [int(np.argmax(logits))]
        for step in range(1, max_tokens):
            out.append(int(np.argmax(engine.decode_one(out[-1], last + step))))
    return out, engine.detokenize(out)


def _codec_figures(engine: Engine, tokens: list[int]) -> dict:
    """State of the whole prompt under each codec: sizes and times (ms)."""
    with engine.lock:
        engine.clear()
        engine.prefill(tokens, 0, cuts=grid_cuts(len(tokens), GRID))
        state = engine.export_range(0, len(tokens))
        engine.clear()
        mark = time.perf_counter()
        engine.import_range(state)
        restore_ms = (time.perf_counter() - mark) * 1000
        engine.remove(MAIN_SEQ)
    figures = {"tokens": len(tokens), "raw_bytes": len(state), "restore_ms": restore_ms}
    for name in codec.CODECS:
        mark = time.perf_counter()
        stored = codec.encode(state, name)
        encode_ms = (time.perf_counter() - mark) * 1000
        mark = time.perf_counter()
        back = codec.decode(stored, name, len(state))
        decode_ms = (time.perf_counter() - mark) * 1000
        assert back == state
        figures[name] = {"bytes": len(stored), "encode_ms": encode_ms, "decode_ms": decode_ms}
    return figures


def run_kv(
    model_file,
    prompts: Sequence[MMLUPrompt],
    held_out: Sequence[str],
    *,
    kv_types: Sequence[str] = KV_TYPES,
    threads: int = 0,
    max_tokens: int = 2,
    kl_positions: int = 64,
    progress: Callable[[], None] | None = None,
) -> dict:
    engines = {kv: Engine(model_file, EngineConfig(n_ctx=2048, n_threads=threads, kv_type=kv)) for kv in kv_types}
    reference = kv_types[0]
    try:
        first_tokens: dict[str, list[int]] = {kv: [] for kv in kv_types}
        answers: dict[str, list[str | None]] = {kv: [] for kv in kv_types}
        codecs: dict[str, list[dict]] = {kv: [] for kv in kv_types}
        for index, prompt in enumerate(prompts):
            for kv, engine in engines.items():
                tokens = engine.tokenize(prompt.text, add_bos=True)
                generated, text = _greedy(engine, tokens, max_tokens)
                first_tokens[kv].append(generated[0])
                answers[kv].append(parse_answer(text))
                if index < 20:  # sizes and speeds settle within a few prompts
                    codecs[kv].append(_codec_figures(engine, tokens))
            if progress:
                progress()
        kl: dict[str, list[float]] = {kv: [] for kv in kv_types[1:]}
        for text in held_out:
            tokens = engines[reference].tokenize(text, add_bos=True)[: kl_positions + 1]
            wanted = set(range(1, len(tokens)))
            logits = {}
            for kv, engine in engines.items():
                with engine.lock:
                    engine.clear()
                    logits[kv] = engine.prefill(tokens, 0, logits_at=wanted, cuts=grid_cuts(len(tokens), GRID))
                    engine.remove(MAIN_SEQ)
            for kv in kv_types[1:]:
                kl[kv] += [
                    kl_divergence(logits[reference][position], logits[kv][position]) for position in sorted(wanted)
                ]
    finally:
        for engine in engines.values():
            engine.close()

    truth = [prompt.target.answer for prompt in prompts]
    wifi = LINK_PRESETS["wifi4"]
    rows = {}
    for kv in kv_types:
        samples = codecs[kv]
        tokens = sum(sample["tokens"] for sample in samples)
        per_codec = {}
        for name in codec.CODECS:
            stored = sum(sample[name]["bytes"] for sample in samples)
            raw = sum(sample["raw_bytes"] for sample in samples)
            decode_ms = sum(sample[name]["decode_ms"] for sample in samples)
            restore_ms = sum(sample["restore_ms"] for sample in samples)
            saved_ms = wifi.transfer_ms(raw - stored, round_trips=0)
            per_codec[name] = {
                "bytes_per_token": round(stored / tokens, 1),
                "ratio": round(raw / stored, 4),
                "encode_ms_per_mb": round(sum(sample[name]["encode_ms"] for sample in samples) / (raw / 1e6), 3),
                "decode_ms_per_mb": round(decode_ms / (raw / 1e6), 3),
                "wifi4_transfer_saved_ms_per_mb": round(saved_ms / (raw / 1e6), 2),
                # Below 1: decoding (and restoring) costs less than the transfer time it saves on Wi-Fi 4.
                "wifi4_decode_to_saving": round((decode_ms + restore_ms) / saved_ms, 4) if saved_ms > 0 else None,
            }
        paired = len(truth)
        row = {
            "bytes_per_token": per_codec[codec.RAW]["bytes_per_token"],
            "codecs": per_codec,
            "accuracy": round(sum(a == t for a, t in zip(answers[kv], truth)) / paired, 4),
            "first_token_agreement": round(
                sum(a == b for a, b in zip(first_tokens[kv], first_tokens[reference])) / paired, 4
            ),
            "answer_agreement": round(sum(a == b for a, b in zip(answers[kv], answers[reference])) / paired, 4),
        }
        if kv in kl:
            row["kl_mean"] = round(statistics.fmean(kl[kv]), 6) if kl[kv] else None
            row["kl_median"] = median(kl[kv])
            row["kl_p99"] = percentile(kl[kv], 99, digits=6)
        rows[kv] = row
    return {
        "reference": reference,
        "kv_types": rows,
        "n": len(prompts),
        "kl_texts": len(held_out),
        "kl_positions": sum(len(values) for values in kl.values()) // max(1, len(kl)),
        "max_tokens": max_tokens,
        "link_for_saving": wifi.label,
    }


# -- the command (python manage.py bench kv) -----------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--topics", nargs="+", default=["astronomy", "high_school_biology", "world_religions"], metavar="TOPIC"
    )
    parser.add_argument(
        "--prompts", type=int, default=100, help="questions per topic (default 100: 300 paired prompts)"
    )
    parser.add_argument("--shots", type=int, default=3)
    parser.add_argument(
        "--held-out",
        nargs="+",
        default=["philosophy", "prehistory"],
        metavar="TOPIC",
        help="topics whose questions are the KL text",
    )
    parser.add_argument("--texts", type=int, default=16, help="held-out texts per topic for the KL (64 positions each)")
    parser.add_argument("--threads", type=int, default=0)


def run(ctx, *, topics, prompts, shots, held_out, texts, threads, **options) -> dict:
    chosen, spare = topics_named(topics), topics_named(held_out)
    if set(chosen) & set(spare):
        raise BenchError("the held-out topics must differ from the evaluated ones")
    selected = [prompt for topic in chosen for prompt in prompts_of(topic, shots, prompts)]
    questions = mmlu.load_questions()
    held_out_texts = [question.render(with_answer=True) for topic in spare for question in questions[topic][:texts]]
    with ctx.board(threads=threads or None) as board:
        machine, model_file = machine_info(board), board.engine.model_file
    with ctx.progress(
        total=len(selected), desc=f"bench kv ({len(selected)} prompts x f16, q8_0, q4_0)", unit="prompt"
    ) as bar:
        document = run_kv(model_file, selected, held_out_texts, threads=threads, progress=bar.update)
    document.update({"topics": chosen, "held_out_topics": spare, "shots": shots, "machine": machine})
    return document


def lines(doc: dict) -> list[str]:
    out = [
        f"\n{doc['n']} paired prompts ({doc['shots']}-shot), KL over {doc['kl_positions']} held-out positions",
        f"{'KV':<6}{'B/token':>9}{'zstd-shuffle':>14}{'decode/saving':>15}{'accuracy':>10}{'1st-token agr':>15}{'answer agr':>12}{'KL mean':>10}",
    ]
    for kv, row in doc["kv_types"].items():
        shuffled = row["codecs"]["zstd-shuffle"]
        out.append(
            f"{kv:<6}{row['bytes_per_token']:>9.0f}{shuffled['ratio']:>13.3f}x{shuffled['wifi4_decode_to_saving'] or 0:>15.3f}"
            f"{row['accuracy']:>10.3f}{row['first_token_agreement']:>15.3f}{row['answer_agreement']:>12.3f}{row.get('kl_mean') or 0:>10.4f}"
        )
    return out


def headline(doc: dict) -> str:
    return "; ".join(
        f"{kv} {row['bytes_per_token']:.0f} B/token, accuracy {row['accuracy']}" for kv, row in doc["kv_types"].items()
    )


BENCH = Benchmark(
    name="kv",
    format=1,
    help="state codecs (bytes, speed) and quantized KV (q8_0, q4_0) against f16: agreement, accuracy, KL",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=kv_report,
    headline=headline,
)

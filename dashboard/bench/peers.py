"""`bench peers`: EdgeCache against what a user would otherwise pick, one after another on
the same MMLU prompts and the same machine.

- no cache: llama.cpp prefill every time;
- llama-cpp-python's LlamaRAMCache and LlamaDiskCache (its own prompt caches, one process);
- the paper's design: the whole context state (logits included) under a key of the whole
  prompt, no catalog, the cache box asked on every request;
- EdgeCache without the catalog, and EdgeCache as shipped.
Each peer runs every prompt twice: cold (its cache empty), then again (a hit).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import statistics
import struct
import tempfile
import time
import uuid
from typing import Callable

import numpy as np

from cachebox.keys import token_bytes
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry
from dashboard.bench.base import BenchError, Benchmark, prompts_of
from dashboard.bench.common import machine_info, median, prefix_serving
from dashboard.bench.reports import peers_report
from dashboard.mmlu import MMLUPrompt, parse_answer


class PaperDesign:
    """The paper's prototype: whole-context state per whole prompt, always asking the cache box."""

    def __init__(self, engine, store: CacheBox, namespace: str):
        self.engine, self.store, self.namespace = engine, store, namespace
        self.names: list[str] = []

    def run(self, text: str, max_tokens: int) -> dict:
        engine = self.engine
        with engine.lock:
            started = time.perf_counter()
            tokens = engine.tokenize(text, add_bos=True)
            digest = hashlib.blake2b(engine.fingerprint.encode() + token_bytes(tokens), digest_size=16).hexdigest()
            name = f"ec:paper:{self.namespace}:{{{digest}}}"
            state = self.store.redis.get(name)  # no catalog: every request asks the cache box
            engine.clear()
            if state is not None:
                (context_size,) = struct.unpack_from("<Q", state)
                engine.import_context(state[8 : 8 + context_size])
                logits = np.frombuffer(state, dtype="<f4", offset=8 + context_size)
            else:
                logits = engine.prefill(tokens, 0, logits_at={len(tokens) - 1})[len(tokens) - 1]
            token = int(np.argmax(logits))
            ttft = (time.perf_counter() - started) * 1000
            blob = None
            if state is None:  # the state after prefill, with the logits the first token came from
                context = engine.export_context()
                blob = struct.pack("<Q", len(context)) + context + np.asarray(logits, dtype="<f4").tobytes()
            generated, position = [token], len(tokens)
            while len(generated) < max_tokens and not engine.is_end_of_generation(token):
                token = int(np.argmax(engine.decode_one(token, position)))
                position += 1
                generated.append(token)
            ttlt = (time.perf_counter() - started) * 1000
            if blob is not None:  # uploaded after the answer, as EdgeCache does
                self.store.redis.set(name, blob)
                self.names.append(name)
            size = len(state if state is not None else blob)
            return {"ttft_ms": ttft, "ttlt_ms": ttlt, "text": engine.detokenize(generated), "state_bytes": size}

    def cleanup(self) -> None:
        if self.names:
            self.store.redis.delete(*self.names)


class LlamaCppPromptCache:
    """llama-cpp-python's high-level Llama with its RAM or disk prompt cache."""

    def __init__(self, model_path: str, n_ctx: int, threads: int, kind: str, cache_dir: str | None = None):
        from llama_cpp import Llama, LlamaDiskCache, LlamaRAMCache

        self.llm = Llama(model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
        cache = (
            LlamaRAMCache(capacity_bytes=8 << 30)
            if kind == "ram"
            else LlamaDiskCache(cache_dir=cache_dir, capacity_bytes=8 << 30)
        )
        self.llm.set_cache(cache)
        self.cache = cache

    def run(self, text: str, max_tokens: int) -> dict:
        started = time.perf_counter()
        ttft, pieces = None, []
        with contextlib.redirect_stderr(io.StringIO()):  # the disk cache prints a line per write
            for chunk in self.llm.create_completion(text, max_tokens=max_tokens, temperature=0.0, top_k=1, stream=True):
                if ttft is None:
                    ttft = (time.perf_counter() - started) * 1000
                pieces.append(chunk["choices"][0]["text"])
        ttlt = (time.perf_counter() - started) * 1000
        return {"ttft_ms": ttft, "ttlt_ms": ttlt, "text": "".join(pieces), "state_bytes": self._state_bytes()}

    def _state_bytes(self) -> int:
        try:
            return int(self.cache.cache_size)
        except Exception:
            return 0

    def close(self) -> None:
        self.llm.close()


def run_peers(
    board, prompts: list[MMLUPrompt], *, max_tokens: int = 4, progress: Callable[[], None] | None = None
) -> dict:
    engine, url = board.engine, board.store.url
    namespace = f"bench-peers-{uuid.uuid4().hex[:10]}"
    results: dict[str, list[dict]] = {}
    try:
        # Ours first, on the board's own engine.
        plain = CacheBox(url, timeout=60)
        no_cache = prefix_serving(engine, None, None, None)
        results["no cache"] = _passes(lambda p: _ours(no_cache, p, max_tokens, namespace), prompts)
        _tick(progress)
        paper = PaperDesign(engine, plain, namespace)
        results["paper design (whole state, no catalog)"] = _passes(lambda p: paper.run(p.text, max_tokens), prompts)
        paper.cleanup()
        _tick(progress)
        for label, use_catalog in (("EdgeCache without catalog", False), ("EdgeCache", True)):
            pipeline = prefix_serving(engine, plain, CatalogRegistry(plain, 100_000, 0.01), board.keys)
            space = f"{namespace}-{int(use_catalog)}"
            results[label] = _passes(lambda p: _ours(pipeline, p, max_tokens, space, use_catalog=use_catalog), prompts)
            plain.flush(space)
            _tick(progress)
        for kind, label in (("ram", "llama-cpp-python LlamaRAMCache"), ("disk", "llama-cpp-python LlamaDiskCache")):
            with tempfile.TemporaryDirectory(prefix="edgecache-diskcache-") as cache_dir:
                peer = LlamaCppPromptCache(
                    str(engine.model_file.path), engine.n_ctx, engine.config.threads(), kind, cache_dir
                )
                try:
                    results[label] = _passes(lambda p: peer.run(p.text, max_tokens), prompts)
                finally:
                    peer.close()
            _tick(progress)
    finally:
        board.store.flush(namespace)
    return summarize(results, prompts)


def _tick(progress) -> None:
    if progress:
        progress()


def _ours(pipeline, prompt: MMLUPrompt, max_tokens: int, namespace: str, use_catalog: bool = True) -> dict:
    result = pipeline.run(prompt.segments, max_tokens=max_tokens, namespace=namespace, use_catalog=use_catalog)
    b = result.breakdown
    return {
        "ttft_ms": b.ttft_ms,
        "ttlt_ms": b.ttlt_ms,
        "text": result.text,
        "state_bytes": b.state_bytes,
        "case": b.case,
    }


def _passes(run: Callable, prompts: list[MMLUPrompt]) -> list[dict]:
    """Every prompt cold, then every prompt again: a hit never finds its prompt still in the context."""
    cold = [run(prompt) for prompt in prompts]
    hits = [run(prompt) for prompt in prompts]
    return [{"cold": c, "hit": h, "truth": p.target.answer} for c, h, p in zip(cold, hits, prompts)]


def summarize(results: dict[str, list[dict]], prompts: list[MMLUPrompt]) -> dict:
    reference = [pair["cold"]["text"] for pair in results["no cache"]]
    peers = {}
    for name, pairs in results.items():
        peers[name] = {
            "ttft_ms": median(p["cold"]["ttft_ms"] for p in pairs),
            "ttlt_ms": median(p["cold"]["ttlt_ms"] for p in pairs),
            "hit_ttft_ms": median(p["hit"]["ttft_ms"] for p in pairs),
            "hit_ttlt_ms": median(p["hit"]["ttlt_ms"] for p in pairs),
            "state_bytes": median(max(p["cold"]["state_bytes"], p["hit"]["state_bytes"]) for p in pairs),
            "agreement_with_cold": round(
                statistics.fmean(
                    parse_answer(p["hit"]["text"]) == parse_answer(ref) for p, ref in zip(pairs, reference)
                ),
                4,
            ),
            "same_text_as_cold": round(
                statistics.fmean(p["hit"]["text"] == ref for p, ref in zip(pairs, reference)), 4
            ),
        }
    ours = peers["EdgeCache"]["hit_ttft_ms"]
    ram = peers["llama-cpp-python LlamaRAMCache"]["hit_ttft_ms"]
    return {
        "peers": peers,
        "edgecache_hit_vs_ram_cache_hit": round(ram / ours, 2) if ours else None,
        "n": len(prompts),
        "not_run": {
            "llama.cpp server slot save/restore": "no registry package ships the llama.cpp server binary; building it needs the llama.cpp sources, which only come from GitHub here"
        },
    }


# -- the command (python manage.py bench peers) --------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--topic", default="astronomy")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)


def run(ctx, *, topic, prompts, shots, max_tokens, **options) -> dict:
    if prompts < 2:
        raise BenchError("--prompts must be at least 2: a hit must not find its prompt still in the context")
    selected = prompts_of(topic, shots, prompts)
    with ctx.board() as board:
        with ctx.progress(total=6, desc="bench peers", unit="peer") as bar:
            document = run_peers(board, selected, max_tokens=max_tokens, progress=bar.update)
        document.update(
            {
                "topic": selected[0].target.topic,
                "shots": shots,
                "max_tokens": max_tokens,
                "machine": machine_info(board),
            }
        )
    document["summary"] = (
        f"EdgeCache full-hit TTFT is {document['edgecache_hit_vs_ram_cache_hit']}x faster than a LlamaRAMCache hit."
    )
    return document


def lines(doc: dict) -> list[str]:
    out = [f"\n{'peer':<42}{'TTFT':>10}{'TTLT':>10}{'hit TTFT':>10}{'state MB':>10}{'agree':>8}"]
    for name, row in doc["peers"].items():
        out.append(
            f"{name:<42}{row['ttft_ms']:>10.1f}{row['ttlt_ms']:>10.1f}{row['hit_ttft_ms']:>10.1f}{row['state_bytes'] / 1e6:>10.2f}{row['agreement_with_cold']:>8.2f}"
        )
    out.append(doc["summary"])
    return out


def headline(doc: dict) -> str:
    return f"EdgeCache hit {doc.get('edgecache_hit_vs_ram_cache_hit')}x faster than a LlamaRAMCache hit"


BENCH = Benchmark(
    name="peers",
    format=1,
    help="EdgeCache against no cache, llama-cpp-python's caches and the paper's design",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=peers_report,
    headline=headline,
)

"""Where a state comes from, nearest first: the board's context, its RAM tier, the cache box.

For each MMLU prompt, side by side in one run: cold (no cache), a full hit from the cache box
(local tiers off), a full hit from the board's context (the same prompt again), a full hit
from its RAM tier (another prompt in between), and llama-cpp-python's LlamaRAMCache hit
(its own RAM cache next to the model). Medians, network bytes, and agreement with cold.
"""

from __future__ import annotations

import uuid
from typing import Callable

from inference.exchange import Exchange
from inference.mmlu import MMLUPrompt
from inference.prefix_serving import PrefixServing

from .common import median
from .peers import LlamaCppPromptCache

FILLER = ["A prompt about something else entirely, to move the board's context on."]


def run_tiers(board, prompts: list[MMLUPrompt], *, max_tokens: int = 4, progress: Callable[[], None] | None = None) -> dict:
    engine = board.engine
    namespace = f"bench-tiers-{uuid.uuid4().hex[:10]}"
    exchange = Exchange(board.store, board.catalogs, fingerprint=engine.fingerprint, device=board.config.device, keys=board.keys)
    cachebox_only = PrefixServing(engine, exchange, chunk_tokens=board.prefix.chunk_tokens)
    local = PrefixServing(engine, exchange, chunk_tokens=board.prefix.chunk_tokens, context_reuse=True, ram_tier_bytes=512 * 1024 * 1024)
    rows = []
    try:
        for prompt in prompts:
            row: dict = {}
            cold = cachebox_only.run(prompt.segments, max_tokens=max_tokens, use_cache=False)
            cachebox_only.run(prompt.segments, max_tokens=1, namespace=namespace)  # store it
            remote = cachebox_only.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)
            local.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)  # into the context and RAM
            context = local.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)
            local.run(FILLER, max_tokens=1, namespace=namespace, upload=False)
            ram = local.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)
            for name, result in (("cold", cold), ("cachebox", remote), ("context", context), ("ram", ram)):
                b = result.breakdown
                row[name] = {"ttft_ms": b.ttft_ms, "tier": str(b.tier), "case": str(b.case), "fetched_bytes": b.fetched_bytes, "agree": result.tokens == cold.tokens}
            rows.append(row)
            if progress:
                progress()
        peer = LlamaCppPromptCache(str(engine.model_file.path), engine.n_ctx, engine.config.threads(), "ram")
        try:
            for prompt, row in zip(prompts, rows):
                peer.run(prompt.text, max_tokens)
                peer.run(FILLER[0], 1)
                hit = peer.run(prompt.text, max_tokens)
                row["llama_ram_cache"] = {"ttft_ms": hit["ttft_ms"]}
                if progress:
                    progress()
        finally:
            peer.close()
    finally:
        board.store.flush(namespace)
        board.catalogs.forget(namespace)

    def med(name: str) -> float:
        return median(row[name]["ttft_ms"] for row in rows)

    summary = {name: med(name) for name in ("cold", "cachebox", "context", "ram", "llama_ram_cache")}
    return {
        "n": len(prompts),
        "max_tokens": max_tokens,
        "median_ttft_ms": summary,
        "network_bytes": {name: median(row[name]["fetched_bytes"] for row in rows) for name in ("cachebox", "context", "ram")},
        "tiers_seen": {name: sorted({row[name]["tier"] for row in rows}) for name in ("cachebox", "context", "ram")},
        "agreement_with_cold": {name: round(sum(row[name]["agree"] for row in rows) / len(rows), 4) for name in ("cachebox", "context", "ram")},
        "ratios": {
            "context_over_cachebox": round(summary["context"] / summary["cachebox"], 4) if summary["cachebox"] else None,
            "ram_over_cachebox": round(summary["ram"] / summary["cachebox"], 4) if summary["cachebox"] else None,
            "context_over_cold": round(summary["context"] / summary["cold"], 5) if summary["cold"] else None,
            "ram_over_cold": round(summary["ram"] / summary["cold"], 5) if summary["cold"] else None,
            "llama_ram_cache_over_ram_tier": round(summary["llama_ram_cache"] / summary["ram"], 1) if summary["ram"] else None,
            "llama_ram_cache_over_context": round(summary["llama_ram_cache"] / summary["context"], 1) if summary["context"] else None,
        },
        "rows": rows,
    }

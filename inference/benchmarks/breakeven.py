"""`bench breakeven`: does the per-request policy pick the faster side on every link?

Under each link preset (emulated in the sockets), cases 1-5 of the paper are measured
three ways on the same cache-box contents: always fetch, never fetch, adaptive policy.
Target: the policy's median TTFT within 5% of the better of the other two, everywhere.
"""

from __future__ import annotations

import uuid
from typing import Callable

from cachebox.link import LINK_PRESETS
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry
from inference.breakeven import BreakEvenPolicy
from inference.mmlu import MMLUPrompt

from .cases import CASE_NAMES, seed_segments
from .common import median, prefix_serving

PRESETS = ("wifi4", "fast-ethernet", "none")
MODES = ("always", "never", "adaptive")
TOLERANCE = 0.05


def run_breakeven(engine, url: str, prompts: list[MMLUPrompt], *, keys, prefill_ms_per_token: float, progress: Callable[[], None] | None = None) -> dict:
    plain = CacheBox(url, timeout=60)
    catalogs = CatalogRegistry(plain, 100_000, 0.01)
    seeder = prefix_serving(engine, plain, catalogs, keys)
    pipelines = {}
    for preset in PRESETS:
        link = LINK_PRESETS[preset]
        store = CacheBox(url, link=link, timeout=60)
        for mode in MODES:
            policy = BreakEvenPolicy(prefill_ms_per_token=prefill_ms_per_token, link=link, mode=mode)
            pipelines[preset, mode] = prefix_serving(engine, store, catalogs, keys, policy=policy)
    ttft: dict = {(preset, case, mode): [] for preset in PRESETS for case in CASE_NAMES for mode in MODES}
    decisions: dict = {}
    for index, prompt in enumerate(prompts):
        order = MODES[index % len(MODES) :] + MODES[: index % len(MODES)]  # no mode always runs first
        for case in CASE_NAMES:
            namespace = f"bench-be-{uuid.uuid4().hex[:10]}"
            try:
                seed = seed_segments(prompt, case)
                if seed is not None:
                    seeder.run(seed, max_tokens=1, namespace=namespace)
                for preset in PRESETS:
                    for mode in order:
                        result = pipelines[preset, mode].run(prompt.segments, max_tokens=1, namespace=namespace, upload=False)
                        ttft[preset, case, mode].append(result.breakdown.ttft_ms)
                        if mode == "adaptive":
                            counts = decisions.setdefault((preset, case), {})
                            counts[result.breakdown.decision] = counts.get(result.breakdown.decision, 0) + 1
            finally:
                plain.flush(namespace)
                catalogs.forget(namespace)
        if progress:
            progress()

    presets, all_within = {}, True
    for preset in PRESETS:
        link = LINK_PRESETS[preset]
        rows = {}
        for case in CASE_NAMES:
            medians = {mode: median(ttft[preset, case, mode]) for mode in MODES}
            best = min(medians["always"], medians["never"])
            within = medians["adaptive"] <= best * (1 + TOLERANCE)
            all_within &= within
            rows[case] = {
                **{f"{mode}_ttft_ms": medians[mode] for mode in MODES},
                "best_fixed_ttft_ms": best,
                "adaptive_vs_best": round(medians["adaptive"] / best, 4) if best else None,
                "within_5pct": within,
                "adaptive_decisions": decisions.get((preset, case), {}),
            }
        presets[preset] = {"link": link.label if link else "loopback, unshaped", "emulated": link is not None, "cases": rows}
    return {"presets": presets, "target_met": all_within, "tolerance": TOLERANCE, "n": len(prompts), "case_names": CASE_NAMES}

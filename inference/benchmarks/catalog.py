"""`bench catalog`: what the Bloom catalog saves (paper section 5.2.3) and how often it is wrong.

Hit-ratio sweep: of N MMLU prompts, a share is in the cache box; each is run with the
catalog (a sure miss touches no network) and without it (every request asks the cache
box about every candidate range), over an emulated link. Then the false-positive rate of
filters filled to capacity, observed against configured.
"""

from __future__ import annotations

import os
import statistics
import uuid
from typing import Callable

from cachebox.catalog import Catalog
from cachebox.link import LINK_PRESETS
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry
from inference.breakeven import BreakEvenPolicy
from inference.mmlu import MMLUPrompt

from .common import prefix_serving

HIT_RATIOS = (0.0, 0.1, 0.5, 0.9)


def run_catalog(engine, url: str, prompts: list[MMLUPrompt], *, keys, link_preset: str, progress: Callable[[], None] | None = None) -> dict:
    link = LINK_PRESETS[link_preset]
    plain = CacheBox(url, timeout=60)
    catalogs = CatalogRegistry(plain, 100_000, 0.01)
    seeder = prefix_serving(engine, plain, catalogs, keys)
    measured = prefix_serving(engine, CacheBox(url, link=link, timeout=60), catalogs, keys, policy=BreakEvenPolicy(mode="always"))
    sweep = []
    for ratio in HIT_RATIOS:
        namespace = f"bench-cat-{uuid.uuid4().hex[:10]}"
        cached = set(range(round(ratio * len(prompts))))
        try:
            for index in cached:
                seeder.run(prompts[index].segments, max_tokens=1, namespace=namespace)
            row = {"hit_ratio": ratio}
            for mode, use_catalog in (("with_catalog", True), ("without_catalog", False)):
                runs = [measured.run(p.segments, max_tokens=1, namespace=namespace, upload=False, use_catalog=use_catalog) for p in prompts]
                misses = [r.breakdown for i, r in enumerate(runs) if i not in cached]
                row[mode] = {
                    "mean_ttft_ms": round(statistics.fmean(r.breakdown.ttft_ms for r in runs), 2),
                    "miss_network_ms": round(statistics.fmean(b.redis_ms for b in misses), 3) if misses else 0.0,
                    "hits": sum(r.breakdown.case != "miss" for r in runs),
                }
                if progress:
                    progress()
            sweep.append(row)
        finally:
            plain.flush(namespace)
            catalogs.forget(namespace)
    return {"sweep": sweep, "link": f"emulated link {link.label}", "false_positives": false_positive_rates(), "n": len(prompts)}


def false_positive_rates(capacities=(10_000, 1_000_000), probes: int = 200_000) -> list[dict]:
    """Fill filters to capacity with random keys; probe with keys never added."""
    rows = []
    for capacity in capacities:
        catalog = Catalog(capacity, 0.01)
        catalog.add_many(os.urandom(16) for _ in range(capacity))
        hits = sum(catalog.lookup([os.urandom(16) for _ in range(probes)]))
        rows.append(
            {
                "capacity": capacity,
                "configured": 0.01,
                "observed": round(hits / probes, 5),
                "estimated": round(catalog.estimated_fp_rate(), 5),
                "size_bytes": catalog.size_bits // 8,
            }
        )
    return rows

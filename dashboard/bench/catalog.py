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
from dashboard import mmlu
from dashboard.bench.base import BenchError, Benchmark
from dashboard.bench.common import machine_info, prefix_serving
from dashboard.bench.reports import catalog_report
from dashboard.mmlu import MMLUPrompt
from inference.serving.breakeven import BreakEvenPolicy

HIT_RATIOS = (0.0, 0.1, 0.5, 0.9)


def run_catalog(
    engine, url: str, prompts: list[MMLUPrompt], *, keys, link_preset: str, progress: Callable[[], None] | None = None
) -> dict:
    link = LINK_PRESETS[link_preset]
    plain = CacheBox(url, timeout=60)
    catalogs = CatalogRegistry(plain, 100_000, 0.01)
    seeder = prefix_serving(engine, plain, catalogs, keys)
    measured = prefix_serving(
        engine, CacheBox(url, link=link, timeout=60), catalogs, keys, policy=BreakEvenPolicy(mode="always")
    )
    sweep = []
    for ratio in HIT_RATIOS:
        namespace = f"bench-cat-{uuid.uuid4().hex[:10]}"
        cached = set(range(round(ratio * len(prompts))))
        try:
            for index in cached:
                seeder.run(prompts[index].segments, max_tokens=1, namespace=namespace)
            row = {"hit_ratio": ratio}
            for mode, use_catalog in (("with_catalog", True), ("without_catalog", False)):
                runs = [
                    measured.run(p.segments, max_tokens=1, namespace=namespace, upload=False, use_catalog=use_catalog)
                    for p in prompts
                ]
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
    return {
        "sweep": sweep,
        "link": f"emulated link {link.label}",
        "false_positives": false_positive_rates(),
        "n": len(prompts),
    }


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


# -- the command (python manage.py bench catalog) ------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=10, help="prompts, one per MMLU topic (no shared prefixes)")
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--link", default="wifi4", help="link preset for the cache-box traffic (default wifi4)")


def run(ctx, *, prompts, shots, link, **options) -> dict:
    if link not in LINK_PRESETS or LINK_PRESETS[link] is None:
        raise BenchError(f"--link must be one of {', '.join(k for k, v in LINK_PRESETS.items() if v)}")
    if not 1 <= prompts <= 57:
        raise BenchError("--prompts must be between 1 and 57 (one prompt per MMLU topic)")
    # One prompt per topic: no two share a prefix, so an uncached prompt is a true miss.
    selected = [mmlu.build_prompts(name, shots, 1)[0] for name in mmlu.topics()[:prompts]]
    with ctx.board() as board:
        with ctx.progress(total=2 * len(HIT_RATIOS), desc="bench catalog", unit="pass") as bar:
            document = run_catalog(
                board.engine, board.store.url, selected, keys=board.keys, link_preset=link, progress=bar.update
            )
        document.update({"topics": [p.target.topic for p in selected], "shots": shots, "machine": machine_info(board)})
    document["summary"] = "Catalog: a sure miss costs no network; without it every miss asks the cache box."
    return document


def lines(doc: dict) -> list[str]:
    out = [
        f"\n{doc['link']}; mean TTFT ms over {doc['n']} prompts",
        f"{'hit ratio':>10}{'catalog':>12}{'no catalog':>12}{'miss cost without':>20}",
    ]
    for row in doc["sweep"]:
        out.append(
            f"{row['hit_ratio']:>10.1f}{row['with_catalog']['mean_ttft_ms']:>12.1f}{row['without_catalog']['mean_ttft_ms']:>12.1f}"
            f"{row['without_catalog']['miss_network_ms']:>17.1f} ms"
        )
    for row in doc["false_positives"]:
        out.append(
            f"false positives at capacity {row['capacity']}: observed {row['observed']}, configured {row['configured']} ({row['size_bytes'] / 1e6:.2f} MB)"
        )
    return out


def headline(doc: dict) -> str:
    return f"catalog sweep over {doc.get('link', '')}"


BENCH = Benchmark(
    name="catalog",
    format=1,
    help="hit-ratio sweep with and without the catalog; false positives",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=catalog_report,
    headline=headline,
)

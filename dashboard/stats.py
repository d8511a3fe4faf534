"""Per-device figures for the pages (read-only queries)."""

from __future__ import annotations

import statistics
from datetime import datetime, timezone as dt_timezone

from .models import Device, InferenceRun

RECENT = 500  # runs per device the summaries look at


def device_summary(device: Device) -> dict:
    recent = list(device.runs.filter(error="").order_by("-created").values_list("ttft_ms", "case")[:RECENT])
    hits = sum(1 for _, case in recent if case in ("partial", "full"))
    catalogs = {}
    for namespace, catalog in ((device.status or {}).get("catalogs") or {}).items():
        last_sync = catalog.get("last_sync")
        catalogs[namespace] = {**catalog, "last_sync": datetime.fromtimestamp(last_sync, dt_timezone.utc) if last_sync else None}
    return {
        "device": device,
        "runs": device.runs.count(),
        "hit_ratio": hits / len(recent) if recent else None,
        "median_ttft_ms": statistics.median(ttft for ttft, _ in recent) if recent else None,
        "catalog_items": sum(c.get("approx_items", 0) for c in catalogs.values()),
        "catalog_fp_rate": max((c.get("estimated_fp_rate", 0.0) for c in catalogs.values()), default=None),
        "catalogs": catalogs,
    }


def recent_runs(limit: int = 200, device: Device | None = None) -> list[InferenceRun]:
    runs = InferenceRun.objects.select_related("device").filter(error="")
    if device is not None:
        runs = runs.filter(device=device)
    return list(reversed(runs.order_by("-created")[:limit]))

"""The points the dashboard's time charts draw, read from the database for a time range and
downsampled there (SQL ``GROUP BY`` on a truncated time) when the range holds many runs.

A point is one run, or the runs of one device in one time bucket (averaged, hits and runs
counted): the charts draw either the same way. Only successful runs are charted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Avg, Count, F, FloatField, Q, QuerySet
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Trunc
from django.utils import timezone

from .models import InferenceRun

# The time ranges a page offers (Grafana's basics), and the one it opens with.
RANGES: dict[str, timedelta | None] = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "24h": timedelta(hours=24),
    "all": None,
}
RANGE_LABELS = {"15m": "last 15 min", "1h": "last hour", "24h": "last 24 h", "all": "all"}
DEFAULT_RANGE = "24h"
RAW_LIMIT = 2000  # up to this many runs in the range: one point per run
MAX_BUCKETS = 1500  # beyond: per device, at most about this many time buckets
# Truncations the database does (Django's Trunc), finest first, with their width.
GRANULARITIES = (("second", 1), ("minute", 60), ("hour", 3600), ("day", 86400), ("week", 7 * 86400), ("month", 31 * 86400))
HITS = ("partial", "full")


@dataclass(frozen=True)
class ChartPoint:
    created: datetime
    device: str
    ttft_ms: float
    ttlt_ms: float
    tbt_p50_ms: float
    tbt_p99_ms: float
    state_bytes: float
    hits: int  # runs with a hit (partial or full) in this point
    runs: int  # runs in this point (1 for a raw point)


@dataclass
class Series:
    points: list[ChartPoint]
    range: str
    since: datetime | None
    granularity: str  # "run" (one point per run) or the bucket width ("minute", "hour", ...)
    runs: int  # successful runs in the range


def parse_range(value: str | None) -> str:
    return value if value in RANGES else DEFAULT_RANGE


def _float_field(name: str):
    """A breakdown field (JSON) as a float the database can average (SQLite and PostgreSQL)."""
    return Cast(KeyTextTransform(name, "breakdown"), FloatField())


def granularity_for(span: timedelta) -> str:
    """The finest truncation that cuts ``span`` into at most MAX_BUCKETS buckets."""
    seconds = max(span.total_seconds(), 1.0)
    for name, width in GRANULARITIES:
        if seconds / width <= MAX_BUCKETS:
            return name
    return GRANULARITIES[-1][0]


def chart_series(runs: QuerySet[InferenceRun], range_name: str, now: datetime | None = None) -> Series:
    """The chart points of ``runs`` (a queryset the viewer may see) within ``range_name``, oldest first."""
    range_name = parse_range(range_name)
    now = now or timezone.now()
    window = RANGES[range_name]
    since = now - window if window is not None else None
    charted = runs.filter(error="")
    if since is not None:
        charted = charted.filter(created__gte=since)
    charted = charted.order_by()  # no default ordering in the GROUP BY
    count = charted.count()
    if count <= RAW_LIMIT:
        rows = charted.order_by("created", "pk").values_list(
            "created", "device__name", "ttft_ms", "ttlt_ms", "state_bytes", "case", "breakdown__tbt_p50_ms", "breakdown__tbt_p99_ms"
        )
        points = [
            ChartPoint(created, device, ttft, ttlt, float(p50 or 0.0), float(p99 or 0.0), float(state), int(case in HITS), 1)
            for created, device, ttft, ttlt, state, case, p50, p99 in rows
        ]
        return Series(points, range_name, since, "run", count)
    first = charted.order_by("created").values_list("created", flat=True).first()
    granularity = granularity_for(now - (since or first or now))
    rows = (
        charted.annotate(bucket=Trunc("created", granularity), device_name=F("device__name"))
        .values("bucket", "device_name")
        .annotate(
            ttft=Avg("ttft_ms"),
            ttlt=Avg("ttlt_ms"),
            state=Avg("state_bytes"),
            p50=Avg(_float_field("tbt_p50_ms")),
            p99=Avg(_float_field("tbt_p99_ms")),
            hits=Count("pk", filter=Q(case__in=HITS)),
            total=Count("pk"),
        )
        .order_by("bucket", "device_name")
    )
    points = [
        ChartPoint(
            row["bucket"], row["device_name"], row["ttft"] or 0.0, row["ttlt"] or 0.0, row["p50"] or 0.0, row["p99"] or 0.0,
            float(row["state"] or 0.0), row["hits"], row["total"],
        )
        for row in rows
    ]
    return Series(points, range_name, since, granularity, count)

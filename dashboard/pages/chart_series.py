"""The points the dashboard's time charts draw, read from the database for a time range and
downsampled there (SQL ``GROUP BY`` on a truncated time) when the range holds many runs.

A point is one run, or the runs of one device in one time bucket (averaged, hits and runs
counted, hits by the tier that served them): the charts draw either the same way. Only
successful runs are charted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Avg, Count, F, FloatField, Q, QuerySet
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Trunc
from django.utils import timezone

from dashboard.models import InferenceRun
from inference.serving.breakdown import Case, Tier

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
GRANULARITIES = (
    ("second", 1),
    ("minute", 60),
    ("hour", 3600),
    ("day", 86400),
    ("week", 7 * 86400),
    ("month", 31 * 86400),
)
# A hit: a run whose matched_tokens > 0, i.e. its case is partial or full (Breakdown.classify).
HITS = (Case.PARTIAL.value, Case.FULL.value)
# The tiers a hit is attributed to, nearest first (the breakdown's ``tier``).
HIT_TIERS = (Tier.CONTEXT.value, Tier.LOCAL.value, Tier.FLASH.value, Tier.CACHEBOX.value)


def hit_tier(case: str, tier: str | None) -> str:
    """The tier a run's hit is attributed to ("" for a miss). A hit without a board-local tier
    came from the cache box: schema runs (modules) and runs recorded before boards kept tiers
    carry no ``tier``."""
    if case not in HITS:
        return ""
    return tier if tier in (Tier.CONTEXT, Tier.LOCAL, Tier.FLASH) else Tier.CACHEBOX.value


@dataclass(frozen=True)
class ChartPoint:
    created: datetime
    device: str
    ttft_ms: float
    ttlt_ms: float
    tbt_p50_ms: float
    tbt_p99_ms: float
    state_bytes: float
    runs: int  # runs in this point (1 for a raw point)
    # Runs with a hit in this point, by the tier that served it (``hit_tier``).
    context_hits: int = 0
    local_hits: int = 0
    flash_hits: int = 0
    cachebox_hits: int = 0

    @property
    def hits(self) -> int:
        """Runs with a hit (partial or full) in this point, whatever the tier."""
        return self.context_hits + self.local_hits + self.flash_hits + self.cachebox_hits

    def tier_hits(self, tier: str) -> int:
        return getattr(self, f"{tier}_hits")


def _raw_point(created, device, ttft, ttlt, p50, p99, state, case, tier) -> ChartPoint:
    served = hit_tier(case, tier)
    hits = {f"{name}_hits": int(served == name) for name in HIT_TIERS}
    return ChartPoint(created, device, ttft, ttlt, float(p50 or 0.0), float(p99 or 0.0), float(state), 1, **hits)


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
            "created",
            "device__name",
            "ttft_ms",
            "ttlt_ms",
            "breakdown__tbt_p50_ms",
            "breakdown__tbt_p99_ms",
            "state_bytes",
            "case",
            "breakdown__tier",
        )
        points = [_raw_point(*row) for row in rows]
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
            # A hit without a board-local tier is the cache box's (hit_tier).
            context_hits=Count("pk", filter=Q(case__in=HITS, breakdown__tier=Tier.CONTEXT.value)),
            local_hits=Count("pk", filter=Q(case__in=HITS, breakdown__tier=Tier.LOCAL.value)),
            flash_hits=Count("pk", filter=Q(case__in=HITS, breakdown__tier=Tier.FLASH.value)),
            hits=Count("pk", filter=Q(case__in=HITS)),
            total=Count("pk"),
        )
        .order_by("bucket", "device_name")
    )
    points = [
        ChartPoint(
            row["bucket"],
            row["device_name"],
            row["ttft"] or 0.0,
            row["ttlt"] or 0.0,
            row["p50"] or 0.0,
            row["p99"] or 0.0,
            float(row["state"] or 0.0),
            row["total"],
            context_hits=row["context_hits"],
            local_hits=row["local_hits"],
            flash_hits=row["flash_hits"],
            cachebox_hits=row["hits"] - row["context_hits"] - row["local_hits"] - row["flash_hits"],
        )
        for row in rows
    ]
    return Series(points, range_name, since, granularity, count)

"""Prometheus metrics of the control plane (served at ``/metrics``, see ``views.metrics``).

Run metrics are computed from the database at scrape time, so they cover every board and
survive restarts: the numbers are the same whichever daphne process answers. Every figure
is an SQL aggregate over InferenceRun's columns (those from the breakdown JSON are filled
when a run is saved: ``models.breakdown_counts``). The result is kept for
``EDGECACHE_METRICS_CACHE_SECONDS`` (default 2) so that several scrapers cost one query set.

Refused requests are counted per process (``refused()``), like any in-process counter.
"""

from __future__ import annotations

import threading
import time

from django.conf import settings
from django.db.models import Count, Q, Sum
from prometheus_client import CollectorRegistry, Counter, ProcessCollector
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from .models import Device, InferenceRun

# Upper bounds of the TTFT histogram, in seconds: a full hit on a fast board (~5 ms) up to a
# cold 2k-token prefill on a Pi Zero (~30 s).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0)

# name (without _total), help, the aggregate it reads
COUNTERS = (
    ("edgecache_runs", "Runs the boards reported (including failed ones).", "runs"),
    ("edgecache_run_errors", "Runs that ended in an error (no answer).", "errors"),
    ("edgecache_cache_lookups", "Runs that consulted the cache (breakdown.decision other than no-cache).", "lookups"),
    ("edgecache_prompt_tokens", "Prompt tokens of all runs.", "prompt_tokens"),
    ("edgecache_hit_tokens", "Prompt tokens restored from the cache box instead of prefilled (matched tokens).", "hit_tokens"),
    ("edgecache_fetched_bytes", "Prompt-state bytes downloaded from the cache box.", "fetched_bytes"),
    ("edgecache_uploaded_bytes", "Prompt-state bytes uploaded to the cache box.", "uploaded_bytes"),
    ("edgecache_catalog_false_positives", "Catalog 'maybe' answers for entries the cache box did not hold.", "false_positives"),
    ("edgecache_integrity_failures", "Cache entries refused and evicted as forged, corrupted or mismatched (breakdown.rejected_entries).", "rejected_entries"),
    ("edgecache_cachebox_unavailable_runs", "Runs answered by local prefill because the cache box could not be reached.", "unavailable"),
)

REFUSAL_REASONS = ("rate_limited", "login_required", "staff_required", "bad_metrics_token", "login_locked_out", "bad_api_key")


def _bucket_field(index: int) -> str:
    return f"ttft_le_{index}"


class RunMetricsCollector:
    """A prometheus_client collector over InferenceRun rows, cached for a few seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: list | None = None
        self._computed_at = 0.0

    def describe(self):
        return self._build({})

    def collect(self):
        ttl = float(getattr(settings, "EDGECACHE_METRICS_CACHE_SECONDS", 2.0))
        with self._lock:  # concurrent scrapes wait for one computation instead of running their own
            if self._families is None or time.monotonic() - self._computed_at >= ttl:
                self._families = self._compute()
                self._computed_at = time.monotonic()
            families = self._families
        return iter(families)

    def invalidate(self) -> None:
        with self._lock:
            self._families = None

    # -- computation ----------------------------------------------------------------------
    def _compute(self) -> list:
        names = dict(Device.objects.values_list("pk", "name"))
        ok = Q(error="")
        buckets = {_bucket_field(i): Count("pk", filter=ok & Q(ttft_ms__lte=bound * 1000.0)) for i, bound in enumerate(TTFT_BUCKETS)}
        sql = (
            InferenceRun.objects.order_by()
            .values("device_id")
            .annotate(
                runs=Count("pk"),
                errors=Count("pk", filter=~ok),
                prompt_tokens=Sum("prompt_tokens"),
                hit_tokens=Sum("matched_tokens"),
                ttft_count=Count("pk", filter=ok),
                ttft_sum_ms=Sum("ttft_ms", filter=ok),
                lookups=Count("pk", filter=Q(cache_lookup=True)),
                fetched_bytes=Sum("fetched_bytes"),
                uploaded_bytes=Sum("uploaded_bytes"),
                false_positives=Sum("false_positives"),
                rejected_entries=Sum("rejected_entries"),
                unavailable=Count("pk", filter=Q(cachebox_unavailable=True)),
                **buckets,
            )
        )
        per_device = {row["device_id"]: row for row in sql}
        return self._build(
            {names.get(pk, str(pk)): row for pk, row in per_device.items()} | {name: {} for pk, name in names.items() if pk not in per_device}
        )

    @staticmethod
    def _build(sql: dict[str, dict]) -> list:
        devices = sorted(sql)
        families = []
        for name, documentation, field in COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["device"])
            for device in devices:
                family.add_metric([device], float((sql.get(device) or {}).get(field) or 0))
            families.append(family)
        histogram = HistogramMetricFamily(
            "edgecache_ttft_seconds", "Time to first token of the runs that answered, in seconds.", labels=["device"]
        )
        for device in devices:
            row = sql.get(device) or {}
            counts = [(_le(bound), float(row.get(_bucket_field(i)) or 0)) for i, bound in enumerate(TTFT_BUCKETS)]
            counts.append(("+Inf", float(row.get("ttft_count") or 0)))
            histogram.add_metric([device], counts, sum_value=(row.get("ttft_sum_ms") or 0.0) / 1000.0)
        families.append(histogram)
        return families


def _le(bound: float) -> str:
    return repr(float(bound))


# The registry /metrics serves: the run metrics, this process's refusals and its resources.
REGISTRY = CollectorRegistry()
RUNS = RunMetricsCollector()
REGISTRY.register(RUNS)
ProcessCollector(registry=REGISTRY)
REFUSED = Counter(
    "edgecache_refused_requests",
    "Requests this control-plane process refused, by reason (counted per process).",
    ["reason"],
    registry=REGISTRY,
)
for _reason in REFUSAL_REASONS:
    REFUSED.labels(reason=_reason)


def refused(reason: str) -> None:
    """Count one refused request."""
    REFUSED.labels(reason=reason).inc()

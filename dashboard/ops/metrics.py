"""Prometheus metrics of the control plane (served at ``/metrics``, see ``views.metrics``).

Run metrics are computed from the database at scrape time, so they cover every board and
survive restarts: the numbers are the same whichever web process answers. Every figure
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
from django.db.models.fields.json import KeyTextTransform
from prometheus_client import CollectorRegistry, Counter, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from cachebox.errors import CacheBoxError
from dashboard.actions.cache import cachebox
from dashboard.models import Device, Dispatch, InferenceRun
from dashboard.ops.security_counts import security_counts
from dashboard.pages.stats import CANCELLED_RUNS, FAILED, outcome_q
from inference.serving.breakdown import CROSS_CLASS

# Upper bounds of the TTFT histogram, in seconds: a full hit on a fast board (~5 ms) up to a
# cold 2k-token prefill on a Pi Zero (~30 s).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0)
# Time per output token after the first: ~10 ms on a desktop core up to ~1 s on a paced Pi Zero.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# The tiers a matched token may come from (the ``tier`` label): inference.serving.breakdown's words.
TIERS = (
    ("context", "context_tokens"),
    ("local", "local_tokens"),
    ("flash", "flash_tokens"),
    ("cachebox", "fetched_tokens"),
)

# name (without _total), help, the aggregate it reads
COUNTERS = (
    ("edgecache_runs", "Runs the boards reported (including failed ones).", "runs"),
    ("edgecache_run_errors", "Runs that ended in an error (no answer; cancelled runs are not errors).", "errors"),
    ("edgecache_runs_cancelled", "Runs their client cancelled (answered in part).", "cancelled"),
    ("edgecache_cache_lookups", "Runs that consulted the cache (breakdown.decision other than no-cache).", "lookups"),
    ("edgecache_prompt_tokens", "Prompt tokens of all runs.", "prompt_tokens"),
    ("edgecache_fetched_bytes", "Prompt-state bytes downloaded from the cache box.", "fetched_bytes"),
    ("edgecache_uploaded_bytes", "Prompt-state bytes uploaded to the cache box.", "uploaded_bytes"),
    (
        "edgecache_catalog_false_positives",
        "Catalog 'maybe' answers for entries the cache box did not hold.",
        "false_positives",
    ),
    (
        "edgecache_integrity_failures",
        "Cache entries refused and evicted as forged, corrupted or mismatched (breakdown.rejected_entries).",
        "rejected_entries",
    ),
    (
        "edgecache_cachebox_unavailable_runs",
        "Runs answered by local prefill because the cache box could not be reached.",
        "unavailable",
    ),
)

REFUSAL_REASONS = (
    "rate_limited",
    "login_required",
    "staff_required",
    "bad_metrics_token",
    "login_locked_out",
    "bad_api_key",
)


def _bucket_field(index: int, name: str = "ttft") -> str:
    return f"{name}_le_{index}"


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
        names = {
            pk: (name, namespace) for pk, name, namespace in Device.objects.values_list("pk", "name", "namespace_id")
        }
        ok = Q(error="")
        decoded = ok & Q(tpot_ms__gt=0)
        buckets = {
            _bucket_field(i): Count("pk", filter=ok & Q(ttft_ms__lte=bound * 1000.0))
            for i, bound in enumerate(TTFT_BUCKETS)
        }
        buckets |= {
            _bucket_field(i, "tpot"): Count("pk", filter=decoded & Q(tpot_ms__lte=bound * 1000.0))
            for i, bound in enumerate(TPOT_BUCKETS)
        }
        buckets |= {tier: Sum(field) for tier, field in TIERS}
        sql = (
            InferenceRun.objects.order_by()
            .values("device_id")
            .annotate(
                runs=Count("pk"),
                errors=Count("pk", filter=outcome_q(FAILED)),
                cancelled=Count("pk", filter=outcome_q(CANCELLED_RUNS)),
                prompt_tokens=Sum("prompt_tokens"),
                hit_tokens=Sum("matched_tokens"),
                ttft_count=Count("pk", filter=ok),
                ttft_sum_ms=Sum("ttft_ms", filter=ok),
                tpot_count=Count("pk", filter=decoded),
                tpot_sum_ms=Sum("tpot_ms", filter=decoded),
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
        # Runs that restored a state another kernel class computed (approximate), by the class it came from.
        approximate = (
            InferenceRun.objects.filter(breakdown__approximate=CROSS_CLASS)
            .order_by()
            .values("device_id", source_class=KeyTextTransform("approximate_from", "breakdown"))
            .annotate(runs=Count("pk"))
        )
        families = self._build(
            {names.get(pk, (str(pk), "")): per_device.get(pk, {}) for pk in set(names) | set(per_device)}
        )
        cross = CounterMetricFamily(
            "edgecache_approximate_runs",
            "Runs answered from a state another kernel class computed (the namespace shares across kernel classes): approximate, "
            'not the board\'s cold answer; labelled approximate="cross-class" and the class the state came from.',
            labels=["device", "namespace", "approximate", "source_class"],
        )
        for row in approximate:
            cross.add_metric(
                [*names.get(row["device_id"], (str(row["device_id"]), "")), CROSS_CLASS, row["source_class"] or ""],
                float(row["runs"]),
            )
        return families + [cross]

    @staticmethod
    def _build(sql: dict[tuple[str, str], dict]) -> list:
        """The families, one series per (device, namespace); hit tokens also per tier. The GenAI
        names of OpenTelemetry's conventions (``gen_ai.server.time_to_first_token``, ...) are
        exported too, spelled as Prometheus spells them (dots as underscores, the unit appended)."""
        devices = sorted(sql)
        families = []
        for name, documentation, field in COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["device", "namespace"])
            for device in devices:
                family.add_metric(list(device), float((sql.get(device) or {}).get(field) or 0))
            families.append(family)
        hits = CounterMetricFamily(
            "edgecache_hit_tokens",
            "Prompt tokens restored instead of prefilled (matched tokens), by the tier that served them: "
            "context (the board's own context), local (its RAM tier), flash (its flash tier), cachebox (fetched from the cache box).",
            labels=["device", "namespace", "tier"],
        )
        cache_read = CounterMetricFamily(
            "gen_ai_usage_cache_read_input_tokens",
            "OpenTelemetry gen_ai.usage.cache_read.input_tokens: input tokens served from a cache (any tier) instead of computed.",
            labels=["device", "namespace"],
        )
        for device in devices:
            row = sql.get(device) or {}
            for tier, _ in TIERS:
                hits.add_metric([*device, tier], float(row.get(tier) or 0))
            cache_read.add_metric(list(device), float(sum(row.get(tier) or 0 for tier, _ in TIERS)))
        families += [hits, cache_read]
        for name, documentation, key, bounds in (
            (
                "edgecache_ttft_seconds",
                "Time to first token of the runs that answered, in seconds.",
                "ttft",
                TTFT_BUCKETS,
            ),
            (
                "gen_ai_server_time_to_first_token_seconds",
                "OpenTelemetry gen_ai.server.time_to_first_token: time to generate the first token of the runs that answered, in seconds.",
                "ttft",
                TTFT_BUCKETS,
            ),
            (
                "gen_ai_server_time_per_output_token_seconds",
                "OpenTelemetry gen_ai.server.time_per_output_token: time per output token after the first, of the runs that answered with two tokens or more, in seconds.",
                "tpot",
                TPOT_BUCKETS,
            ),
        ):
            histogram = HistogramMetricFamily(name, documentation, labels=["device", "namespace"])
            for device in devices:
                row = sql.get(device) or {}
                counts = [(_le(bound), float(row.get(_bucket_field(i, key)) or 0)) for i, bound in enumerate(bounds)]
                counts.append(("+Inf", float(row.get(f"{key}_count") or 0)))
                histogram.add_metric(list(device), counts, sum_value=(row.get(f"{key}_sum_ms") or 0.0) / 1000.0)
            families.append(histogram)
        return families


def _le(bound: float) -> str:
    return repr(float(bound))


class OperationsCollector(RunMetricsCollector):
    """What an operator alerts on (docs/ops/): boards up or down, the queues, the cache box's
    memory, security events. Read at scrape time (a few queries, one cache box round trip or two),
    kept for ``EDGECACHE_METRICS_CACHE_SECONDS`` like the run metrics."""

    def describe(self):
        return []  # nothing to compute at registration

    def _compute(self) -> list:
        from django.db.models import Min
        from django.utils import timezone

        now = timezone.now()
        up = GaugeMetricFamily(
            "edgecache_board_up",
            "1 while the board beats (within EDGECACHE_MISSED_HEARTBEATS of its heartbeats), else 0; revoked boards are left out.",
            labels=["device", "namespace"],
        )
        seen = GaugeMetricFamily(
            "edgecache_board_last_seen_timestamp_seconds",
            "When the board's last heartbeat came (Unix time; 0: never).",
            labels=["device", "namespace"],
        )
        info = GaugeMetricFamily(
            "edgecache_board_kernel_class_info",
            "1 for each board, labelled with the kernel class of its llama.cpp (its heartbeat's; '' before the first): "
            "boards share cached states exactly only within one class.",
            labels=["device", "namespace", "kernel_class"],
        )
        mismatches = CounterMetricFamily(
            "edgecache_audit_mismatches",
            "Entries of the board that an audit recomputed cold on another board of the same model and found not to be what they claim.",
            labels=["device", "namespace"],
        )
        quarantined = GaugeMetricFamily(
            "edgecache_board_quarantined",
            "1 while the board's entries are quarantined (an audit caught one of them; every board refuses them all), else 0.",
            labels=["device", "namespace"],
        )
        fields = ("name", "namespace_id", "last_seen", "status", "revoked_at", "audit_mismatches", "quarantined_at")
        for device in Device.objects.filter(revoked_at__isnull=True).only(*fields):
            labels = [device.name, device.namespace_id]
            up.add_metric(labels, float(device.online_at(now)))
            seen.add_metric(labels, device.last_seen.timestamp() if device.last_seen else 0.0)
            info.add_metric([*labels, device.kernel_class], 1.0)
            mismatches.add_metric(labels, float(device.audit_mismatches))
            quarantined.add_metric(labels, float(device.quarantined_at is not None))
        waiting = GaugeMetricFamily(
            "edgecache_queue_runs",
            "Runs sent to the board and not answered, lost or revoked yet (queued or running).",
            labels=["device", "namespace"],
        )
        oldest = GaugeMetricFamily(
            "edgecache_queue_oldest_wait_seconds",
            "How long the oldest of those runs has waited, in seconds (0: none waits).",
            labels=["device", "namespace"],
        )
        rows = (
            Dispatch.objects.filter(kind="run", outcome="")
            .order_by()
            .values("device__name", "namespace")
            .annotate(runs=Count("pk"), since=Min("created"))
        )
        for row in rows:
            labels = [row["device__name"] or "", row["namespace"]]
            waiting.add_metric(labels, float(row["runs"]))
            oldest.add_metric(labels, max((now - row["since"]).total_seconds(), 0.0))
        families = [up, seen, info, waiting, oldest, mismatches, quarantined]
        try:
            used, limit = cachebox().memory_bytes()
            memory = GaugeMetricFamily(
                "edgecache_cachebox_memory_used_bytes",
                "Memory the cache box server uses (INFO used_memory; a cluster: its primaries' sum).",
            )
            memory.add_metric([], float(used))
            ceiling = GaugeMetricFamily(
                "edgecache_cachebox_memory_max_bytes",
                "The cache box's maxmemory (0: no limit): at it, the least recently used entries are evicted.",
            )
            ceiling.add_metric([], float(limit))
            families += [memory, ceiling]
        except CacheBoxError:
            pass  # the cache box does not answer: its gauges are absent (alert on absent() too)
        events = CounterMetricFamily(
            "edgecache_security_events",
            "Security events of every control-plane process, by event (board_message_refused: a board message with a bad or missing signature, ...).",
            labels=["event"],
        )
        for event, count in sorted(security_counts().items()):
            events.add_metric([event], float(count))
        return families + [events]


# The registry /metrics serves: the run metrics, this process's refusals and its resources.
REGISTRY = CollectorRegistry()
RUNS = RunMetricsCollector()
REGISTRY.register(RUNS)
OPERATIONS = OperationsCollector()
REGISTRY.register(OPERATIONS)
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

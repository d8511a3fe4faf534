"""Per-device figures for the pages (read-only queries), and who may see which devices.

Staff see every namespace (tenant); any other user only the namespaces they are a member of
(``Membership``). Every page, chart and live event that shows devices or runs goes through
``visible_devices``, ``visible_runs`` or ``recent_runs``.
"""

from __future__ import annotations

import re
import statistics
from datetime import datetime
from datetime import timezone as dt_timezone

from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from dashboard.models import Device, InferenceRun, Namespace, Schema, offline_after
from inference.contract.messages import CANCELLED
from inference.engine.memory_plan import MB, MIN_N_CTX, MIN_RAM_TIER_BYTES, N_CTX_STEP, RSS_SHARE

RECENT = 500  # runs per device the summaries look at
HITS = ("partial", "full")

# -- how a run ended, counted one way on every page ------------------------------------------
# Every count of runs counts them all, and says how many of them failed and how many were
# cancelled (a cancelled run was answered in part: its TTFT was measured; it is no failure).
ANSWERED, FAILED, CANCELLED_RUNS = "answered", "failed", "cancelled"
OUTCOMES = (ANSWERED, FAILED, CANCELLED_RUNS)


def outcome_q(outcome: str) -> Q:
    """The runs that ended as ``outcome`` (one of ``OUTCOMES``)."""
    return {ANSWERED: Q(error=""), CANCELLED_RUNS: Q(error=CANCELLED), FAILED: ~Q(error="") & ~Q(error=CANCELLED)}[
        outcome
    ]


def outcome_of(error: str) -> str:
    return ANSWERED if not error else (CANCELLED_RUNS if error == CANCELLED else FAILED)


def count_aggregates(prefix: str = "") -> dict:
    """``Count`` aggregates of every run and of each outcome (keys ``runs``, ``answered``, ...)."""
    return {
        f"{prefix}runs": Count("pk"),
        **{f"{prefix}{outcome}": Count("pk", filter=outcome_q(outcome)) for outcome in OUTCOMES},
    }


def run_counts(runs: QuerySet[InferenceRun]) -> dict[str, int]:
    """``{"runs": all, "answered": ..., "failed": ..., "cancelled": ...}`` of ``runs``, in one query."""
    return runs.order_by().aggregate(**count_aggregates())


def runs_label(counts: dict) -> str:
    """A count of runs as every page says it: "38 runs (3 failed, 1 cancelled)", "1 run"."""
    total = int(counts.get("runs") or 0)
    label = f"{total} run{'' if total == 1 else 's'}"
    ended = [f"{counts[outcome]} {outcome}" for outcome in (FAILED, CANCELLED_RUNS) if counts.get(outcome)]
    return label + (f" ({', '.join(ended)})" if ended else "")


def run_figures(device: Device) -> dict:
    """What a device card shows: its runs (all of them, failed and cancelled ones said: ``runs_label``),
    and over its last ``RECENT`` answered runs the hit ratio and the median TTFT (None without
    any). Two queries."""
    recent = list(device.runs.filter(error="").order_by("-created").values_list("ttft_ms", "case")[:RECENT])
    hits = sum(1 for _, case in recent if case in HITS)
    counts = run_counts(device.runs.all())
    return {
        **counts,
        "runs_label": runs_label(counts),
        "hit_ratio": hits / len(recent) if recent else None,
        "median_ttft_ms": statistics.median(ttft for ttft, _ in recent) if recent else None,
    }


def run_figures_many(devices) -> dict[str, dict]:
    """``run_figures`` of each of ``devices`` (by name) in two queries, whatever their number."""
    from django.db.models import F, Window
    from django.db.models.functions import RowNumber

    pks = {device.pk: device.name for device in devices}
    if not pks:
        return {}
    counts = {
        row.pop("device_id"): row
        for row in InferenceRun.objects.filter(device_id__in=pks)
        .order_by()
        .values("device_id")
        .annotate(**count_aggregates())
    }
    recent: dict[int, list] = {pk: [] for pk in pks}
    rows = (
        InferenceRun.objects.filter(device_id__in=pks, error="")
        .annotate(rank=Window(RowNumber(), partition_by=[F("device_id")], order_by=F("created").desc()))
        .filter(rank__lte=RECENT)
        .values_list("device_id", "ttft_ms", "case")
    )
    for device_id, ttft, case in rows:
        recent[device_id].append((ttft, case))
    out = {}
    for pk, name in pks.items():
        mine = recent[pk]
        mine_counts = counts.get(pk) or {"runs": 0, **{outcome: 0 for outcome in OUTCOMES}}
        out[name] = {
            **mine_counts,
            "runs_label": runs_label(mine_counts),
            "hit_ratio": sum(1 for _, case in mine if case in HITS) / len(mine) if mine else None,
            "median_ttft_ms": statistics.median(ttft for ttft, _ in mine) if mine else None,
        }
    return out


def device_summaries(devices) -> list[dict]:
    """``device_summary`` of each of ``devices``, their run figures read in two queries for all."""
    devices = list(devices)
    figures = run_figures_many(devices)
    return [device_summary(device, figures[device.name]) for device in devices]


STATUSES = ("online", "offline", "never", "revoked")  # what the Devices page filters by


def status_of(revoked_at, last_seen, heartbeat_s, now=None) -> str:
    """One of ``STATUSES``, as ``Device.online`` decides it, from a device's plain fields."""

    if revoked_at is not None:
        return "revoked"
    if last_seen is None:
        return "never"
    now = now or timezone.now()
    return "online" if now - last_seen < offline_after({"heartbeat_s": heartbeat_s}) else "offline"


def fleet_counts(devices: QuerySet[Device]) -> dict:
    """How many of ``devices`` are online, offline, never seen, revoked; overall and per namespace
    (one query of plain fields: no status is decoded)."""
    now = timezone.now()
    total = {state: 0 for state in STATUSES}
    per_namespace: dict[str, dict] = {}
    for namespace, revoked_at, last_seen, heartbeat_s in devices.order_by().values_list(
        "namespace_id", "revoked_at", "last_seen", "status__heartbeat_s"
    ):
        state = status_of(revoked_at, last_seen, heartbeat_s, now)
        total[state] += 1
        row = per_namespace.setdefault(namespace, {"namespace": namespace, **{key: 0 for key in STATUSES}})
        row[state] += 1
    return {
        "total": sum(total.values()),
        **total,
        "namespaces": [per_namespace[name] for name in sorted(per_namespace)],
    }


def filter_devices(
    devices: QuerySet[Device], *, name: str = "", status: str = "", namespace: str = ""
) -> QuerySet[Device]:
    """``devices`` whose name contains ``name``, of ``namespace``, in ``status`` (one of ``STATUSES``)."""
    if name:
        devices = devices.filter(name__icontains=name)
    if namespace:
        devices = devices.filter(namespace_id=namespace)
    if status in STATUSES:
        now = timezone.now()
        wanted = [
            pk
            for pk, revoked_at, last_seen, heartbeat_s in devices.order_by().values_list(
                "pk", "revoked_at", "last_seen", "status__heartbeat_s"
            )
            if status_of(revoked_at, last_seen, heartbeat_s, now) == status
        ]
        devices = devices.filter(pk__in=wanted)
    return devices


def fill_label(ratio) -> str:
    """A Bloom filter's fill as people read it: a percentage with 2 significant digits
    ("0.22%", "12%"), "< 0.01%" for a few bits set in a large filter, "0%" when empty."""
    try:
        ratio = float(ratio or 0.0)
    except (TypeError, ValueError):
        return "–"
    if ratio <= 0:
        return "0%"
    percent = ratio * 100
    if percent < 0.01:
        return "< 0.01%"
    return f"{float(f'{percent:.2g}'):g}%"


def memory_label(status: dict | None, memory_mb: int) -> str:
    """A board's memory as its last heartbeat reported it, against what it registered:
    "412 MB RSS (peak 419 MB) of 512 MB; budget 399 MB"; "" without a report."""
    memory = (status or {}).get("memory") or {}
    try:
        rss, peak = float(memory["rss_mb"]), float(memory.get("peak_rss_mb") or memory["rss_mb"])
    except (KeyError, TypeError, ValueError):
        return ""
    label = f"{rss:.0f} MB RSS (peak {peak:.0f} MB) of {memory_mb} MB"
    budget = memory.get("budget_mb")
    if isinstance(budget, (int, float)) and budget:
        label += f"; budget {budget:.0f} MB" + (", peak over it" if peak > budget else "")
    return label


def memory_advice(status: dict | None, memory_mb: int) -> list[str]:
    """What to do about a board whose peak RSS went over its memory budget (none when within it,
    or not reported): how far over, then the knobs ``inference.engine.memory_plan`` sizes it by, the
    largest first: its RAM tier (``EDGECACHE_RAM_TIER_MB``), its context (``EDGECACHE_N_CTX``),
    then its registered memory or a smaller model."""
    status = status or {}
    memory = status.get("memory") or {}
    try:
        peak, budget = float(memory.get("peak_rss_mb") or memory["rss_mb"]), float(memory["budget_mb"])
    except (KeyError, TypeError, ValueError):
        return []
    if not budget or peak <= budget:
        return []
    over = peak - budget
    registered = memory.get("memory_mb") or memory_mb
    advice = [
        f"Over its memory budget: a peak of {peak:.0f} MB against {budget:.0f} MB ({RSS_SHARE:.0%} of the {registered} MB it is registered with; "
        f"the system keeps the rest), {over:.0f} MB over. In the board's environment, then restart it:"
    ]
    ram = status.get("ram_tier") or {}
    ram_mb = (ram.get("budget_bytes") or 0) / MB
    gives_way = ram.get("rss_limit_bytes") and not ram.get("bytes")  # it already holds nothing to stay under the budget
    if ram_mb >= 1 and not gives_way:
        lower = max(0, int(ram_mb - over) // 8 * 8)
        advice.append(
            f"lower its RAM tier, now up to {ram_mb:.0f} MB: EDGECACHE_RAM_TIER_MB={lower if lower >= MIN_RAM_TIER_BYTES / MB else 0} "
            "(the cache box serves those entries; EDGECACHE_FLASH_TIER_MB with EDGECACHE_FLASH_DIR keeps them on its disk instead);"
        )
    n_ctx, kv_mb = memory.get("n_ctx"), memory.get("kv_cache_mb")
    if isinstance(n_ctx, int) and n_ctx > MIN_N_CTX:
        smaller = max(MIN_N_CTX, n_ctx - N_CTX_STEP)
        if isinstance(kv_mb, (int, float)) and kv_mb > 0:
            per_token = kv_mb / n_ctx
            smaller = max(MIN_N_CTX, int((n_ctx - over / per_token) // N_CTX_STEP * N_CTX_STEP))
            frees = f", freeing about {(n_ctx - smaller) * per_token:.0f} MB of KV cache"
        else:
            frees = ""
        advice.append(
            f"give it a smaller context, now {n_ctx} tokens: EDGECACHE_N_CTX={smaller}{frees} (longer prompts are then refused);"
        )
    advice.append(
        f"or, if the board has more than {registered} MB, register what it has (Admin > Devices: memory): registered with "
        f"{peak / RSS_SHARE:.0f} MB, this peak is within its budget; a board with only {registered} MB serves a smaller model. "
        "A lab strategy (early exit, KV prediction, anchors) loads a second model or PyTorch: run those on a larger board."
    )
    return advice


def device_state(device: Device) -> tuple[str, str]:
    """(status, words) of a device: online, offline since …, never started, revoked."""
    if device.revoked_at is not None:
        return "revoked", "revoked"
    if device.last_seen is None:
        return "never", "never started"
    if device.online:
        return "online", "online"
    return "offline", f"offline since {timezone.localtime(device.last_seen):%Y-%m-%d %H:%M}"


def device_summary(device: Device, figures: dict | None = None) -> dict:
    """What the pages show of a device (``figures``: its ``run_figures`` when read already)."""
    return {"device": device, **(figures if figures is not None else run_figures(device)), **catalog_summary(device)}


# Why a catalog "maybe" was never asked about (cachebox.catalog.NOT_ASKED), in the device page's words.
NOT_ASKED_WORDS = (
    ("held_on_board", "not asked (the board's own context, RAM or flash tier held those ranges)"),
    ("policy_skipped", "not asked (the break-even policy forecast computing them faster)"),
    ("cachebox_down", "not asked (the cache box did not answer)"),
)


def _counter(catalog: dict, name: str) -> int:
    try:
        return max(0, int(catalog.get(name) or 0))
    except (TypeError, ValueError):
        return 0


def catalog_reconciliation(catalog: dict) -> list[str]:
    """A catalog's counters as sums that add up (the board's ``cachebox.catalog.CatalogStats``):
    lookups = certain "no"s + "maybe"s; the "maybe"s = in the cache box (true hits) + not there
    (false positives) + never asked about, by why. A board of a version that counts no reasons says
    what it leaves unexplained."""
    lookups, maybe = _counter(catalog, "lookups"), _counter(catalog, "maybe_hits")
    lines = [f'{lookups} lookup{"" if lookups == 1 else "s"} = {lookups - maybe} certain "no" + {maybe} "maybe"']
    if not maybe:
        return lines
    terms = [
        f"{_counter(catalog, 'true_hits')} in the cache box (true hits)",
        f"{_counter(catalog, 'false_positives')} not there (false positives)",
    ]
    settled = _counter(catalog, "true_hits") + _counter(catalog, "false_positives")
    for name, words in NOT_ASKED_WORDS:
        if _counter(catalog, name):
            terms.append(f"{_counter(catalog, name)} {words}")
            settled += _counter(catalog, name)
    rest = maybe - settled
    if rest and all(catalog.get(name) is None for name, _ in NOT_ASKED_WORDS):
        terms.append(f"{rest} not asked or not counted (this board's version does not say why)")
    elif rest > 0:
        terms.append(f"{rest} of a run between its lookup and its answer")
    elif rest < 0:
        terms.append(f"{rest} (counted twice: report it)")
    lines.append(f'{maybe} "maybe" = ' + " + ".join(terms))
    return lines


def catalog_summary(device: Device) -> dict:
    """A device's catalogs as its last heartbeat reported them (no query)."""
    catalogs = {}
    for namespace, catalog in ((device.status or {}).get("catalogs") or {}).items():
        last_sync = catalog.get("last_sync")
        catalogs[namespace] = {
            **catalog,
            "last_sync": datetime.fromtimestamp(last_sync, dt_timezone.utc) if last_sync else None,
            "fill_label": fill_label(catalog.get("fill_ratio")),
            "epoch": str(catalog.get("epoch") or ""),
            "reconciled": catalog_reconciliation(catalog),
        }
    return {
        "catalog_items": sum(c.get("approx_items", 0) for c in catalogs.values()),
        "catalog_fp_rate": max((c.get("estimated_fp_rate", 0.0) for c in catalogs.values()), default=None),
        "catalogs": catalogs,
        "memory": memory_label(device.status, device.memory_mb),
        "memory_advice": memory_advice(device.status, device.memory_mb),
    }


# -- what a board's error means to the person who sent the prompt ---------------------------
_CONTEXT_ERRORS = [
    # inference.serving.run.context_error
    re.compile(
        r"the prompt has (?P<tokens>\d+) tokens and (?P<asked>\d+) more were asked for, but the context holds (?P<ctx>\d+)"
    ),
    # llama-cpp-python's own check
    re.compile(r"Requested tokens \((?P<tokens>\d+)\) exceed context window of (?P<ctx>\d+)"),
]


def explain_error(error: str) -> str:
    """A board's error in the words of the page that sent the prompt (the board's own message
    is kept in the run; this only rewords what a page user can act on)."""
    if not error:
        return ""
    for pattern in _CONTEXT_ERRORS:
        found = pattern.search(error)
        if found:
            tokens, ctx = int(found["tokens"]), int(found["ctx"])
            asked = found.groupdict().get("asked")
            wanted = f" and {int(asked):,} more were asked for" if asked else ""
            return (
                f"The prompt has {tokens:,} tokens{wanted}, but the board's context holds {ctx:,}: "
                "shorten it or ask for fewer tokens."
            )
    return error


def sees_every_namespace(user) -> bool:
    return bool(user is not None and user.is_authenticated and user.is_active and (user.is_staff or user.is_superuser))


def visible_devices(user) -> QuerySet[Device]:
    """The devices ``user`` may see: all for staff, else those of the user's namespaces."""
    devices = Device.objects.select_related("namespace")
    if sees_every_namespace(user):
        return devices
    if user is None or not user.is_authenticated or not user.is_active:
        return devices.none()
    return devices.filter(namespace__memberships__user=user)  # (user, namespace) is unique: no duplicates


def visible_namespaces(user) -> list[str] | None:
    """Names of the namespaces ``user`` is a member of; None for "every namespace" (staff)."""
    if sees_every_namespace(user):
        return None
    if user is None or not user.is_authenticated or not user.is_active:
        return []
    return list(user.memberships.values_list("namespace_id", flat=True))


def namespace_choices(user) -> list[str]:
    """The namespaces ``user`` may view and act on, by name: staff every one, a member theirs."""

    namespaces = visible_namespaces(user)
    return list(Namespace.objects.values_list("name", flat=True)) if namespaces is None else sorted(namespaces)


CURRENT_NAMESPACE = "edgecache.namespace"  # the session's key: the namespace the operator viewed last


def current_namespace(request, chosen: str = "") -> str:
    """The namespace the pages show and act on for this operator: ``chosen`` (e.g. a page's
    ``?namespace=``) when they may see it, kept in their session; else the one they chose last;
    else their own (staff: ``EDGECACHE_NAMESPACE``, "default"; a member: their first namespace).
    "" for a user of no namespace."""
    from django.conf import settings

    choices = namespace_choices(request.user)
    session = getattr(request, "session", None)
    if chosen and chosen in choices:
        if session is not None:
            session[CURRENT_NAMESPACE] = chosen
        return chosen
    kept = session.get(CURRENT_NAMESPACE, "") if session is not None else ""
    if kept in choices:
        return kept
    if sees_every_namespace(request.user) and settings.EDGECACHE_NAMESPACE in choices:
        return settings.EDGECACHE_NAMESPACE
    return choices[0] if choices else ""


def visible_schemas(user):
    """The schemas ``user`` may see and run: staff all; others their namespaces' and the shared ones."""
    from django.db.models import Q

    namespaces = visible_namespaces(user)
    schemas = Schema.objects.all()
    return schemas if namespaces is None else schemas.filter(Q(namespace="") | Q(namespace__in=namespaces))


def visible_device_names(user) -> frozenset[str] | None:
    """Names of the devices ``user`` may see; None for "every device" (staff). One query."""
    if sees_every_namespace(user):
        return None
    return frozenset(visible_devices(user).values_list("name", flat=True))


def visible_runs(viewer) -> QuerySet[InferenceRun]:
    """Every run ``viewer`` may see (failed ones too), newest first."""
    runs = InferenceRun.objects.select_related("device")
    if not sees_every_namespace(viewer):
        runs = runs.filter(device__in=visible_devices(viewer))
    return runs.order_by("-created", "-pk")


def recent_runs(viewer, limit: int = 200, device: Device | None = None, *, failed: bool = False) -> list[InferenceRun]:
    """The newest runs ``viewer`` may see (oldest first), of one device or all: successful ones
    only (what the charts draw), or with ``failed`` the failed ones too (what run tables list)."""
    runs = visible_runs(viewer)
    if not failed:
        runs = runs.filter(error="")
    if device is not None:
        runs = runs.filter(device=device)
    return list(reversed(runs[:limit]))


def explained(runs):
    """``runs`` with ``error_message`` set on each (the page's words for its error)."""
    for run in runs:
        run.error_message = explain_error(run.error)
    return runs

"""Pages of the control plane. Login everywhere; staff for credentials and cache actions."""

from __future__ import annotations

import csv
import functools
import logging
from dataclasses import fields as dataclass_fields
from datetime import timedelta

import plotly.offline
from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required as _staff_member_required
from django.contrib.auth.decorators import login_required as _login_required
from django.core.paginator import Paginator
from django.db.models import Count, Sum
from django.forms import BooleanField, ModelMultipleChoiceField, MultipleChoiceField
from django.http import Http404, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.templatetags.static import static
from django.utils import timezone
from django.utils.crypto import constant_time_compare
from django.utils.text import slugify
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST, require_safe
from kombu.exceptions import OperationalError as BrokerUnavailable
from prometheus_client.exposition import choose_encoder

from cachebox.catalog import Catalog
from cachebox.errors import CacheBoxError, CacheBoxUnavailable, CatalogFormatError, InvalidNamespace
from cachebox.events import security_event
from cachebox.keys import catalog_key_names
from cachebox.store import CacheBox
from cachebox.link import LinkProfile
from cachebox.models import CacheEntry

from inference.breakdown import Breakdown
from inference.models import Schema
from inference.pml import PMLError
from .schema_info import describe, key_names, layout_of
from .chart_series import RANGE_LABELS, chart_series, parse_range
from .colors import device_colors
from .entry_preview import previews
from .explain import explain_run

from . import actions, charts, lab_charts, metrics, ratelimit, run_stream
from .bench import documents as bench_documents
from .forms import MAX_PROMPT_CHARS, ConfirmForm, DeviceForm, EncodeForm, FlushForm, RunFilterForm, RunForm, SchemaForm
from .models import AuditEvent, Device, InferenceRun
from .stats import device_summary, explain_error, explained, fill_label, recent_runs, visible_devices, visible_runs, visible_schemas

log = logging.getLogger("dashboard.views")
BROKER_RETRY_AFTER = 30  # seconds a client is told to wait after the broker was unreachable


# -- refused requests: counted (metrics.refused) and, for the serious ones, logged -------------
def _who(request) -> dict:
    """Who sent a refused request, for the security log."""
    user = getattr(request, "user", None)
    return {
        "user": user.get_username() if user is not None and user.is_authenticated else None,
        "remote_addr": request.META.get("REMOTE_ADDR", ""),
        "path": request.path,
    }


def login_required(view):
    """Django's login_required, counting the requests it sends to the login page."""
    protected = _login_required(view)

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_authenticated:
            metrics.refused("login_required")
        return protected(request, *args, **kwargs)

    return wrapper


def staff_member_required(view):
    """Django's staff_member_required, counting the requests it turns away."""
    protected = _staff_member_required(view)

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        user = request.user
        if not (user.is_active and user.is_staff):
            metrics.refused("staff_required" if user.is_authenticated else "login_required")
        return protected(request, *args, **kwargs)

    return wrapper


BREAKDOWN_BARS = 50  # runs the stacked breakdown chart shows (the newest of the range)


def home_charts(viewer, range_name: str) -> dict:
    """The dashboard's figures for a time range (``chart_series.RANGES``), as the page draws them."""
    devices = list(visible_devices(viewer))
    runs = visible_runs(viewer)
    series = chart_series(runs, range_name)
    names = sorted({point.device for point in series.points} | {device.name for device in devices})
    colors = device_colors(devices)
    newest = runs.filter(error="")
    if series.since is not None:
        newest = newest.filter(created__gte=series.since)
    bars = list(reversed(newest[:BREAKDOWN_BARS]))
    return {
        "breakdown": charts.breakdown_figure(bars),
        "timeline": charts.timeline_figure(series.points, names, colors),
        "tbt": charts.tbt_figure(series.points, names, colors),
        "hits": charts.hit_ratio_figure(series.points, names, colors),
        "bytes": charts.bytes_figure(series.points, names, colors),
        "hitCounts": charts.hit_counts(series.points),
        "tierCounts": charts.tier_counts(series.points),  # live runs carry the hit-ratio chart on from these
        "hitTiers": charts.hit_tiers(),
        "colors": colors,
        "range": series.range,
        "granularity": series.granularity,
        "runs": series.runs,
        "window": charts.WINDOW,
    }


@login_required
def home(request):
    devices = list(visible_devices(request.user))
    chart_data = home_charts(request.user, parse_range(request.GET.get("range")))
    store = actions.cachebox()
    return render(
        request,
        "dashboard/home.html",
        {
            "summaries": [device_summary(device) for device in devices],
            "chart_data": chart_data,
            "ranges": RANGE_LABELS,
            # The table lists failed runs too (the charts draw successful ones only).
            "runs": explained(recent_runs(request.user, 20, failed=True)[::-1]),
            "cachebox_up": store.ping(),
            "cachebox_url": store.safe_url,
            "embedded": settings.REDIS_URL_IS_EMBEDDED,
        },
    )


@login_required
def home_charts_json(request):
    """The dashboard's figures for ``?range=`` (15m, 1h, 24h, all): the page's range buttons."""
    return JsonResponse(home_charts(request.user, parse_range(request.GET.get("range"))))


@login_required
def device_list(request):
    return render(request, "dashboard/devices.html", {"summaries": [device_summary(d) for d in visible_devices(request.user)]})


@staff_member_required
@never_cache
def device_register(request):
    form = DeviceForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = {field: form.cleaned_data[field] for field in ("name", "namespace", "kind", "cpu_threads", "memory_mb", "link_bandwidth_mbps", "link_rtt_ms")}
        device, token = actions.register_device(request.user, **data)
        return render(request, "dashboard/device_token.html", {"device": device, "token": token, "created": True})
    return render(request, "dashboard/device_form.html", {"form": form, "link_presets": DeviceForm.link_presets()})


def _link(device: Device) -> LinkProfile | None:
    if not device.link_bandwidth_mbps:
        return None
    return LinkProfile(device.link_bandwidth_mbps, device.link_rtt_ms or 0.0)


def _breakeven(device: Device, viewer) -> dict:
    breakdowns = [run.breakdown for run in recent_runs(viewer, charts.BREAKEVEN_RUNS, device)]
    return charts.breakeven_figure(breakdowns, _link(device), device.link_label)


@login_required
def device_detail(request, name):
    device = get_object_or_404(visible_devices(request.user), name=name)  # another tenant's: 404, as if absent
    return render(
        request,
        "dashboard/device_detail.html",
        {
            "summary": device_summary(device),
            "device": device,
            "runs": explained(recent_runs(request.user, 20, device, failed=True)[::-1]),
            "chart_data": {"breakeven": _breakeven(device, request.user)},
        },
    )


@login_required
def device_breakeven(request, name):
    device = get_object_or_404(visible_devices(request.user), name=name)
    return JsonResponse(_breakeven(device, request.user))


def _confirmation(request, device: Device, question: str, consequence: str):
    """None once the POST confirmed; otherwise the page that asks (shown again if unchecked)."""
    form = ConfirmForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        return None
    return render(
        request, "dashboard/confirm.html", {"form": form, "question": question, "consequence": consequence, "cancel_url": device.get_absolute_url()}
    )


@staff_member_required
@never_cache
def device_rotate(request, name):
    device = get_object_or_404(Device, name=name)
    page = _confirmation(request, device, f"Rotate the token of {device.name}?", "Its board is refused until restarted with the new token.")
    if page:
        return page
    token = actions.rotate_token(request.user, device)
    return render(request, "dashboard/device_token.html", {"device": device, "token": token, "created": False})


@staff_member_required
def device_revoke(request, name):
    device = get_object_or_404(Device, name=name)
    page = _confirmation(request, device, f"Revoke {device.name}?", "Its board is refused from its next task on; rotate the token to let it back.")
    if page:
        return page
    actions.revoke_device(request.user, device)
    messages.success(request, f"{device.name} is revoked: its board is refused from its next task on.")
    return redirect(device)


WAIT_HINT_SECONDS = 30  # an answer card without an answer after this long says how to start the board


def _run_page_context(request, form, **extra) -> dict:
    """What every rendering of the Run page shows besides its form."""
    return {
        "form": form,
        "max_prompt_chars": MAX_PROMPT_CHARS,
        "task_expires": settings.EDGECACHE_TASK_EXPIRES,
        "wait_hint_seconds": WAIT_HINT_SECONDS,
        "chart_data": {},
        **extra,
    }


def _again_initial(request) -> tuple[dict, InferenceRun | None]:
    """The Run page filled in from a run of ``?again=<id>`` (one the user may see), to send it again."""
    try:
        pk = int(request.GET.get("again", ""))
    except ValueError:
        return {}, None
    run = visible_runs(request.user).filter(pk=pk).first()
    if run is None:
        return {}, None
    generated = (run.breakdown or {}).get("generated_tokens") or 8
    initial = {"devices": [run.device.pk], "max_tokens": max(1, min(256, int(generated)))}
    if run.prompt.lstrip().startswith("<prompt"):
        initial.update(source="pml", pml=run.prompt)
    else:
        initial.update(source="text", text=run.prompt)
    return initial, run


@login_required
def run_page(request):
    if request.method == "POST":
        form = RunForm(request.POST, user=request.user)
        accept = request.headers.get("Accept", "")
        wants_json = accept.startswith("application/json") or accept.startswith(run_stream.CONTENT_TYPE)  # refusals: JSON for the script
        # Refused submissions (empty, too long, another tenant's device) send nothing and are not
        # counted: the limit counts only the valid submissions about to be sent.
        if not form.is_valid():
            if wants_json:
                return JsonResponse({"errors": form.errors.get_json_data()}, status=400)
            return render(request, "dashboard/run.html", _run_page_context(request, form), status=400)
        verdict = ratelimit.hit("run", request.user.pk, settings.EDGECACHE_RUN_RATE)
        if not verdict.allowed:
            return _run_rate_limited(request, verdict, wants_json)
        devices, spec = list(form.cleaned_data["devices"]), form.prompt_spec()
        routed = None
        if form.cleaned_data.get("any_board"):
            routed = actions.route_run(devices or list(form.fields["devices"].queryset), spec)
            if routed is None:
                message = "No board is online to take it: start one with `python manage.py edge --name NAME`, or tick a device (it gets the run when it starts)."
                return JsonResponse({"errors": {"any_board": [{"message": message}]}}, status=503) if wants_json else _run_page_refused(request, message, 503)
            devices = [routed.device]
        if accept.startswith(run_stream.CONTENT_TYPE):
            # The page's script: the runs' stages and tokens follow in this response, as they come.
            response = StreamingHttpResponse(run_stream.follow(request.user, devices, spec, routed), content_type=run_stream.CONTENT_TYPE)
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"
            return response
        try:
            sent = _each_until_broker_fails(devices, lambda device: actions.dispatch_run(request.user, [device], spec, routed=routed))
        except _BrokerDown as down:
            return _broker_unavailable(request, down, wants_json, lambda message: _run_page_refused(request, message, 503))
        if wants_json:
            return JsonResponse({"dispatched": sent})
        messages.success(request, f"Sent to {', '.join(item['device'] for item in sent)}; answers appear below as they arrive.")
        return redirect("run")
    initial, again = _again_initial(request)
    form = RunForm(initial=initial or None, user=request.user)
    runs = recent_runs(request.user, 50, failed=True)
    charted = [run for run in runs if not run.error]
    return render(
        request,
        "dashboard/run.html",
        _run_page_context(
            request,
            form,
            again=again,
            runs=explained(runs[::-1][:10]),
            chart_data={"breakdown": charts.breakdown_figure(charted), "window": charts.WINDOW},
        ),
    )


@login_required
@require_POST
def run_cancel(request):
    """The Run page's Cancel: the boards stop these runs between two tokens (or never start them)."""
    try:
        cancelled = run_stream.cancel_runs(request.user, request.POST.getlist("request_id"))
    except CacheBoxUnavailable as exc:
        return JsonResponse({"errors": {"__all__": [{"message": f"Not cancelled: the cache box does not answer ({exc}).", "code": "cachebox_unavailable"}]}}, status=503)
    return JsonResponse({"cancelled": cancelled})


# -- the Runs page, one run, exports ----------------------------------------------------------------
RUNS_PER_PAGE = 50
EXPORT_LIMIT = 10_000  # rows one export holds at most (newest first)
EXPORT_FIELDS = [
    "id", "created", "device", "namespace", "source", "title", "case", "decision", "cachebox", "prompt_tokens", "matched_tokens",
    "generated_tokens", "ttft_ms", "ttlt_ms", "state_bytes", "error", "prompt", "answer",
]


def _filtered_runs(request):
    form = RunFilterForm(request.GET or None, user=request.user)
    return form, form.apply(visible_runs(request.user))


@login_required
def run_list(request):
    form, runs = _filtered_runs(request)
    paginator = Paginator(runs, RUNS_PER_PAGE)
    page = paginator.get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(
        request,
        "dashboard/runs.html",
        {"filter_form": form, "page": page, "runs": explained(list(page.object_list)), "query": query.urlencode(), "total": paginator.count},
    )


def _export_row(run: InferenceRun) -> dict:
    breakdown = run.breakdown or {}
    return {
        "id": run.pk,
        "created": run.created.isoformat(),
        "device": run.device.name,
        "namespace": run.device.namespace_id,
        "source": run.source,
        "title": run.title,
        "case": run.case,
        "decision": breakdown.get("decision", ""),
        "cachebox": breakdown.get("cachebox", ""),
        "prompt_tokens": run.prompt_tokens,
        "matched_tokens": run.matched_tokens,
        "generated_tokens": breakdown.get("generated_tokens", 0),
        "ttft_ms": run.ttft_ms,
        "ttlt_ms": run.ttlt_ms,
        "state_bytes": run.state_bytes,
        "error": run.error,
        "prompt": run.prompt,
        "answer": run.text,
    }


def _csv_cell(value):
    """A cell a spreadsheet shows as text, never runs as a formula (prompts are user input)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


class _Echo:
    def write(self, value):
        return value


@login_required
def run_export(request, fmt):
    """The Runs page's filtered list (newest first, at most EXPORT_LIMIT rows) as CSV or JSON."""
    _, runs = _filtered_runs(request)
    rows = runs[:EXPORT_LIMIT]
    stamp = timezone.now().strftime("%Y%m%d-%H%M%S")
    if fmt == "json":
        data = [_export_row(run) for run in rows.iterator()]
        response = JsonResponse({"count": len(data), "limit": EXPORT_LIMIT, "runs": data}, json_dumps_params={"ensure_ascii": False})
    else:
        writer = csv.writer(_Echo())

        def lines():
            yield writer.writerow(EXPORT_FIELDS)
            for run in rows.iterator():
                row = _export_row(run)
                yield writer.writerow([_csv_cell(row[field]) for field in EXPORT_FIELDS])

        response = StreamingHttpResponse(lines(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="edgecache-runs-{stamp}.{fmt}"'
    return response


def _breakdown_rows(breakdown: dict) -> list[tuple[str, object]]:
    """Every field of a run's breakdown: the known ones in their order, then any others."""
    known = [f.name for f in dataclass_fields(Breakdown)]
    rows = [(name, breakdown[name]) for name in known if name in breakdown]
    rows += sorted((name, value) for name, value in breakdown.items() if name not in known and name != "entries")  # entries: their own section
    return rows


@login_required
def run_detail(request, pk):
    run = get_object_or_404(visible_runs(request.user), pk=pk)  # another tenant's: 404, as if absent
    run.error_message = explain_error(run.error)
    breakdown = run.breakdown or {}
    entries = breakdown.get("entries") or {}
    return render(
        request,
        "dashboard/run_detail.html",
        {
            "run": run,
            "breakdown_rows": _breakdown_rows(breakdown),
            "modules_hit": breakdown.get("modules_hit"),
            "entries_known": "entries" in breakdown,
            "fetched_entries": entries.get("fetched", []),
            "stored_entries": entries.get("stored", []),
            "explanation": explain_run(text=run.text, error=run.error, expected_answer=run.expected_answer, breakdown=breakdown),
            "tbt": (breakdown.get("tbt_p50_ms"), breakdown.get("tbt_p99_ms")),
        },
    )


def favicon(request):
    return redirect(static("favicon.svg"), permanent=True)


def _as_sent(form_class, data) -> dict:
    """A form's submitted values as initial values (an unchecked box was not sent: False)."""
    initial = {}
    for name, field in form_class.base_fields.items():
        if isinstance(field, BooleanField):
            initial[name] = name in data
        elif name in data:
            initial[name] = data.getlist(name) if isinstance(field, MultipleChoiceField | ModelMultipleChoiceField) else data.get(name)
    return initial


def _run_rate_limited(request, verdict: ratelimit.Verdict, wants_json: bool) -> HttpResponse:
    """429: nothing is dispatched; the form comes back as it was sent, with how long to wait."""
    metrics.refused("rate_limited")
    security_event("run.rate_limited", limit_per_minute=verdict.limit, requests=verdict.count, retry_after=verdict.retry_after, **_who(request))
    seconds = "1 second" if verdict.retry_after == 1 else f"{verdict.retry_after} seconds"
    message = f"Too many runs: at most {verdict.limit} per minute. Nothing was sent; try again in {seconds}."
    if wants_json:
        response = JsonResponse({"errors": {"__all__": [{"message": message, "code": "rate_limited"}]}, "retry_after": verdict.retry_after}, status=429)
    else:
        response = _run_page_refused(request, message, 429)
    response["Retry-After"] = str(verdict.retry_after)
    return response


def _run_page_refused(request, message: str, status: int) -> HttpResponse:
    """The Run page again, with why the submission was refused and the form as it was sent."""
    # Unbound, with what was sent as initial values: shown again without re-validating it.
    form = RunForm(initial=_as_sent(RunForm, request.POST), user=request.user)
    return render(request, "dashboard/run.html", _run_page_context(request, form, refusal=message), status=status)


# -- the message broker (the cache box's Redis) down: 503, never a 500 ---------------------------
class _BrokerDown(Exception):
    def __init__(self, error: Exception, sent: list[dict], not_sent: list[str]):
        super().__init__(str(error))
        self.error, self.sent, self.not_sent = error, sent, not_sent


def _each_until_broker_fails(devices: list[Device], send) -> list[dict]:
    """``send(device)`` for each device in turn; if the broker fails, _BrokerDown says which
    devices got their message before it did (so the answer can say exactly what was sent)."""
    sent: list[dict] = []
    for index, device in enumerate(devices):
        try:
            sent.extend(send(device))
        except BrokerUnavailable as exc:
            raise _BrokerDown(exc, sent, [d.name for d in devices[index:]]) from exc
    return sent


def _broker_unavailable(request, down: _BrokerDown, wants_json: bool, page) -> HttpResponse:
    """503 with what happened and what to do; JSON for the page's script, else ``page(message)``."""
    where = CacheBox(settings.REDIS_URL).safe_url  # the broker's server, which may not be the cache box's (no password shown)
    if down.sent:
        outcome = f"sent to {', '.join(item['device'] for item in down.sent)} only; not sent to {', '.join(down.not_sent)}"
    else:
        outcome = "nothing was sent"
    message = (
        f"The message broker (the Redis/Valkey server at {where}) is not reachable: start it (`make run` starts the embedded one) "
        f"or check REDIS_URL; {outcome}. Try again in {BROKER_RETRY_AFTER} seconds."
    )
    log.warning("broker unreachable at %s (%s, %d sent, %d not): %s", where, request.path, len(down.sent), len(down.not_sent), down.error)
    if wants_json:
        body = {"errors": {"__all__": [{"message": message, "code": "broker_unavailable"}]}, "dispatched": down.sent, "retry_after": BROKER_RETRY_AFTER}
        response = JsonResponse(body, status=503)
    else:
        response = page(message)
    response["Retry-After"] = str(BROKER_RETRY_AFTER)
    return response


def _master_epoch(store, namespace: str) -> str:
    """The namespace's live catalog epoch (boards compare theirs with it at every sync); "" when
    the cache box holds none (flushed or restarted: the next board to sync starts a new one).
    Read as it is, never created: the page only looks."""
    value = store.read_entries([catalog_key_names(namespace)["epoch"]])[0]  # a plain GET
    return value.decode(errors="replace") if value else ""


NEWEST_ENTRIES = 15  # entries the Cache page lists (Admin > Cache entries lists them all)


def _newest_entries() -> list[dict]:
    entries = list(CacheEntry.objects.order_by("-created")[:NEWEST_ENTRIES])
    holds = previews(entries)
    return [{"entry": entry, "holds": holds.get(entry.key, "")} for entry in entries]


@staff_member_required
def cache_page(request):
    store = actions.cachebox()
    namespaces = list(
        CacheEntry.objects.values("namespace", "model").annotate(entries=Count("id"), bytes=Sum("bytes"), hits=Sum("hits")).order_by("namespace", "model")
    )
    devices = [device_summary(device) for device in Device.objects.select_related("namespace")]
    board_namespaces = {namespace for summary in devices for namespace in summary["catalogs"]}
    masters, epochs = [], {}
    try:
        for namespace in sorted({row["namespace"] for row in namespaces} | {settings.EDGECACHE_NAMESPACE} | board_namespaces):
            try:
                catalog_key_names(namespace)
            except InvalidNamespace:
                continue  # a board's report naming no usable namespace: no master copy to read
            bloom, last_id, _ = store.catalog_snapshot(namespace)
            pending = store.catalog_log_length(namespace)
            epochs[namespace] = epoch = _master_epoch(store, namespace)
            catalog = None
            if bloom:
                try:
                    catalog = Catalog.from_bytes(bloom)
                except CatalogFormatError:
                    catalog = None
            masters.append(
                {
                    "namespace": namespace,
                    "has_snapshot": catalog is not None,
                    "snapshot_items": round(catalog.approx_items) if catalog else 0,
                    "fill_label": fill_label(catalog.fill_ratio()) if catalog else "–",
                    "estimated_fp_rate": catalog.estimated_fp_rate() if catalog else None,
                    "pending_log": pending,
                    "epoch": epoch,
                }
            )
        reachable = True
    except CacheBoxUnavailable:
        reachable = False
    for summary in devices:
        for namespace, catalog in summary["catalogs"].items():
            # A board's filter from an older epoch (the catalog was flushed, or the cache box
            # restarted empty) is dropped at its next sync; until then its figures are the old ones.
            catalog["stale"] = reachable and catalog["epoch"] != epochs.get(namespace, "")
    return render(
        request,
        "dashboard/cache.html",
        {
            "namespaces": namespaces,
            "masters": masters,
            "reachable": reachable,
            "devices": devices,
            "flush_form": FlushForm(),
            "entries": _newest_entries(),
            "events": AuditEvent.objects.select_related("user")[:15],
        },
    )


@staff_member_required
@require_POST
def cache_flush(request):
    form = FlushForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Nothing flushed: " + "; ".join(" ".join(errors) for errors in form.errors.values()))
        return redirect("cache")
    namespace, model = form.cleaned_data.get("namespace") or None, form.cleaned_data.get("model") or None
    try:
        removed = actions.flush_entries(request.user, namespace, model)
    except CacheBoxUnavailable as exc:
        messages.error(request, f"Nothing flushed: {exc}")
        return redirect("cache")
    messages.success(request, f"Deleted {removed} entries.")
    return redirect("cache")


# -- metrics -------------------------------------------------------------------------------------
def _metrics_refusal(request) -> tuple[int, str, str, str] | None:
    """None when the request may read the metrics, else (status, reason, detail for the log, answer)."""
    header = request.headers.get("Authorization", "")
    if header:  # a token was presented: it decides, whoever is logged in
        scheme, _, presented = header.strip().partition(" ")
        token = settings.EDGECACHE_METRICS_TOKEN
        if scheme.lower() != "bearer":
            return 401, "bad_metrics_token", f"{scheme[:20]} authorization", "Metrics take Authorization: Bearer <token>."
        if not token:
            return 401, "bad_metrics_token", "EDGECACHE_METRICS_TOKEN is not set", "Wrong metrics token."
        if not constant_time_compare(presented.strip(), token):
            return 401, "bad_metrics_token", "wrong token", "Wrong metrics token."
        return None
    user = request.user
    if not user.is_authenticated:
        return 401, "login_required", "no credentials", "Metrics need Authorization: Bearer <token> or a staff login."
    if not (user.is_active and user.is_staff):
        return 403, "staff_required", "not staff", "Metrics are for staff accounts (or the metrics token)."
    return None


@require_safe
@never_cache
def metrics_view(request):
    """Prometheus metrics: the runs of every board (from the database) and this process's refusals."""
    refusal = _metrics_refusal(request)
    if refusal is not None:
        status, reason, detail, answer = refusal
        metrics.refused(reason)
        security_event("metrics.refused", reason=reason, detail=detail, status=status, **_who(request))
        response = HttpResponse(answer + "\n", status=status, content_type="text/plain; charset=utf-8")
        if status == 401:
            response["WWW-Authenticate"] = 'Bearer realm="edgecache metrics"'
        return response
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))  # text format, or OpenMetrics when asked
    return HttpResponse(encode(metrics.REGISTRY), content_type=content_type)


@functools.lru_cache(maxsize=1)
def _plotly_js() -> str:
    return plotly.offline.get_plotlyjs()


def plotly_js(request):
    """Plotly.js from the plotly package itself: no CDN, works offline."""
    response = HttpResponse(_plotly_js(), content_type="application/javascript")
    response["Cache-Control"] = "public, max-age=86400"
    return response


# -- schemas ---------------------------------------------------------------------------------------
@login_required
def schema_list(request):
    return render(request, "dashboard/schemas.html", {"schemas": visible_schemas(request.user)})


@staff_member_required
def schema_edit(request, pk=None):
    schema = get_object_or_404(Schema, pk=pk) if pk else Schema(created_by=request.user)
    form = SchemaForm(request.POST or None, instance=schema)
    if request.method == "POST" and form.is_valid():
        schema = actions.save_schema(request.user, form)
        messages.success(request, f"Saved schema {schema.name}.")
        return redirect(schema)
    return render(request, "dashboard/schema_form.html", {"form": form, "schema": schema if pk else None})


def _cache_status(schema: Schema, layout, viewer) -> tuple[list[Device], dict[str, dict[str, bool]]]:
    """For each device ``viewer`` may see that reported its model: which pieces the cache box holds for it."""
    devices = [device for device in visible_devices(viewer) if (device.status or {}).get("fingerprint")]
    status: dict[str, dict[str, bool]] = {}
    try:
        store = actions.cachebox()
        for device in devices:
            names = key_names(layout, device.status["fingerprint"], device.cache_namespace)
            status[device.name] = dict(zip(names, store.exists(list(names.values()))))
    except CacheBoxError:  # the cache box is down or refused (or a namespace is unusable): no status, the page still works
        status = {}
    return devices, status


@login_required
def schema_detail(request, pk):
    schema = get_object_or_404(visible_schemas(request.user), pk=pk)
    try:
        layout = layout_of(schema.source)
    except PMLError as exc:
        messages.error(request, f"This schema no longer parses: {exc}")
        return redirect("schema-edit", pk=schema.pk)
    rows = describe(layout)
    devices, status = _cache_status(schema, layout, request.user)
    for row in rows:
        row["cached"] = [status.get(device.name, {}).get(row["piece"], False) for device in devices]
    return render(
        request,
        "dashboard/schema_detail.html",
        {"schema": schema, "rows": rows, "devices": devices, "positions": layout.positions, "encode_form": EncodeForm(user=request.user, schema=schema), "has_status": bool(status)},
    )


@staff_member_required
@require_POST
def schema_encode(request, pk):
    schema = get_object_or_404(Schema, pk=pk)
    form = EncodeForm(request.POST, user=request.user, schema=schema)
    wants_json = request.headers.get("Accept", "").startswith("application/json")
    if not form.is_valid():
        if wants_json:
            return JsonResponse({"errors": form.errors.get_json_data()}, status=400)
        messages.error(request, "Nothing encoded: " + " ".join(" ".join(errors) for errors in form.errors.values()))
        return redirect(schema)
    namespace = form.cleaned_data["namespace"]
    try:
        sent = _each_until_broker_fails(list(form.cleaned_data["devices"]), lambda device: actions.dispatch_encode(request.user, schema, [device], namespace))
    except _BrokerDown as down:

        def page(message: str) -> HttpResponse:
            return render(request, "dashboard/broker_unavailable.html", {"message": message, "back_url": schema.get_absolute_url()}, status=503)

        return _broker_unavailable(request, down, wants_json, page)
    if wants_json:
        return JsonResponse({"dispatched": sent})
    messages.success(request, f"Encoding on {', '.join(item['device'] for item in sent)}.")
    return redirect(schema)


@staff_member_required
def schema_delete(request, pk):
    schema = get_object_or_404(Schema, pk=pk)
    form = ConfirmForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        removed = actions.delete_schema(request.user, schema)
        messages.success(request, f"Deleted schema {schema.name} and {removed} cache entries of its modules.")
        return redirect("schemas")
    return render(
        request,
        "dashboard/confirm.html",
        {"form": form, "question": f"Delete schema {schema.name}?", "consequence": "Every cache entry of its modules is deleted too, for every model and namespace.", "cancel_url": schema.get_absolute_url()},
    )


# -- benchmarks ------------------------------------------------------------------------------------
@login_required
def benchmark_list(request):
    """Saved benchmark reports (``python manage.py bench ...`` writes JSON and HTML here)."""
    reports = []
    for path, doc in bench_documents.saved_documents():
        if not isinstance(doc, dict):
            continue
        reports.append(
            {
                "name": path.stem,
                "kind": bench_documents.kind_of(doc) or path.stem.split("-")[0],
                "date": (doc.get("machine") or {}).get("date", ""),
                "summary": bench_documents.headline(doc),
                "has_html": path.with_suffix(".html").exists(),
            }
        )
    return render(request, "dashboard/benchmarks.html", {"reports": reports, "folder": bench_documents.results_dir()})


def _lab_section(study, saved) -> dict:
    path, doc = saved or (None, None)
    try:
        shown = lab_charts.section(study, doc)
    except Exception as exc:  # a document from another version of its bench: say so, draw the others
        log.warning("lab document %s not drawn: %r", path, exc)
        shown = {**lab_charts.section(study, None), "error": f"{type(exc).__name__}: {exc}"}
    if path is not None:
        machine = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
        shown["document"] = {
            "name": path.stem,
            "file": f"{path.parent.name}/{path.name}",
            "date": machine.get("date", ""),
            "machine": ", ".join(str(machine[key]) for key in ("cpu", "model", "compute_profile") if machine.get(key)),
            # Served by benchmark_report, whose address takes a slug.
            "has_html": path.with_suffix(".html").exists() and slugify(path.stem) == path.stem,
        }
    return shown


@login_required
def lab_page(request):
    """The lab strategies' trade-offs (approximate: lab), from their newest saved bench documents."""
    found = bench_documents.newest(study.kind for study in lab_charts.STUDIES)
    sections = [_lab_section(study, found.get(study.kind)) for study in lab_charts.STUDIES]
    figures = {figure["id"]: figure["figure"] for shown in sections for figure in shown["figures"]}
    return render(request, "dashboard/lab.html", {"sections": sections, "note": lab_charts.NOTE, "chart_data": {"figures": figures}})


@login_required
def benchmark_report(request, name):
    """One saved HTML report (self-contained: plotly.js inline)."""
    folder = bench_documents.results_dir()
    candidates = {path.stem: path for path in folder.glob("*.html")} if folder.is_dir() else {}
    if name not in candidates:  # only files the folder lists: no path tricks
        raise Http404("no such report")
    response = HttpResponse(candidates[name].read_bytes(), content_type="text/html; charset=utf-8")
    response["Content-Security-Policy"] = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"
    response["X-Frame-Options"] = "SAMEORIGIN"
    return response


# -- login throttling (django-axes calls this when a username + address is locked out) ------------
def login_locked_out(request, original_response=None, credentials=None) -> HttpResponse:
    """429: the page that says the login is locked and when to try again (AXES_LOCKOUT_CALLABLE).

    Axes records every refused attempt, a locked-out one too, so the lockout ends one cool-off
    after the latest attempt: this one.
    """
    cool_off: timedelta = settings.AXES_COOLOFF_TIME
    attempted = getattr(request, "axes_attempt_time", None) or timezone.now()
    retry_at = attempted + cool_off
    credentials = getattr(request, "axes_credentials", None) or (credentials if isinstance(credentials, dict) else {})
    username = (credentials or {}).get("username") or request.POST.get("username", "")
    wait_seconds = max(1, int((retry_at - timezone.now()).total_seconds()))
    metrics.refused("login_locked_out")
    security_event("login.locked_out", username=username[:150], retry_at=retry_at.isoformat(), failure_limit=settings.AXES_FAILURE_LIMIT, **_who(request))
    response = render(
        request,
        "dashboard/locked_out.html",
        {"username": username, "retry_at": retry_at, "minutes": max(1, round(wait_seconds / 60)), "failure_limit": settings.AXES_FAILURE_LIMIT},
        status=429,
    )
    response["Retry-After"] = str(wait_seconds)
    return response

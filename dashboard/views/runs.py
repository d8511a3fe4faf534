"""Runs: the Run page (send a prompt, follow it), cancel, the Runs list, its exports, one run."""

from __future__ import annotations

import csv
import json
import re
import uuid

from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.forms import BooleanField, ModelMultipleChoiceField, MultipleChoiceField
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event
from dashboard import actions, admission
from dashboard.live import run_stream
from dashboard.ops import metrics
from dashboard.pages import board_start, charts
from dashboard.pages.explain import explain_run
from dashboard.pages.model_cards import boards_models
from dashboard.pages.stats import (
    current_namespace,
    explain_error,
    explained,
    recent_runs,
    run_counts,
    runs_label,
    visible_runs,
)
from dashboard.security import ratelimit
from inference.contract.messages import CANCELLED
from inference.serving.breakdown import FIELD_GROUPS, time_sums

from ..forms import MAX_PROMPT_CHARS, RunFilterForm, RunForm
from ..models import Device, InferenceRun
from .auth import _who, login_required
from .broker import _broker_unavailable, _BrokerDown, _each_until_broker_fails

WAIT_HINT_SECONDS = 30  # an answer card without an answer after this long says how to start the board


def _run_page_context(request, form, **extra) -> dict:
    """What every rendering of the Run page shows besides its form."""
    return {
        "form": form,
        "max_prompt_chars": MAX_PROMPT_CHARS,
        "task_expires": settings.EDGECACHE_TASK_EXPIRES,
        "wait_hint_seconds": WAIT_HINT_SECONDS,
        "start_prefix": board_start.shown_to(request.user)[
            "prefix"
        ],  # the hints' start command (staff: with the address)
        "models": boards_models(form.fields["devices"].queryset),  # what each board runs, and what to expect of it
        "chart_data": {},
        **extra,
    }


MMLU_TITLE = re.compile(
    r"^MMLU (?P<topic>.+), (?P<shots>\d+)-shot, question (?P<question>\d+)$"
)  # RunForm.run_request's title


def _again_initial(request) -> tuple[dict, InferenceRun | None]:
    """The Run page filled in from a run of ``?again=<id>`` (one the user may see), to send it again:
    the same kind of prompt (an MMLU question stays one, and keeps its verdict), the tokens and
    sampling it asked for (not the tokens a cancelled run generated)."""
    try:
        pk = int(request.GET.get("again", ""))
    except ValueError:
        return {}, None
    run = visible_runs(request.user).filter(pk=pk).first()
    if run is None:
        return {}, None
    breakdown = run.breakdown or {}
    asked = breakdown.get("asked") or {}
    tokens = (
        asked.get("max_tokens") or breakdown.get("generated_tokens") or 8
    )  # runs stored before they kept what they asked
    initial = {"devices": [run.device.pk], "max_tokens": max(1, min(256, int(tokens)))}
    initial.update({name: asked[name] for name in ("temperature", "top_p", "seed") if asked.get(name) is not None})
    mmlu_title = MMLU_TITLE.match(run.title) if run.source == "mmlu" else None
    turns = [turn for turn in asked.get("messages") or () if turn.get("role") in ("system", "user", "assistant")]
    if mmlu_title:
        initial.update(
            source="mmlu",
            topic=mmlu_title["topic"],
            shots=int(mmlu_title["shots"]),
            question=int(mmlu_title["question"]),
        )
    elif turns and turns[-1]["role"] == "user":
        system = "\n\n".join(turn["content"] for turn in turns if turn["role"] == "system")
        history = [turn for turn in turns[:-1] if turn["role"] != "system"]
        initial.update(
            source="chat",
            system=system,
            history=json.dumps(history, ensure_ascii=False) if history else "",
            message=turns[-1]["content"],
        )
    elif run.prompt.lstrip().startswith("<prompt"):
        initial.update(source="pml", pml=run.prompt)
    else:
        initial.update(source="text", text=run.prompt)
    return initial, run


@login_required
def run_page(request):
    if request.method == "POST":
        form = RunForm(request.POST, user=request.user, current_namespace=current_namespace(request))
        accept = request.headers.get("Accept", "")
        wants_json = accept.startswith("application/json") or accept.startswith(
            run_stream.CONTENT_TYPE
        )  # refusals: JSON for the script
        # Refused submissions (empty, too long, another tenant's device) send nothing and are not
        # counted: the limit counts only the valid submissions about to be sent.
        if not form.is_valid():
            if wants_json:
                return JsonResponse({"errors": form.errors.get_json_data()}, status=400)
            return render(request, "dashboard/run.html", _run_page_context(request, form), status=400)
        verdict = ratelimit.hit("run", request.user.pk, settings.EDGECACHE_RUN_RATE)
        if not verdict.allowed:
            return _run_rate_limited(request, verdict, wants_json)
        devices, asked = list(form.cleaned_data["devices"]), form.run_request()
        routed = None
        if form.cleaned_data.get("any_board"):
            namespace = form.cleaned_data["route_namespace"]
            routed = actions.route_run(form.route_candidates(), asked, namespace)
            if routed is None:
                command = board_start.shown_to(request.user)["command"]
                message = f"No board of namespace {namespace!r} is online to take it: start one with `{command}`, or tick a device (it gets the run when it starts)."
                return (
                    JsonResponse({"errors": {"any_board": [{"message": message}]}}, status=503)
                    if wants_json
                    else _run_page_refused(request, message, 503)
                )
            if devices:  # the boards it may go to, then and if its board goes quiet (``actions.sweeper``)
                routed.record["allowed"] = sorted(device.name for device in devices)
            devices = [routed.device]
        request_ids = [str(uuid.uuid4()) for _ in devices]
        try:
            tickets = _admit(devices, request_ids, routed)
        except admission.FleetBusy as busy:
            return _fleet_busy(request, busy, wants_json)
        if accept.startswith(run_stream.CONTENT_TYPE):
            # The page's script: the runs' stages and tokens follow in this response, as they come.
            response = StreamingHttpResponse(
                run_stream.follow(request.user, devices, asked, routed, request_ids),
                content_type=run_stream.CONTENT_TYPE,
            )
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"
            return response
        try:
            ids = dict(zip((device.pk for device in devices), request_ids))
            sent = _each_until_broker_fails(
                devices,
                lambda device: actions.dispatch_run(request.user, [device], asked, [ids[device.pk]], routed=routed),
            )
        except _BrokerDown as down:
            for ticket in tickets:
                admission.release(ticket)
            return _broker_unavailable(
                request, down, wants_json, lambda message: _run_page_refused(request, message, 503)
            )
        if wants_json:
            return JsonResponse({"dispatched": sent})
        messages.success(
            request, f"Sent to {', '.join(item['device'] for item in sent)}; answers appear below as they arrive."
        )
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
        return JsonResponse(
            {
                "errors": {
                    "__all__": [
                        {
                            "message": f"Not cancelled: the cache box does not answer ({exc}).",
                            "code": "cachebox_unavailable",
                        }
                    ]
                }
            },
            status=503,
        )
    return JsonResponse({"cancelled": cancelled})


# -- the Runs page, one run, exports ----------------------------------------------------------------
RUNS_PER_PAGE = 50
EXPORT_LIMIT = 10_000  # rows one export holds at most (newest first)
EXPORT_FIELDS = [
    "id",
    "created",
    "device",
    "namespace",
    "source",
    "title",
    "case",
    "decision",
    "cachebox",
    "prompt_tokens",
    "matched_tokens",
    "context_tokens",
    "local_tokens",
    "flash_tokens",
    "fetched_tokens",
    "generated_tokens",
    "ttft_ms",
    "ttlt_ms",
    "state_bytes",
    "kernel_class",
    "approximate",
    "approximate_from",
    "error",
    "prompt",
    "answer",
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
        {
            "filter_form": form,
            "page": page,
            "runs": explained(list(page.object_list)),
            "query": query.urlencode(),
            "total": paginator.count,
            "total_label": runs_label(run_counts(runs)),  # failed and cancelled ones said, as every page counts them
        },
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
        "context_tokens": run.context_tokens,
        "local_tokens": run.local_tokens,
        "flash_tokens": run.flash_tokens,
        "fetched_tokens": run.fetched_tokens,
        "generated_tokens": breakdown.get("generated_tokens", 0),
        "ttft_ms": run.ttft_ms,
        "ttlt_ms": run.ttlt_ms,
        "state_bytes": run.state_bytes,
        "kernel_class": breakdown.get("kernel_class", ""),
        "approximate": breakdown.get("approximate", ""),  # "cross-class": a state another kernel class computed
        "approximate_from": breakdown.get("approximate_from", ""),
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
    form, runs = _filtered_runs(request)
    # A filter the user may not use (another tenant's namespace, a bad date) is not applied, as on
    # the page; the export says so: in its JSON and in a header, never silently.
    dropped = {name: [str(error) for error in errors] for name, errors in form.errors.items()} if form.is_bound else {}
    rows = runs[:EXPORT_LIMIT]
    stamp = timezone.now().strftime("%Y%m%d-%H%M%S")
    if fmt == "json":
        data = [_export_row(run) for run in rows.iterator()]
        body = {"count": len(data), "limit": EXPORT_LIMIT, "runs": data}
        if dropped:
            body["filters_not_applied"] = dropped
        response = JsonResponse(body, json_dumps_params={"ensure_ascii": False})
    else:
        writer = csv.writer(_Echo())

        def lines():
            yield writer.writerow(EXPORT_FIELDS)
            for run in rows.iterator():
                row = _export_row(run)
                yield writer.writerow([_csv_cell(row[field]) for field in EXPORT_FIELDS])

        response = StreamingHttpResponse(lines(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = (
        f'attachment; filename="edgecache-runs-{stamp}{"-unfiltered" if dropped else ""}.{fmt}"'
    )
    if dropped:
        response["X-EdgeCache-Filters-Not-Applied"] = "; ".join(
            f"{name}: {' '.join(errors)}" for name, errors in dropped.items()
        )[:1000]
    return response


def _breakdown_groups(breakdown: dict) -> list[tuple[str, list[tuple[str, object]]]]:
    """Every field of a run's breakdown under its heading (``FIELD_GROUPS``), in their order; a
    field no heading names (a newer board's) under "Other fields"."""
    groups = []
    for heading, names in FIELD_GROUPS:
        rows = [(name, breakdown[name]) for name in names if name in breakdown]
        if rows:
            groups.append((heading, rows))
    known = {name for _, names in FIELD_GROUPS for name in names} | {
        "entries",
        "asked",
    }  # those two: their own sections
    rest = sorted((name, value) for name, value in breakdown.items() if name not in known)
    if rest:
        groups.append(("Other fields", rest))
    return groups


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
            "breakdown_groups": _breakdown_groups(breakdown),
            "time_sums": time_sums(breakdown) if breakdown else None,
            "modules_hit": breakdown.get("modules_hit"),
            "entries_known": "entries" in breakdown,
            "fetched_entries": entries.get("fetched", []),
            "stored_entries": entries.get("stored", []),
            "explanation": explain_run(
                text=run.text, error=run.error, expected_answer=run.expected_answer, breakdown=breakdown
            ),
            "tbt": (breakdown.get("tbt_p50_ms"), breakdown.get("tbt_p99_ms")),
            "asked": breakdown.get("asked") or {},
            "cancelled": run.error == CANCELLED,
        },
    )


def _as_sent(form_class, data) -> dict:
    """A form's submitted values as initial values (an unchecked box was not sent: False)."""
    initial = {}
    for name, field in form_class.base_fields.items():
        if isinstance(field, BooleanField):
            initial[name] = name in data
        elif name in data:
            initial[name] = (
                data.getlist(name)
                if isinstance(field, MultipleChoiceField | ModelMultipleChoiceField)
                else data.get(name)
            )
    return initial


def _run_rate_limited(request, verdict: ratelimit.Verdict, wants_json: bool) -> HttpResponse:
    """429: nothing is dispatched; the form comes back as it was sent, with how long to wait."""
    metrics.refused("rate_limited")
    security_event(
        "run.rate_limited",
        limit_per_minute=verdict.limit,
        requests=verdict.count,
        retry_after=verdict.retry_after,
        **_who(request),
    )
    seconds = "1 second" if verdict.retry_after == 1 else f"{verdict.retry_after} seconds"
    message = f"Too many runs: at most {verdict.limit} per minute. Nothing was sent; try again in {seconds}."
    if wants_json:
        response = JsonResponse(
            {"errors": {"__all__": [{"message": message, "code": "rate_limited"}]}, "retry_after": verdict.retry_after},
            status=429,
        )
    else:
        response = _run_page_refused(request, message, 429)
    response["Retry-After"] = str(verdict.retry_after)
    return response


def _admit(devices, request_ids: list[str], routed) -> list:
    """Each run counted against its namespace's bounded queue (``dashboard.admission``); FleetBusy,
    with none counted, when one is full."""
    online: dict[str, int] = {}
    tickets = []
    hold_s = settings.EDGECACHE_TASK_EXPIRES + actions.runs.PAGE_WAIT_MARGIN_S
    retry_after = admission.retry_after_s(routed.record.get("expected_ms") if routed is not None else None)
    try:
        for device, request_id in zip(devices, request_ids):
            namespace = device.namespace_id
            if namespace not in online:
                online[namespace] = sum(
                    1
                    for other in Device.objects.filter(namespace_id=namespace, revoked_at__isnull=True).select_related(
                        "namespace"
                    )
                    if other.online
                )
            tickets.append(
                admission.admit(
                    namespace, request_id, online_boards=online[namespace], hold_s=hold_s, retry_after=retry_after
                )
            )
    except admission.FleetBusy:
        for ticket in tickets:
            admission.release(ticket)
        raise
    return tickets


def _fleet_busy(request, busy: admission.FleetBusy, wants_json: bool) -> HttpResponse:
    """503: the namespace's bounded queue is full, or cannot be counted (the cache box does not
    answer); nothing is sent, the form comes back as it was."""
    code = "cachebox_unavailable" if busy.scope == "cachebox" else "fleet_busy"
    metrics.refused(code)
    security_event(
        f"run.{code}", namespace=busy.namespace, limit=busy.limit, retry_after=busy.retry_after, **_who(request)
    )
    if wants_json:
        response = JsonResponse(
            {"errors": {"__all__": [{"message": str(busy), "code": code}]}, "retry_after": busy.retry_after}, status=503
        )
    else:
        response = _run_page_refused(request, str(busy), 503)
    response["Retry-After"] = str(busy.retry_after)
    return response


def _run_page_refused(request, message: str, status: int) -> HttpResponse:
    """The Run page again, with why the submission was refused and the form as it was sent."""
    # Unbound, with what was sent as initial values: shown again without re-validating it.
    form = RunForm(initial=_as_sent(RunForm, request.POST), user=request.user)
    return render(request, "dashboard/run.html", _run_page_context(request, form, refusal=message), status=status)

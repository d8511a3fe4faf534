"""Devices: the list, one device with its break-even chart, registration, token rotation, revocation."""

from __future__ import annotations

from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache

from cachebox.link import LinkProfile
from dashboard import actions
from dashboard.pages import board_start, charts
from dashboard.pages.stats import (
    STATUSES,
    device_summaries,
    device_summary,
    explained,
    filter_devices,
    fleet_counts,
    recent_runs,
    visible_devices,
)

from ..forms import ConfirmForm, DeviceForm
from ..models import Device
from .auth import login_required, staff_member_required

DEVICES_PER_PAGE = 50


@login_required
def device_list(request):
    """The devices, a page at a time: found by name, status or namespace, with the fleet's counts."""
    from django.core.paginator import Paginator

    visible = visible_devices(request.user)
    found = {
        "q": request.GET.get("q", "").strip()[:40],
        "status": request.GET.get("status", ""),
        "namespace": request.GET.get("namespace", "").strip()[:40],
    }
    devices = filter_devices(visible, name=found["q"], status=found["status"], namespace=found["namespace"])
    page = Paginator(devices, DEVICES_PER_PAGE).get_page(request.GET.get("page"))
    counts = fleet_counts(visible)
    query = urlencode({key: value for key, value in found.items() if value})
    return render(
        request,
        "dashboard/devices.html",
        {
            "summaries": device_summaries(page.object_list),
            "page": page,
            "found": found,
            "filtered": any(found.values()),
            "query": query,
            "counts": counts,
            "statuses": STATUSES,
            "namespaces": [row["namespace"] for row in counts["namespaces"]],
        },
    )


@staff_member_required
@never_cache
def device_register(request):
    form = DeviceForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = {
            field: form.cleaned_data[field]
            for field in ("name", "namespace", "kind", "cpu_threads", "memory_mb", "link_bandwidth_mbps", "link_rtt_ms")
        }
        device, token = actions.register_device(request.user, **data)
        return _show_token_once(request, device, token, created=True)
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
        request,
        "dashboard/confirm.html",
        {"form": form, "question": question, "consequence": consequence, "cancel_url": device.get_absolute_url()},
    )


@staff_member_required
@never_cache
def device_rotate(request, name):
    device = get_object_or_404(Device, name=name)
    page = _confirmation(
        request,
        device,
        f"Rotate the token of {device.name}?",
        "Its board is refused until restarted with the new token.",
    )
    if page:
        return page
    token = actions.rotate_token(request.user, device)
    return _show_token_once(request, device, token, created=False)


TOKEN_SESSION_KEY = "edgecache_token_once"


def _show_token_once(request, device: Device, token: str, *, created: bool):
    """POST, then redirect, then GET (a reload neither posts again nor makes another token): the
    token waits in the session (server-side) for that one GET, which takes it out."""
    request.session[TOKEN_SESSION_KEY] = {"device": device.name, "token": token, "created": created}
    return redirect("device-token", name=device.name)


@staff_member_required
@never_cache
def device_token(request, name):
    device = get_object_or_404(Device, name=name)
    shown = request.session.pop(TOKEN_SESSION_KEY, None)
    if not shown or shown.get("device") != device.name:
        messages.info(
            request,
            f"The token of {device.name} was shown once and is not kept (only its hash is): rotate it to get a new one.",
        )
        return redirect(device)
    context = {
        "device": device,
        "token": shown["token"],
        "created": shown["created"],
        "start": board_start.shown_to(request.user, device.name, shown["token"]),
        "embedded": settings.REDIS_URL_IS_EMBEDDED,
    }
    return render(request, "dashboard/device_token.html", context)  # never cached


@staff_member_required
def device_trust(request, name):
    """Lift an audit's quarantine of a board's entries (after finding why they differed)."""
    device = get_object_or_404(Device, name=name)
    page = _confirmation(
        request,
        device,
        f"Trust the entries of {device.name} again?",
        "Boards accept the cache entries it makes from their next heartbeat on.",
    )
    if page:
        return page
    actions.clear_quarantine(request.user, device)
    messages.success(request, f"The entries of {device.name} are trusted again.")
    return redirect(device)


@staff_member_required
def device_revoke(request, name):
    device = get_object_or_404(Device, name=name)
    page = _confirmation(
        request,
        device,
        f"Revoke {device.name}?",
        "Its board is refused from its next task on; rotate the token to let it back.",
    )
    if page:
        return page
    actions.revoke_device(request.user, device)
    messages.success(request, f"{device.name} is revoked: its board is refused from its next task on.")
    return redirect(device)

"""Devices: the list, one device with its break-even chart, registration, token rotation, revocation."""

from __future__ import annotations

from django.contrib import messages
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache

from cachebox.link import LinkProfile

from .. import actions, charts
from ..forms import ConfirmForm, DeviceForm
from ..models import Device
from ..stats import device_summary, explained, recent_runs, visible_devices
from .auth import login_required, staff_member_required


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

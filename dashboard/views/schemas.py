"""Schemas: list, edit, one schema with its cache status per device, encode on boards, delete."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from cachebox.errors import CacheBoxError
from dashboard.models import Schema
from dashboard.pages.schema_info import describe, key_names, layout_of
from dashboard.pages.stats import current_namespace, namespace_choices, visible_devices, visible_schemas
from inference.serving.pml import PMLError

from .. import actions
from ..forms import ConfirmForm, EncodeForm, SchemaForm
from ..models import Device, Namespace
from .auth import login_required, staff_member_required
from .broker import _broker_unavailable, _BrokerDown, _each_until_broker_fails


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


def _cache_status(schema: Schema, layout, viewer, namespace: str) -> tuple[list[Device], dict[str, dict[str, bool]]]:
    """For each board of ``namespace`` that ``viewer`` may see and that reported its model: which
    pieces the cache box holds for it (in its cache namespace: ``namespace``, or its own where its
    tenant shares nothing)."""
    boards = visible_devices(viewer).filter(namespace_id=namespace).order_by("name")
    devices = [device for device in boards if (device.status or {}).get("fingerprint")]
    status: dict[str, dict[str, bool]] = {}
    try:
        store = actions.cachebox()
        for device in devices:
            names = key_names(layout, device.status["fingerprint"], device.cache_namespace)
            status[device.name] = dict(zip(names, store.exists(list(names.values()))))
    except (
        CacheBoxError
    ):  # the cache box is down or refused (or a namespace is unusable): no status, the page still works
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
    # The namespace whose boards' cache status is shown: a namespace's schema, its own; a shared
    # one, the namespace the viewer picks (?namespace=), else their current one.
    choices = [schema.namespace] if schema.namespace else namespace_choices(request.user)
    namespace = schema.namespace or current_namespace(request, request.GET.get("namespace", ""))
    devices, status = _cache_status(schema, layout, request.user, namespace)
    for row in rows:
        row["cached"] = [status.get(device.name, {}).get(row["piece"], False) for device in devices]
    return render(
        request,
        "dashboard/schema_detail.html",
        {
            "schema": schema,
            "rows": rows,
            "devices": devices,
            "positions": layout.positions,
            "encode_form": EncodeForm(user=request.user, schema=schema),
            "has_status": bool(status),
            "namespace": namespace,
            "namespace_choices": choices,
            "private": Namespace.objects.filter(name=namespace, share_across_devices=False).exists(),
        },
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
        sent = _each_until_broker_fails(
            list(form.cleaned_data["devices"]),
            lambda device: actions.dispatch_encode(request.user, schema, [device], namespace),
        )
    except _BrokerDown as down:

        def page(message: str) -> HttpResponse:
            return render(
                request,
                "dashboard/broker_unavailable.html",
                {"message": message, "back_url": schema.get_absolute_url()},
                status=503,
            )

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
        {
            "form": form,
            "question": f"Delete schema {schema.name}?",
            "consequence": "Every cache entry of its modules is deleted too, for every model and namespace.",
            "cancel_url": schema.get_absolute_url(),
        },
    )

"""Verbs on prompt schemas: encode on boards (with live progress), delete with their entries."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import transaction

from dashboard.live.broadcast import broadcast
from dashboard.models import CacheEntry, Schema
from dashboard.outbox import send_to_board
from dashboard.store import mirror
from inference.contract.messages import EncodeProgress, EncodeReport, EncodeRequest, Task

from ..models import Device, Dispatch
from .audit import AuditAction, audit
from .cache import acceptable_entries, cachebox
from .devices import receive_board_message
from .runs import answers_dispatch


def save_schema(user, form) -> Schema:
    """Save a schema from its (valid) form."""
    with transaction.atomic():
        schema = form.save()
        audit(user, AuditAction.SCHEMA_SAVE, schema.name)
    return schema


def dispatch_encode(user, schema: Schema, devices: list[Device], namespace: str = "") -> list[dict]:
    """Ask boards to encode a schema's modules into the cache box; progress comes back live."""
    sent = []
    for device in devices:
        request = EncodeRequest(
            request_id=str(uuid.uuid4()),
            schema_id=schema.pk,
            schema=schema.source,
            namespace=namespace or device.namespace_id,
        )
        Dispatch.objects.create(
            request_id=request.request_id, kind="encode", device=device, namespace=request.namespace
        )
        send_to_board(device, Task.ENCODE_SCHEMA, request.dump(), settings.EDGECACHE_TASK_EXPIRES)
        sent.append({"request_id": request.request_id, "device": device.name})
    audit(user, AuditAction.SCHEMA_ENCODE, schema.name, ", ".join(d.name for d in devices))
    return sent


def record_encode_progress(payload: EncodeProgress | dict) -> None:
    progress, device, _ = receive_board_message(EncodeProgress, payload)
    if device is None or not answers_dispatch(device, progress.request_id, "encode"):
        return
    fields = progress.dump()
    broadcast(
        "encode.progress",
        {
            "device": progress.device,
            **{key: fields[key] for key in ("request_id", "schema_id", "done", "total", "piece")},
        },
    )


def record_encoded(payload: EncodeReport | dict) -> None:
    """A board finished encoding: mirror the stored entries and tell the pages."""
    report, device, _ = receive_board_message(EncodeReport, payload)
    if device is None or not answers_dispatch(device, report.request_id, "encode"):
        return
    with transaction.atomic():
        mirror.record_uploads([entry.dump() for entry in acceptable_entries(device, report.stored)], device.name)
        done = {
            "device": device.name,
            "request_id": report.request_id,
            "schema_id": report.schema_id,
            "error": report.error,
            "stored": len(report.stored),
            "skipped": len(report.skipped),
        }
        transaction.on_commit(lambda: broadcast("encode.done", done))


def delete_schema(user, schema: Schema) -> int:
    """Delete a schema and every cache entry of its modules (any namespace, any model)."""
    store = cachebox()
    removed = store.delete(list(store.scan_schema_entries(schema.digest)))
    with transaction.atomic():
        CacheEntry.objects.filter(key__contains=f":{schema.digest}:").delete()
        audit(user, AuditAction.SCHEMA_DELETE, schema.name, f"{removed} cache entries")
        schema.delete()
    return removed

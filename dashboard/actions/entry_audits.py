"""Verbs on cache-entry audits and quarantines: lying boards caught.

Reuse is exact within a model configuration, so any entry can be checked by recomputing it cold.
A share of the hits boards report (``EDGECACHE_AUDIT_RATE``) is sent to another online board of
the same namespace and model (``Task.AUDIT_ENTRY``, signed and sealed like a run); the auditor
compares bit for bit (``inference.serving.audit``) and answers with an ``AuditReport``
(``Task.RECORD_AUDIT``). A mismatch deletes the entry, quarantines its producer (the producer table
lists it: every reader refuses and evicts what it made), counts it on the device and in
``/metrics`` (``edgecache_audit_mismatches_total``, ``edgecache_board_quarantined``)
and shows it on the device page. Revoking a board quarantines its entries the same way.
"""

from __future__ import annotations

import logging
import random
import uuid

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from cachebox.events import security_event
from cachebox.keys import parse_entry_key_name
from dashboard.live.broadcast import broadcast
from dashboard.models import CacheEntry
from dashboard.outbox import send_to_board
from inference.contract.messages import AuditReport, AuditRequest, RunReport, RunRequest, Task

from ..models import Device, Dispatch, EntryAudit
from .audit import AuditAction, audit
from .cache import delete_entries, delete_entries_of
from .devices import device_json, publish_producers, receive_board_message

log = logging.getLogger("dashboard.actions")


def sample(device: Device, report: RunReport, rate: float | None = None, draw=random.random) -> tuple | None:
    """Whether this run's hits are audited: ``(entry, namespace, request, run device)`` for one
    entry it fetched (the longest: a full hit's), drawn with probability ``rate``
    (``EDGECACHE_AUDIT_RATE``); None otherwise. Read before the run's request is emptied."""
    rate = settings.EDGECACHE_AUDIT_RATE if rate is None else rate
    if not report.fetched or report.error or rate <= 0 or draw() >= rate:
        return None
    request = Dispatch.objects.filter(request_id=report.request_id).values_list("request", flat=True).first()
    if not request:
        return None
    entry = report.fetched[-1]
    try:
        namespace, _, _ = parse_entry_key_name(entry)
    except ValueError:
        return None
    return entry, namespace, request, device.name


def choose_auditor(namespace: str, fingerprint: str, exclude: set[str]) -> Device | None:
    """An online, enrolled, unquarantined board of ``namespace``'s tenant that runs the model
    ``fingerprint``, other than ``exclude`` (the board that hit and the one that stored it)."""
    now = timezone.now()
    candidates = [
        device
        for device in Device.objects.filter(
            namespace_id=namespace,
            revoked_at__isnull=True,
            quarantined_at__isnull=True,
            namespace__share_across_devices=True,
        )
        .exclude(signing_public_key="")
        .select_related("namespace")
        if device.name not in exclude
        and device.online_at(now)
        and (device.status or {}).get("fingerprint") == fingerprint
    ]
    return random.choice(candidates) if candidates else None


def dispatch_audit(entry: str, namespace: str, request: dict, run_device: str) -> EntryAudit | None:
    """Send one entry to an auditor (None, logged, when no other board of its model is online)."""

    try:
        _, fingerprint, _ = parse_entry_key_name(entry)
        run = RunRequest.parse(request)
    except ValueError as exc:
        log.warning("audit of %s not sent: %s", entry, exc)
        return None
    stored_by = set(CacheEntry.objects.filter(key=entry).values_list("creator_device", flat=True))
    auditor = choose_auditor(namespace, fingerprint, {run_device, *stored_by})
    if auditor is None:
        log.info("audit of %s not sent: no other online board of model %s in %s", entry, fingerprint, namespace)
        return None
    message = AuditRequest(request_id=str(uuid.uuid4()), entry=entry, run=run)
    row = EntryAudit.objects.create(
        request_id=message.request_id, entry=entry, namespace=namespace, run_device=run_device, auditor=auditor
    )
    send_to_board(auditor, Task.AUDIT_ENTRY, message.dump(), settings.EDGECACHE_TASK_EXPIRES)
    return row


def record_audit(payload: dict) -> EntryAudit | None:
    """A board's verdict on an audit it was sent (refused, logged, from any other board or twice).

    A mismatch deletes the entry and quarantines its producer; a refused entry is deleted (every
    reader refuses it anyway)."""

    report, device, _ = receive_board_message(AuditReport, payload)
    if report is None:
        return None
    with transaction.atomic():
        row = (
            EntryAudit.objects.select_for_update()
            .filter(request_id=report.request_id, auditor=device, verdict="")
            .first()
        )
        if row is None or row.entry != report.entry:
            security_event(
                "board_message_refused",
                device=device.name,
                message="AuditReport",
                reason="answers no audit sent to this board",
            )
            return None
        row.verdict, row.producer, row.detail, row.finished = (
            report.verdict,
            report.producer,
            report.detail,
            timezone.now(),
        )
        row.save(update_fields=["verdict", "producer", "detail", "finished"])
    if report.verdict in ("mismatch", "refused"):
        delete_entries([row.entry])
    if report.verdict == "mismatch":
        security_event(
            "audit_mismatch", entry=row.entry, producer=report.producer, auditor=device.name, detail=report.detail
        )
        if report.producer:
            quarantine_producer(row.namespace, report.producer, f"audit {row.request_id}: {report.detail}"[:300])
    return row


def quarantine_producer(namespace: str, producer: str, reason: str) -> Device | None:
    """Mark the board ``producer`` of ``namespace`` and quarantine its entries: the producer table
    lists it (readers refuse and evict what it made) and the entries the mirror knows it stored
    are deleted now."""

    with transaction.atomic():
        device = Device.objects.select_for_update().filter(name=producer, namespace_id=namespace).first()
        if device is None:
            return None  # the control plane itself, or a board since removed
        Device.objects.filter(pk=device.pk).update(audit_mismatches=F("audit_mismatches") + 1)
        if device.quarantined_at is None:
            Device.objects.filter(pk=device.pk).update(quarantined_at=timezone.now(), quarantine_reason=reason)
        audit(None, AuditAction.DEVICE_QUARANTINE, device.name, reason)
    device.refresh_from_db()
    publish_producers(namespace)
    delete_entries_of(device.name)
    transaction.on_commit(lambda: broadcast("device", device_json(device)))
    return device


def clear_quarantine(user, device: Device) -> None:
    """A staff member trusts the board's entries again (after finding why they differed)."""

    with transaction.atomic():
        Device.objects.filter(pk=device.pk).update(quarantined_at=None, quarantine_reason="")
        audit(user, AuditAction.DEVICE_QUARANTINE_CLEAR, device.name)
    device.refresh_from_db()
    publish_producers(device.namespace_id)
    transaction.on_commit(lambda: broadcast("device", device_json(device)))

"""Verbs that end what nobody will answer, and tell open pages when a board goes quiet.

A run is dispatched to one board's queue. It ends when that board's report arrives; otherwise
``sweep`` ends it:

- **its board died with it, or never took it before it expired**: when its client (the API, the
  Run page) still waits and it was not re-sent before, it goes once to another online board of its
  namespace, under the same request id (the client, told by a control-plane-signed ``resent``
  event, follows it there; the first board is told to drop it by a signed cancel flag);
- otherwise it is **lost**: a failed run says why and what to do, and a waiting client gets the
  same words as an error event at once.

Several control workers may sweep at once: each change of a dispatch is one conditional update,
which one of them wins.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cachebox.errors import CacheBoxError
from cachebox.keys import cancel_key_name, stream_channel
from inference.envelope import CONTROL, Kind, seal
from inference.messages import RunMeta, RunRequest, StreamEvent, Task

from ..live import broadcast
from ..models import Device, Dispatch, InferenceRun, offline_after
from ..signing import cancel_flag, control_plane_signer, device_ring

log = logging.getLogger("dashboard.actions")

LOST = "lost: {why}. Nothing was answered; send it again"
EXPIRY_GRACE = timedelta(seconds=60)  # a board that meets an expired run (back after an outage) reports it itself first
BATCH = 500


def sweep(now=None) -> dict:
    """One pass over the runs under way; returns how many were found answered, re-sent and lost."""
    now = now or timezone.now()
    counts = {"answered": 0, "resent": 0, "lost": 0}
    pending = list(Dispatch.objects.filter(kind="run", outcome="").select_related("device", "device__namespace").order_by("created")[:BATCH])
    if not pending:
        return counts
    answered = {str(rid) for rid in InferenceRun.objects.filter(request_id__in=[d.request_id for d in pending]).values_list("request_id", flat=True)}
    for dispatch in pending:
        if str(dispatch.request_id) in answered:
            counts["answered"] += Dispatch.objects.filter(pk=dispatch.pk, outcome="").update(outcome="answered", request={})
            continue
        why = why_lost(dispatch, now)
        if not why:
            continue
        if dispatch.attempt == 1 and dispatch.waits_until is not None and now < dispatch.waits_until and dispatch.request:
            other = _another_board(dispatch, now)
            if other is not None and resend(dispatch, other, why):
                counts["resent"] += 1
                continue
        counts["lost"] += bool(lose(dispatch, why))
    return counts


def why_lost(dispatch: Dispatch, now) -> str:
    """Why nobody will answer ``dispatch`` ("" while someone still may)."""
    device = dispatch.device
    if dispatch.expires_at is not None and now > dispatch.expires_at + EXPIRY_GRACE:
        where = f"board {device.name}" if device is not None else f"no board of namespace {dispatch.namespace}"
        return f"{where} did not start it before it expired ({dispatch.expires_at:%Y-%m-%d %H:%M:%S} UTC)"
    if device is not None and device.last_seen is not None and not _online(device, now):
        window = offline_after(device.status)
        if device.last_seen >= dispatch.created - window:  # it was alive when the run went to it, and went quiet since
            return f"board {device.name} stopped answering (its last heartbeat came at {device.last_seen:%H:%M:%S} UTC) while the run waited on it"
    return ""


def _online(device: Device, now) -> bool:
    return device.online_at(now)


def _another_board(dispatch: Dispatch, now) -> Device | None:
    """An online board of the dispatch's namespace, other than its own, serving the same model."""
    device = dispatch.device
    fingerprint = (device.status or {}).get("fingerprint") if device is not None else None
    candidates = Device.objects.filter(namespace_id=device.namespace_id if device else dispatch.namespace, revoked_at__isnull=True).exclude(pk=getattr(device, "pk", None)).select_related("namespace")
    online = [other for other in candidates if _online(other, now) and other.signing_public_key and (not fingerprint or (other.status or {}).get("fingerprint") == fingerprint)]
    return min(online, key=lambda other: other.last_seen, default=None) if online else None


def _publish(device: Device, request_id: str, event: StreamEvent) -> None:
    """A control-plane event on the run's channel of ``device`` (best effort: the record is the truth)."""
    from .cache import cachebox

    sealed = seal(event.compact(), kind=Kind.STREAM, sender=CONTROL, to=request_id, signer=control_plane_signer(), ring=device_ring(device))
    try:
        cachebox().publish(stream_channel(device.name, request_id), json.dumps(sealed, separators=(",", ":")).encode())
    except CacheBoxError as exc:
        log.warning("run %s: its client was not told (%s)", request_id, exc)


def _cancel_on(device: Device, request_id: str) -> None:
    """Tell ``device``'s board to drop the run if it ever takes it (it came back, say)."""
    from .cache import cachebox

    try:
        cachebox().set_flag(cancel_key_name(device.name, request_id), settings.EDGECACHE_TASK_EXPIRES + 60, cancel_flag(device.name, request_id))
    except CacheBoxError as exc:
        log.warning("run %s: its first board was not told to drop it (%s)", request_id, exc)


def resend(dispatch: Dispatch, other: Device, why: str) -> bool:
    """Send the run once more, to ``other``; False when another sweeper did, or the broker failed."""
    from kombu.exceptions import OperationalError

    from .runs import send_to_board

    request_id = str(dispatch.request_id)
    first = dispatch.device
    ttl = (dispatch.expires_at - dispatch.created).total_seconds() if dispatch.expires_at else settings.EDGECACHE_TASK_EXPIRES
    now = timezone.now()
    moved = Dispatch.objects.filter(pk=dispatch.pk, outcome="", attempt=1).update(attempt=2, device=other, created=now, expires_at=now + timedelta(seconds=ttl))
    if not moved:
        return False
    try:
        request = RunRequest.parse(dispatch.request)
        send_to_board(other, Task.RUN_PROMPT, request.dump(), ttl)
    except OperationalError as exc:
        log.warning("run %s was not re-sent (the broker failed: %s)", request_id, exc)
        Dispatch.objects.filter(pk=dispatch.pk).update(device=first)
        lose(Dispatch.objects.select_related("device", "device__namespace").get(pk=dispatch.pk), f"{why}; re-sending it failed ({exc})")
        return False
    log.warning("run %s re-sent from %s to %s: %s", request_id, getattr(first, "name", "?"), other.name, why)
    if first is not None:
        _cancel_on(first, request_id)
        _publish(first, request_id, StreamEvent(type="resent", request_id=request_id, device=other.name, error=why[:10_000]))
    broadcast("run.dispatched", {"request_id": request_id, "device": other.name, "title": request.meta.title, "resent_from": getattr(first, "name", "")})
    return True


def lose(dispatch: Dispatch, why: str) -> InferenceRun | None:
    """End the run as failed, with why; None when it ended otherwise meanwhile."""
    return _end_unanswered(dispatch, "lost", LOST.format(why=why))[1]


REVOKED = "revoked: {who} took it back from the queue before its board answered. Nothing was answered; send it again"


def revoke(user, dispatch: Dispatch) -> bool:
    """Take a run under way back from its queue (the Queue page's Revoke): its board drops it if it
    ever takes it (a signed cancel flag; one already decoding stops at its next token), and it ends
    as a failed run saying who revoked it. False when it ended otherwise meanwhile."""
    from .audit import AuditAction, audit

    ended, _ = _end_unanswered(dispatch, "revoked", REVOKED.format(who=getattr(user, "username", "") or "someone"))
    if ended:
        audit(user, AuditAction.RUN_REVOKE, str(dispatch.request_id), f"on {dispatch.device.name if dispatch.device else 'namespace ' + dispatch.namespace}")
    return ended


def _end_unanswered(dispatch: Dispatch, outcome: str, error: str) -> tuple[bool, InferenceRun | None]:
    """End a dispatch nobody answered as ``outcome`` (lost, revoked): a failed run with ``error``
    (broadcast, so every page that lists runs shows it), its board told to drop it, its waiting
    client told at once. (False, None) when it ended otherwise meanwhile (one conditional update
    decides); the run is None for a dispatch to no board in particular."""
    from .runs import run_json

    if not Dispatch.objects.filter(pk=dispatch.pk, outcome="").update(outcome=outcome):
        return False, None
    request_id = str(dispatch.request_id)
    meta = RunMeta.parse(dispatch.request.get("meta", {})) if isinstance(dispatch.request, dict) and dispatch.request.get("meta") else RunMeta()
    prompt = RunRequest.parse(dispatch.request).prompt_text if dispatch.request else ""
    run = None
    if dispatch.device is not None:
        with transaction.atomic():
            run, created = InferenceRun.objects.get_or_create(
                request_id=request_id,
                defaults={"device": dispatch.device, "source": meta.source, "title": meta.title, "expected_answer": meta.expected_answer, "prompt": prompt, "error": error},
            )
            if created:
                transaction.on_commit(lambda: broadcast("run", run_json(run)))
        _cancel_on(dispatch.device, request_id)
        _publish(dispatch.device, request_id, StreamEvent(type="error", request_id=request_id, device=dispatch.device.name, error=error[:10_000]))
    Dispatch.objects.filter(pk=dispatch.pk).update(request={})
    log.warning("run %s %s", request_id, error)
    return True, run


# -- liveness: boards that stop beating go offline on every open page --------------------------------
def announce_liveness(now=None) -> list[str]:
    """Mark offline every board the open pages last saw online that has since missed
    ``EDGECACHE_MISSED_HEARTBEATS`` of its heartbeats, and tell them (a ``device`` event, as a
    heartbeat sends when it comes online). Returns the names marked. Each board is marked by one
    conditional update, so of several sweepers one tells the pages, once."""
    from .devices import device_json

    now = now or timezone.now()
    marked = []
    for device in Device.objects.filter(announced_online=True).select_related("namespace"):
        if _online(device, now):
            continue
        if Device.objects.filter(pk=device.pk, announced_online=True, last_seen=device.last_seen).update(announced_online=False):
            device.announced_online = False
            broadcast("device", device_json(device, now))
            marked.append(device.name)
            log.warning("board %s went offline: no heartbeat since %s", device.name, device.last_seen)
    return marked

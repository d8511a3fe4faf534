"""Verbs that end what nobody will answer, and tell open pages when a board goes quiet.

A run is dispatched to one board's queue. It ends when that board's report arrives; otherwise
``sweep`` ends it. A board is quiet when neither its heartbeats nor the runs it streams were heard
within its heartbeats' window: one that streams or decodes is alive, whatever its heartbeat
thread's delay under load (the runs' followers note what they hear: ``actions.runs.heard``).

- **Its board went quiet with it, or never took it before it expired.** When its client (the API,
  the Run page) still waits and the request let the router choose its board (sent to "any board"),
  it moves once to another online board the request allows, under the same request id: the
  sweeper tells the client's follower (a control-plane-signed ``resent`` event), which listens to
  the new board's channel and then sends it there, going on from the answer it already has
  (``actions.runs.continue_run``; the first board is told to drop it by a signed cancel flag). A
  run sent to a named board is never moved: while its client waits, it waits for its board (the
  client is told, a ``waiting`` stage); then it is lost.
- **Lost**: a failed run says why and what to do, keeps the answer its client had, and a waiting
  client gets the same words as an error event at once. Its board is not told to drop it: a late
  answer replaces the lost run (``actions.runs.record_run``), nobody else having answered.

Several control workers may sweep at once: each change of a dispatch is one conditional update,
which one of them wins.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from cachebox.errors import CacheBoxError
from cachebox.keys import heard_key_name
from dashboard.live.broadcast import broadcast
from inference.contract.messages import StreamEvent

from ..models import Device, Dispatch, InferenceRun, offline_after
from .cache import cachebox
from .devices import device_json
from .runs import cancel_on, continue_run, lose, publish_event

log = logging.getLogger("dashboard.actions")

EXPIRY_GRACE = timedelta(seconds=60)  # a board that meets an expired run (back after an outage) reports it itself first
HANDOVER = timedelta(seconds=10)  # a moved run's follower sends it within this, or the sweeper does (nobody follows it)
BATCH = 500


def sweep(now=None) -> dict:
    """One pass over the runs under way; returns how many were found answered, re-sent, lost and
    left waiting for their quiet board."""
    now = now or timezone.now()
    counts = {"answered": 0, "resent": 0, "lost": 0, "waiting": 0}
    pending = list(
        Dispatch.objects.filter(kind="run", outcome="")
        .select_related("device", "device__namespace")
        .order_by("created")[:BATCH]
    )
    if not pending:
        return counts
    answered = {
        str(rid)
        for rid in InferenceRun.objects.filter(request_id__in=[d.request_id for d in pending]).values_list(
            "request_id", flat=True
        )
    }
    heard = Heard(pending)
    for dispatch in pending:
        if str(dispatch.request_id) in answered:
            counts["answered"] += Dispatch.objects.filter(pk=dispatch.pk, outcome="").update(
                outcome="answered", request={}
            )
            continue
        if dispatch.moving:  # moved: its follower sends it; nobody did in time, so nobody follows it
            if now - dispatch.created > HANDOVER:
                counts["resent"] += continue_run(str(dispatch.request_id), dispatch.device.name, [], "")
            continue
        why = why_lost(dispatch, now, heard)
        if not why:
            continue
        waits = dispatch.waits_until is not None and now < dispatch.waits_until and bool(dispatch.request)
        if waits and dispatch.attempt == 1 and movable(dispatch):
            other = _another_board(dispatch, now)
            if other is not None and resend(dispatch, other, why):
                counts["resent"] += 1
                continue
        if waits and dispatch.device is not None and not _expired(dispatch, now):
            counts["waiting"] += 1  # sent to this board (or none other may take it): it waits while its client does
            _tell_waiting(dispatch, why)
            continue
        counts["lost"] += bool(lose(dispatch, why))
    return counts


class Heard:
    """When the runs' followers last heard each board, and each run, on a stream (epoch seconds; 0:
    never), read for one sweep in one round trip (``actions.runs.heard`` writes them)."""

    def __init__(self, dispatches: list[Dispatch]):
        names = []
        for dispatch in dispatches:
            if dispatch.device is not None:
                names += [
                    heard_key_name(dispatch.device.name),
                    heard_key_name(dispatch.device.name, str(dispatch.request_id)),
                ]
        self.at: dict[str, float] = {}
        if not names:
            return
        try:
            values = cachebox().read_flags(names)
        except CacheBoxError as exc:  # the heartbeats alone decide this sweep
            log.warning("sweep: what the followers heard was not read (%s)", exc)
            return
        for name, value in zip(names, values):
            try:
                self.at[name] = float(value) if value is not None else 0.0
            except ValueError:
                self.at[name] = 0.0

    def board(self, device: Device) -> float:
        return self.at.get(heard_key_name(device.name), 0.0)

    def run(self, dispatch: Dispatch) -> float:
        return (
            self.at.get(heard_key_name(dispatch.device.name, str(dispatch.request_id)), 0.0)
            if dispatch.device is not None
            else 0.0
        )


def movable(dispatch: Dispatch) -> bool:
    """Whether the request let the router choose its board (sent to "any board"): only such a run
    may move to another board. One sent to a named board never does."""
    return (dispatch.routing or {}).get("policy", "named") != "named"


def _expired(dispatch: Dispatch, now) -> bool:
    return dispatch.expires_at is not None and now > dispatch.expires_at


def why_lost(dispatch: Dispatch, now, heard: Heard | None = None) -> str:
    """Why nobody will answer ``dispatch`` ("" while someone still may). A run whose client
    follows it is known to have started once its board was heard on its stream; one that did not
    is given up on at its expiry (its board cannot take it later), not a minute after."""
    device = dispatch.device
    started = heard is not None and heard.run(dispatch) > 0
    grace = timedelta(0) if dispatch.waits_until is not None else EXPIRY_GRACE
    if not started and dispatch.expires_at is not None and now > dispatch.expires_at + grace:
        where = f"board {device.name}" if device is not None else f"no board of namespace {dispatch.namespace}"
        return f"{where} did not start it before it expired ({dispatch.expires_at:%Y-%m-%d %H:%M:%S} UTC)"
    if device is not None and device.last_seen is not None and not _online(device, now):
        window = offline_after(device.status)
        last_heard = heard.board(device) if heard is not None else 0.0
        if last_heard and now.timestamp() - last_heard < window.total_seconds():
            return ""  # streaming or decoding: alive, whatever its heartbeats say
        if device.last_seen >= dispatch.created - window:  # it was alive when the run went to it, and went quiet since
            last = max(device.last_seen.timestamp(), last_heard)
            said = f"its last heartbeat came at {device.last_seen:%H:%M:%S} UTC" + (
                f", its last word on a run at {time.strftime('%H:%M:%S', time.gmtime(last_heard))} UTC"
                if last_heard
                else ""
            )
            return f"board {device.name} stopped answering ({said}; quiet for {now.timestamp() - last:.0f} s) while the run waited on it"
    return ""


def _online(device: Device, now) -> bool:
    return device.online_at(now)


def _another_board(dispatch: Dispatch, now) -> Device | None:
    """An online board of the dispatch's namespace, other than its own, serving the same model."""
    device = dispatch.device
    fingerprint = (device.status or {}).get("fingerprint") if device is not None else None
    candidates = (
        Device.objects.filter(
            namespace_id=device.namespace_id if device else dispatch.namespace, revoked_at__isnull=True
        )
        .exclude(pk=getattr(device, "pk", None))
        .select_related("namespace")
    )
    allowed = (dispatch.routing or {}).get(
        "allowed"
    )  # the boards the request named to choose among (none: any of its namespace)
    online = [
        other
        for other in candidates
        if _online(other, now)
        and other.signing_public_key
        and (not fingerprint or (other.status or {}).get("fingerprint") == fingerprint)
        and (not allowed or other.name in allowed)
    ]
    return min(online, key=lambda other: other.last_seen, default=None) if online else None


def resend(dispatch: Dispatch, other: Device, why: str) -> bool:
    """Move the run to ``other`` (once) and tell its client's follower, which listens to ``other``'s
    channel and then sends it there with what it streamed (``actions.runs.continue_run``; the
    sweeper sends it after ``HANDOVER`` when no follower did). The first board is told to drop it.
    False when another sweeper moved it first."""
    request_id = str(dispatch.request_id)
    first = dispatch.device
    ttl = (
        (dispatch.expires_at - dispatch.created).total_seconds()
        if dispatch.expires_at
        else settings.EDGECACHE_TASK_EXPIRES
    )
    now = timezone.now()
    routing = {
        **(dispatch.routing or {}),
        "moved": {"from": getattr(first, "name", ""), "to": other.name, "why": why[:500], "at": now.isoformat()},
    }
    moved = Dispatch.objects.filter(pk=dispatch.pk, outcome="", attempt=1).update(
        attempt=2,
        device=other,
        created=now,
        expires_at=now + timedelta(seconds=ttl),
        moving=True,
        routing=routing,
    )
    if not moved:
        return False
    log.warning("run %s moved from %s to %s: %s", request_id, getattr(first, "name", "?"), other.name, why)
    if first is not None:
        cancel_on(first, request_id)
        publish_event(
            first, request_id, StreamEvent(type="resent", request_id=request_id, device=other.name, error=why[:10_000])
        )
    return True


def _tell_waiting(dispatch: Dispatch, why: str) -> None:
    """Tell a waiting client that its board went quiet and the run waits for it (once a sweep; a
    page shows the newest)."""
    until = f"{dispatch.waits_until:%H:%M:%S} UTC" if dispatch.waits_until else "its expiry"
    text = f"{why}; it was sent to this board only, so it waits for it until {until}"
    publish_event(
        dispatch.device,
        str(dispatch.request_id),
        StreamEvent(
            type="stage",
            stage="waiting",
            request_id=str(dispatch.request_id),
            device=dispatch.device.name,
            error=text[:10_000],
        ),
    )


# -- liveness: boards that stop beating go offline on every open page --------------------------------
def announce_liveness(now=None) -> list[str]:
    """Mark offline every board the open pages last saw online that has since missed
    ``EDGECACHE_MISSED_HEARTBEATS`` of its heartbeats, and tell them (a ``device`` event, as a
    heartbeat sends when it comes online). Returns the names marked. Each board is marked by one
    conditional update, so of several sweepers one tells the pages, once."""

    now = now or timezone.now()
    marked = []
    for device in Device.objects.filter(announced_online=True).select_related("namespace"):
        if _online(device, now):
            continue
        if Device.objects.filter(pk=device.pk, announced_online=True, last_seen=device.last_seen).update(
            announced_online=False
        ):
            device.announced_online = False
            broadcast("device", device_json(device, now))
            marked.append(device.name)
            log.warning("board %s went offline: no heartbeat since %s", device.name, device.last_seen)
    return marked

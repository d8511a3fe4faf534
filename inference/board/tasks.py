"""Celery tasks that edge boards execute. Thin: open the envelope, validate the message, call a
plain function, report.

A request must be sealed and signed by the control plane this board pinned, for this board
(``inference.contract.envelope``); anything else (unsigned, forged, for another board, expired, replayed:
also after the board restarted, ``inference.board.replay``) is refused and logged, and answered with nothing: its request id cannot be trusted. An authentic
request that does not follow the contract (``inference.contract.messages``) is answered with an error
report, so nothing a person sent vanishes. An unexpected failure while serving is reported too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from celery import shared_task
from celery.signals import task_revoked

from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.keys import cancel_key_name, device_key_name
from cachebox.signing import UnknownKey
from inference.board import board_work_waiting, encode, identity, refused_request, replay, report, send_progress, serve
from inference.board.devices import UNREAD, DeviceRefused
from inference.board.runtime import get_board
from inference.contract.envelope import EnvelopeRefused, Kind
from inference.contract.messages import (
    AuditReport,
    AuditRequest,
    EncodeProgress,
    EncodeReport,
    EncodeRequest,
    MessageRefused,
    RunReport,
    RunRequest,
    Task,
)
from inference.serving.audit import audit_entry as audit_one

log = logging.getLogger(__name__)


def _read_before_run(request_id: str) -> tuple:
    """This board's registry record and the run's cancel flag, in one round trip (each UNREAD when
    the cache box does not answer: then each is looked for again, and reported, where it is used)."""
    me = identity()
    try:
        record, cancel = me.store.read_flags([device_key_name(me.name), cancel_key_name(me.name, request_id)])
    except CacheBoxUnavailable:
        return UNREAD, UNREAD
    return record, cancel


def _still_enrolled(request_id: str, record=UNREAD) -> bool:
    """Re-check the token before a task: a revoked or rotated token stops the board at once
    (``record``: the registry record as read already).

    A cache box that is down cannot tell; the task then runs (by local prefill) and the
    control plane, which checks every report, still refuses a revoked board.
    """
    me = identity()
    try:
        me.recheck(record)
    except DeviceRefused as exc:
        security_event("task_refused", device=me.name, request_id=request_id, reason=str(exc))
        return False
    except CacheBoxUnavailable as exc:
        log.warning("cannot re-check this board's token now: %s", exc)
    return True


class _Seen:
    """Request ids this process has taken already: a request delivered again (replayed into the
    queue, or restored while it still runs) is not served twice."""

    def __init__(self, size: int = 10_000):
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def first_time(self, request_id: str) -> bool:
        with self._lock:
            if request_id in self._ids:
                return False
            self._ids[request_id] = None
            if len(self._ids) > self._size:
                self._ids.popitem(last=False)
            return True


_seen = _Seen()
_KINDS = {Task.RUN_PROMPT: Kind.RUN, Task.ENCODE_SCHEMA: Kind.ENCODE, Task.AUDIT_ENTRY: Kind.AUDIT}


def _receive(cls, message, task: Task):
    """The request in a task's envelope, or None (refused, logged; answered when authentic)."""
    me = identity()
    try:
        body = me.open_request(message, _KINDS[task])
    except UnknownKey:
        me.recheck()  # sealed under a key generation this board has not received yet: fetch it, once
        try:
            body = me.open_request(message, _KINDS[task])
        except (EnvelopeRefused, UnknownKey):
            return None
    except EnvelopeRefused:
        return None  # logged by open_request: not from the control plane, or not for this board
    try:
        request = cls.parse(body)
    except MessageRefused as exc:
        security_event("message_refused", message=cls.__name__, receiver=me.name, reason=str(exc)[:500])
        refused_request(body, str(exc), task)
        return None
    if replay.spent(request.request_id):
        security_event(
            "request_refused",
            device=me.name,
            request_id=request.request_id,
            reason="replayed: answered already (before this board restarted)",
        )
        return None
    if not _seen.first_time(request.request_id):
        security_event(
            "request_refused",
            device=me.name,
            request_id=request.request_id,
            reason="delivered again: served once already",
        )
        return None
    return request


def _expiry(message) -> float | None:
    """When the request's envelope (signed, so as the control plane set it) expires."""
    expires = message.get("exp") if isinstance(message, dict) else None
    return float(expires) if isinstance(expires, (int, float)) else None


class _Work:
    """When this board's last task ended (wall clock): a run that arrived at the control plane
    before that (its ``meta.received_at``, else when its request was sealed) waited behind it."""

    ended = 0.0

    @classmethod
    def behind_ms(cls, message: dict, received_at: float = 0.0) -> float:
        arrived = received_at or (message.get("ts") if isinstance(message, dict) else None)
        if not isinstance(arrived, (int, float)) or cls.ended <= arrived:
            return 0.0
        return round((cls.ended - arrived) * 1000.0, 3)


def answer_run(message: dict) -> None:
    """A run request: served and reported (the body of the ``run_prompt`` task)."""
    try:
        request = _receive(RunRequest, message, Task.RUN_PROMPT)
        if request is None:
            return
        record, cancel = _read_before_run(request.request_id)
        if not _still_enrolled(request.request_id, record):
            return
        try:
            result = serve(
                get_board(),
                request,
                work_waiting=board_work_waiting,
                behind_ms=_Work.behind_ms(message, request.meta.received_at),
                cancel_flag=cancel,
            )
        except Exception as exc:  # a bug or a broken engine: the run is reported, not lost
            log.exception("run %s failed", request.request_id)
            result = RunReport.for_request(
                request, device=identity().name, error=f"the board failed: {type(exc).__name__}: {exc}"
            )
        report(result)
        replay.record(request.request_id, _expiry(message))  # answered: a replay of it is refused, also after a restart
    finally:
        _Work.ended = time.time()


def answer_encode(message: dict) -> None:
    """A schema encode request: encoded and reported (the body of the ``encode_schema`` task)."""
    try:
        _encode_schema(message)
    finally:
        _Work.ended = time.time()


def _encode_schema(message: dict) -> None:
    request = _receive(EncodeRequest, message, Task.ENCODE_SCHEMA)
    if request is None or not _still_enrolled(request.request_id):
        return
    me = identity()

    def progress(done: int, total: int, piece: str) -> None:
        send_progress(
            EncodeProgress(
                device=me.name,
                request_id=request.request_id,
                schema_id=request.schema_id,
                done=done,
                total=total,
                piece=piece[:200],
            )
        )

    try:
        result = encode(get_board(), request, progress)
    except Exception as exc:
        log.exception("encode %s failed", request.request_id)
        result = EncodeReport(
            device=me.name,
            request_id=request.request_id,
            schema_id=request.schema_id,
            error=f"the board failed: {type(exc).__name__}: {exc}",
        )
    report(result, Task.ENCODED)
    replay.record(request.request_id, _expiry(message))


def answer_audit(message: dict) -> None:
    """Recompute a cache hit cold and send the verdict (``inference.serving.audit``): a cold prefill of one
    prompt, taken between runs like any task."""
    try:
        request = _receive(AuditRequest, message, Task.AUDIT_ENTRY)
        if request is None or not _still_enrolled(request.request_id):
            return
        me = identity()
        try:
            verdict = audit_one(get_board(), request)
        except Exception as exc:  # a bug or a broken engine: said, not lost
            log.exception("audit %s failed", request.request_id)
            verdict = {
                "request_id": request.request_id,
                "entry": request.entry,
                "verdict": "inconclusive",
                "detail": f"the board failed: {type(exc).__name__}: {exc}"[:500],
            }
        report(AuditReport(device=me.name, **verdict), Task.RECORD_AUDIT)
    finally:
        _Work.ended = time.time()


# The tasks: thin registrations of the plain functions above, which tests call directly (a task
# proxy resolves through whichever Celery app is current in the process, which a test does not own).
run_prompt = shared_task(name=Task.RUN_PROMPT.value, acks_late=True, reject_on_worker_lost=True, ignore_result=True)(
    answer_run
)
encode_schema = shared_task(
    name=Task.ENCODE_SCHEMA.value, acks_late=True, reject_on_worker_lost=True, ignore_result=True
)(answer_encode)
audit_entry = shared_task(name=Task.AUDIT_ENTRY.value, acks_late=True, ignore_result=True)(answer_audit)


EXPIRED = "expired: no board of {device} started it before {expires} (EDGECACHE_TASK_EXPIRES after its dispatch), so it never ran; send it again"


@task_revoked.connect
def report_expired(sender=None, request=None, expired=False, **_) -> None:
    """Celery discards a task that waited past its expiry; report it, so it is recorded, not lost."""
    if not expired or request is None or not request.args or not isinstance(request.args[0], dict):
        return
    name = getattr(sender, "name", "")
    if name not in (Task.RUN_PROMPT, Task.ENCODE_SCHEMA):
        return
    me = identity()
    error = EXPIRED.format(device=me.name, expires=request.expires or "its expiry")
    try:
        message = me.open_request(request.args[0], _KINDS[Task(name)], expired_ok=True)
    except (EnvelopeRefused, UnknownKey):
        return  # not the control plane's: nothing to answer
    log.warning("request %s %s", message.get("request_id"), error)
    try:
        if name == Task.RUN_PROMPT:
            run = RunRequest.parse(message)
            report(RunReport.for_request(run, device=me.name, error=error))
        else:
            enc = EncodeRequest.parse(message)
            report(
                EncodeReport(device=me.name, request_id=enc.request_id, schema_id=enc.schema_id, error=error),
                Task.ENCODED,
            )
    except MessageRefused:
        refused_request(message, error, Task(name))

"""Celery tasks that edge boards execute. Thin: unpack, call a plain function, report."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import task_revoked

from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event

from .board import get_board
from .devices import DeviceRefused
from .edge import RECORD_RUN_TASK, encode, encode_payload, identity, report, run_payload, send_progress, serve

log = logging.getLogger(__name__)


def _still_enrolled(message: dict) -> bool:
    """Re-check the token before a task: a revoked or rotated token stops the board at once.

    A cache box that is down cannot tell; the task then runs (by local prefill) and the
    control plane, which checks the token of every report, still refuses a revoked board.
    """
    me = identity()
    try:
        me.recheck()
    except DeviceRefused as exc:
        security_event("task_refused", device=me.name, request_id=message.get("request_id"), reason=str(exc))
        return False
    except CacheBoxUnavailable as exc:
        log.warning("cannot re-check this board's token now: %s", exc)
    return True


@shared_task(name="edgecache.run_prompt", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_prompt(message: dict) -> None:
    if _still_enrolled(message):
        report(serve(get_board(), message))


ENCODED_TASK = "edgecache.encoded"


@shared_task(name="edgecache.encode_schema", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def encode_schema(message: dict) -> None:
    if not _still_enrolled(message):
        return

    def progress(done: int, total: int, piece: str) -> None:
        send_progress({"request_id": message["request_id"], "schema_id": message.get("schema_id"), "done": done, "total": total, "piece": piece})

    report(encode(get_board(), message, progress), task=ENCODED_TASK)


EXPIRED = "expired: no board of {device} started it before {expires} (EDGECACHE_TASK_EXPIRES after its dispatch), so it never ran; send it again"


@task_revoked.connect
def report_expired(sender=None, request=None, expired=False, **_) -> None:
    """Celery discards a task that waited past its expiry; report it, so it is recorded, not lost."""
    if not expired or request is None or not request.args or not isinstance(request.args[0], dict):
        return
    message = request.args[0]
    name = getattr(sender, "name", "")
    if name == run_prompt.name:
        payload, task = run_payload, RECORD_RUN_TASK
    elif name == encode_schema.name:
        payload, task = encode_payload, ENCODED_TASK
    else:
        return
    me = identity()
    error = EXPIRED.format(device=me.name, expires=request.expires or "its expiry")
    log.warning("request %s %s", message.get("request_id"), error)
    report(payload(message, error), task=task)

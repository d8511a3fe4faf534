"""Celery tasks that edge boards execute. Thin: unpack, call a plain function, report."""

from __future__ import annotations

import logging

from celery import shared_task

from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event

from .board import get_board
from .devices import DeviceRefused
from .edge import encode, identity, report, send_progress, serve

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


@shared_task(name="edgecache.encode_schema", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def encode_schema(message: dict) -> None:
    if not _still_enrolled(message):
        return

    def progress(done: int, total: int, piece: str) -> None:
        send_progress({"request_id": message["request_id"], "schema_id": message.get("schema_id"), "done": done, "total": total, "piece": piece})

    report(encode(get_board(), message, progress), task="edgecache.encoded")

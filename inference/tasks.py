"""Celery tasks that edge boards execute. Thin: unpack, call a plain function, report."""

from __future__ import annotations

import logging

from celery import shared_task

from .board import get_board
from .devices import DeviceRefused
from .edge import encode, identity, report, send_progress, serve

log = logging.getLogger(__name__)


@shared_task(name="edgecache.run_prompt", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_prompt(message: dict) -> None:
    me = identity()
    try:
        me.recheck()  # a revoked or rotated token stops the board at once
    except DeviceRefused as exc:
        log.error("refusing task %s: %s", message.get("request_id"), exc)
        return
    report(serve(get_board(), message))


@shared_task(name="edgecache.encode_schema", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def encode_schema(message: dict) -> None:
    me = identity()
    try:
        me.recheck()
    except DeviceRefused as exc:
        log.error("refusing encode %s: %s", message.get("request_id"), exc)
        return

    def progress(done: int, total: int, piece: str) -> None:
        send_progress({"request_id": message["request_id"], "schema_id": message.get("schema_id"), "done": done, "total": total, "piece": piece})

    report(encode(get_board(), message, progress), task="edgecache.encoded")

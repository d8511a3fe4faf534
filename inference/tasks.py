"""Celery tasks that edge boards execute. Thin: unpack, call a plain function, report."""

from __future__ import annotations

import logging

from celery import shared_task

from .board import get_board
from .devices import DeviceRefused
from .edge import identity, report, serve

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

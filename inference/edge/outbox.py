"""What a board sends the control plane: reports, encoding progress, heartbeats and answers to
refused requests, each signed (and sealed) by this board and published straight into the control
queue (a board declares and binds nothing on the broker).
"""

from __future__ import annotations

import logging

from celery import current_app
from pydantic import ValidationError

from ..envelope import Kind
from ..messages import BoardMessage, EncodeProgress, EncodeReport, Queue, RunReport, Task
from .enrollment import identity, sender

log = logging.getLogger("inference.edge")

_KINDS = {
    Task.RECORD_RUN: Kind.REPORT, Task.ENCODED: Kind.ENCODED, Task.ENCODE_PROGRESS: Kind.PROGRESS, Task.HEARTBEAT: Kind.HEARTBEAT,
    Task.RECORD_AUDIT: Kind.AUDITED,
}


def send_to_control(task: Task, message: BoardMessage, **options) -> None:
    """One message to the control plane's queue, signed (and sealed) by this board. Published on the
    default exchange straight into the queue: a board declares and binds nothing on the broker."""
    sealed = identity().seal(message, _KINDS[task])
    current_app.send_task(task.value, args=[sealed], queue=Queue.CONTROL.value, exchange="", routing_key=Queue.CONTROL.value, declare=[], **options)


def send_progress(progress: EncodeProgress) -> None:
    """Encoding progress to the control plane (best effort: progress may be lost, the result is not)."""
    send_to_control(Task.ENCODE_PROGRESS, progress, expires=60)


def report(message: BoardMessage, task: Task = Task.RECORD_RUN) -> None:
    """Send a signed, sealed report to the control plane's queue."""
    send_to_control(task, message)


def refused_request(raw, reason: str, task: Task) -> None:
    """A malformed request that still names its request id is answered with an error, so it is not lost."""
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    if task == Task.AUDIT_ENTRY:  # an audit nobody waits for: said in the log, its row stays under way
        log.warning("refused audit %s: %s", request_id, reason)
        return
    try:
        if task == Task.RUN_PROMPT:
            report(RunReport(**sender(), request_id=request_id, error=f"refused by the board: {reason}"))
        else:
            report(EncodeReport(**sender(), request_id=request_id, error=f"refused by the board: {reason}"), Task.ENCODED)
    except (ValidationError, TypeError):
        log.warning("dropped a malformed %s message without a usable request id: %s", task.value, reason)

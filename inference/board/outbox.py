"""What a board sends the control plane: reports, encoding progress, heartbeats and answers to
refused requests, each signed (and sealed) by this board and written where its Redis user may
write and nothing else may: its own inbox (``ec:inbox:NAME``) and its own heartbeat key
(``ec:hb:NAME``). A board names no Celery task and reaches no queue of the control plane's; the
control plane drains every board's inbox in turn (``dashboard.worker.inbox``).
"""

from __future__ import annotations

import json
import logging

from pydantic import ValidationError

from cachebox.keys import inbox_key
from inference.board.enrollment import identity, sender
from inference.board.wire import write_to_broker
from inference.contract.envelope import Kind
from inference.contract.messages import BoardMessage, EncodeProgress, EncodeReport, InboxMessage, RunReport, Task

log = logging.getLogger("inference.board")

_KINDS = {
    Task.RECORD_RUN: Kind.REPORT,
    Task.ENCODED: Kind.ENCODED,
    Task.ENCODE_PROGRESS: Kind.PROGRESS,
    Task.RECORD_AUDIT: Kind.AUDITED,
}


def send_to_control(task: Task, message: BoardMessage, *, retry: bool = True) -> None:
    """One message to the control plane, signed (and sealed) by this board, onto its own inbox."""
    me = identity()
    raw = json.dumps(InboxMessage(task=task, body=me.seal(message, _KINDS[task])).dump(), separators=(",", ":"))
    write_to_broker(
        lambda client: client.lpush(inbox_key(me.name), raw), retry=retry, what=f"{task.value} of {me.name}"
    )


def send_progress(progress: EncodeProgress) -> None:
    """Encoding progress to the control plane (best effort: progress may be lost, the result is not)."""
    try:
        send_to_control(Task.ENCODE_PROGRESS, progress, retry=False)
    except Exception as exc:  # noqa: BLE001 - best effort
        log.info("encoding progress not sent: %s", exc)


def report(message: BoardMessage, task: Task = Task.RECORD_RUN) -> None:
    """Send a signed, sealed report to the control plane."""
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
            report(
                EncodeReport(**sender(), request_id=request_id, error=f"refused by the board: {reason}"), Task.ENCODED
            )
    except (ValidationError, TypeError):
        log.warning("dropped a malformed %s message without a usable request id: %s", task.value, reason)

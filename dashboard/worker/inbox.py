"""The control inbox: every board's messages, taken off the inboxes whose keys name their senders.

A board may write one list, its own inbox ``ec:inbox:NAME`` (and one key, its latest heartbeat,
read by ``actions.devices.HeartbeatBatch``); a device that is not enrolled yet may write its
enrollment inbox ``ec:enroll:NAME`` (``cachebox.acl``). Nothing a board writes reaches the
control plane's Celery queue (``control``): each control worker runs a ``ControlInbox`` thread
(started by ``dashboard.celery``) that takes a few messages off one inbox at a time, in turn
(BLMPOP over every inbox, its start rotated), checks each (``accept``: a message of EdgeCache's
own that this kind of inbox may carry, from the device its key names), and only then hands it
to the control plane's own task for it (``dashboard.tasks``: the signature and contract are
checked there, with retries for a busy database). Anything else is refused and logged on
``edgecache.security``: a Celery message, a canvas task, an unknown task, a message naming
another sender. A board that floods its inbox delays only itself: every other board's turn
comes after at most ``TAKE`` of its messages.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from django.db import close_old_connections

from cachebox.events import security_event
from cachebox.keys import enroll_inbox_key, inbox_key
from dashboard.actions.devices import broker_server
from dashboard.models import Device, token_usable
from inference.contract.envelope import EnvelopeRefused, peek
from inference.contract.messages import (
    BOARD_INBOX_TASKS,
    ENROLL_INBOX_TASKS,
    MAX_INBOX_MESSAGE_BYTES,
    InboxMessage,
    MessageRefused,
    Queue,
    Task,
)

log = logging.getLogger("dashboard.worker.inbox")

BOARD, ENROLLING = "board", "enrolling"


@dataclass(frozen=True)
class Accepted:
    task: Task
    body: dict


def accept(kind: str, device: str, raw: bytes) -> Accepted | str:
    """What one item of ``device``'s inbox (of ``kind``: ``BOARD`` or ``ENROLLING``) may be handed
    on as, or why not (pure: no I/O). Only the envelope's sender is read here; its signature and
    the message itself are checked by the receiving verb."""
    if len(raw) > MAX_INBOX_MESSAGE_BYTES:
        return f"larger than {MAX_INBOX_MESSAGE_BYTES} bytes"
    try:
        message = InboxMessage.parse(json.loads(raw))
    except (ValueError, UnicodeDecodeError, RecursionError, MessageRefused) as exc:
        return f"not an EdgeCache inbox message: {str(exc)[:200]}"
    allowed = BOARD_INBOX_TASKS if kind == BOARD else ENROLL_INBOX_TASKS
    if message.task not in allowed:
        return f"{message.task.value} may not come from a {kind} device's inbox"
    if kind == ENROLLING:
        sender = message.body.get("device")
    else:
        try:
            sender = peek(message.body)["from"]
        except EnvelopeRefused as exc:
            return str(exc)[:200]
    if sender != device:
        return f"names {str(sender)[:64]!r} as its sender, not the owner of the inbox"
    return Accepted(message.task, message.body)


def inbox_keys(boards: list[str], enrolling: list[str]) -> dict[str, tuple[str, str]]:
    """{inbox key: (kind, device)} of the boards' inboxes and the enrolling devices' ones."""
    keys = {inbox_key(name): (BOARD, name) for name in boards}
    keys.update({enroll_inbox_key(name): (ENROLLING, name) for name in enrolling})
    return keys


class ControlInbox:
    """One control worker's drain of every inbox (several workers share them: BLMPOP hands each
    message to one of them). Thread-safe ``start``; ``drain_once`` is what the tests call."""

    ROSTER_EVERY_S = 2.0  # how soon a newly registered device's inboxes are read
    WAIT_S = 1.0  # one BLMPOP waits this long for a message
    TAKE = 16  # messages taken off one inbox per turn

    def __init__(self, send=None):
        self.send = send  # send(task name, args, queue): the control plane's Celery app's send_task
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._keys: dict[str, tuple[str, str]] = {}
        self._order: list[str] = []
        self._roster_at = 0.0
        self._turn = 0

    def start(self, send) -> None:
        """Drain the inboxes from now on, handing accepted messages to ``send`` (``app.send_task``)."""
        with self._lock:
            self.send = send
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="edgecache-inbox", daemon=True)
                self._thread.start()

    def refresh(self) -> None:
        """Read which devices have inboxes: enrolled, unrevoked boards, and devices whose token may
        still enroll one."""
        boards, enrolling = [], []
        for device in Device.objects.filter(revoked_at=None).only(
            "name", "signing_public_key", "enroll_key", "token_expires"
        ):
            if device.signing_public_key:
                boards.append(device.name)
            if token_usable(device):
                enrolling.append(device.name)
        self._keys = inbox_keys(boards, enrolling)
        self._order = sorted(self._keys)
        self._roster_at = time.monotonic()

    def drain_once(self, wait_s: float | None = None) -> int:
        """Take one turn's messages off the next non-empty inbox (waiting up to ``wait_s``) and hand
        on what may be; returns how many were handed on."""
        if time.monotonic() - self._roster_at > self.ROSTER_EVERY_S:
            self.refresh()
        if not self._order:
            time.sleep(self.WAIT_S if wait_s is None else wait_s)
            return 0
        # Round robin: each turn starts at the inbox after the one served last, so every non-empty
        # inbox is served once a round, a flooded one included, and none twice before another.
        start = self._turn % len(self._order)
        taken = broker_server().pop_from_any(
            self._order[start:] + self._order[:start], self.TAKE, self.WAIT_S if wait_s is None else wait_s
        )
        if taken is None:
            return 0
        key, items = taken
        if key in self._keys:
            self._turn = self._order.index(key) + 1
        kind, device = self._keys.get(key, (BOARD, ""))
        handed = 0
        for raw in items:
            verdict = accept(kind, device, raw)
            if isinstance(verdict, str):
                security_event("inbox_message_refused", device=device, inbox=key, reason=verdict)
                continue
            # To the control plane's own task for it, on the control queue only the control plane
            # writes (recording retries there while the database is busy).
            self.send(verdict.task.value, args=[verdict.body], queue=Queue.CONTROL.value)
            handed += 1
        return handed

    def _run(self) -> None:
        warned = 0.0
        while True:
            try:
                close_old_connections()
                self.drain_once()
            except Exception as exc:  # the broker or database away for a moment: the next turn tries again
                if time.monotonic() - warned > 30:
                    warned = time.monotonic()
                    log.warning(
                        "the control inbox could not be read (again in %.1f s): %s: %s",
                        self.WAIT_S,
                        type(exc).__name__,
                        exc,
                    )
                time.sleep(self.WAIT_S)


INBOX = ControlInbox()

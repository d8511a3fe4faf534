"""The board outbox: the control plane's Celery app and what it sends boards, each request sealed
under its board's namespace key and signed by the control plane, on the board's own queue.

Actions send through it; the entry points start it (the control worker: ``dashboard.celery``; the
web process: ``dashboard.asgi``). It imports no action and no entry point: the layers in
pyproject.toml keep it below them."""

from __future__ import annotations

import os
import sys

from celery import Celery

from dashboard.security.signing import seal_for
from inference.contract.envelope import Kind
from inference.contract.messages import Queue, Task

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

app = Celery("edgecache")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def control_worker_argv(name: str = "control", loglevel: str = "warning") -> list[str]:
    """The command of one control worker of this app (``manage.py run``, the test stacks): the
    ``control`` queue on two threads (its inbox and sweeper loops run beside them), no gossip or
    mingle between workers."""
    options = (
        f"--queues {Queue.CONTROL.value} --pool threads --concurrency 2 --hostname {name}@%h --loglevel {loglevel}"
    )
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "dashboard",
        "worker",
        *options.split(),
        "--without-gossip",
        "--without-mingle",
    ]


_KINDS = {Task.RUN_PROMPT: Kind.RUN, Task.ENCODE_SCHEMA: Kind.ENCODE, Task.AUDIT_ENTRY: Kind.AUDIT}


def send_to_board(device, task: Task, message: dict, expires: float) -> None:
    """One request on ``device``'s own queue: sealed under its namespace's key and signed by the
    control plane (``inference.contract.envelope``), valid until it expires."""
    send_sealed(device, task, sealed_for_board(device, task, message, expires), message.get("request_id"), expires)


def sealed_for_board(device, task: Task, message: dict, expires: float) -> dict:
    """``message`` as ``send_to_board`` sends it: sealed for ``device`` and signed, valid ``expires`` s."""
    return seal_for(device, _KINDS[task], message, ttl=expires)


def send_sealed(device, task: Task, sealed: dict, request_id: str | None, expires: float) -> None:
    """A request sealed by ``sealed_for_board`` on ``device``'s own queue."""
    # The task's id is the request's: the Queue page finds a run in its board's queue by it (``dashboard.pages.queue``).
    # No repr of the sealed blob in the message's headers: it says nothing a reader could use, and
    # Celery's saferepr of it was 7% of an API dispatch's time in the web process (profiled).
    app.send_task(
        task.value,
        args=[sealed],
        queue=Queue.device(device.name),
        expires=expires,
        task_id=request_id,
        argsrepr="(sealed)",
        kwargsrepr="{}",
    )

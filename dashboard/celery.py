"""The control plane's Celery app (configured by Django settings, which take the settings boards
use from ``inference.board.app``). JSON messages only. Boards run their own app, without Django.
Each control worker runs EdgeCache's control tasks and nothing else, and three threads: the
sweeper (``dashboard.worker.sweeper``), the heartbeat reader (``actions.devices.HeartbeatBatch``) and the
control inbox (``dashboard.worker.inbox``), the only way a board's message reaches a task."""

import os

from celery import Celery
from celery.signals import worker_init, worker_ready

from inference.contract.messages import CONTROL_TASKS
from inference.board.app import keep_only_tasks

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

app = Celery("edgecache")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def _ours(sender) -> bool:
    return getattr(getattr(sender, "app", None), "main", None) == app.main  # not another app's worker in this process (a board's)


@worker_init.connect
def _own_tasks_only(sender=None, **_) -> None:
    """A control worker runs EdgeCache's control tasks and nothing else (no Celery canvas task)."""
    if _ours(sender):
        keep_only_tasks(app, {task.value for task in CONTROL_TASKS})


@worker_ready.connect
def _start_sweeper(sender=None, **_) -> None:
    if not _ours(sender):
        return
    # Django's apps are ready only now (Celery's Django fixup): these read the models.
    from .actions.devices import HEARTBEATS
    from dashboard.worker.inbox import INBOX
    from dashboard.worker.sweeper import start

    start()
    HEARTBEATS.start()  # every board's latest heartbeat, read in batches
    INBOX.start(app.send_task)  # every board's inbox, drained in turn onto the control queue

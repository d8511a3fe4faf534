"""The control plane's Celery app (configured by Django settings, which take the settings boards
use from ``inference.board.app``). JSON messages only. Boards run their own app, without Django.
Each control worker runs EdgeCache's control tasks and nothing else, and three threads: the
sweeper (``dashboard.worker.sweeper``), the heartbeat reader (``actions.devices.HeartbeatBatch``) and the
control inbox (``dashboard.worker.inbox``), the only way a board's message reaches a task."""

from celery.signals import worker_init, worker_ready

from dashboard.outbox import app
from inference.board.app import keep_only_tasks
from inference.contract.messages import CONTROL_TASKS


def _ours(sender) -> bool:
    return (
        getattr(getattr(sender, "app", None), "main", None) == app.main
    )  # not another app's worker in this process (a board's)


@worker_init.connect
def _own_tasks_only(sender=None, **_) -> None:
    """A control worker runs EdgeCache's control tasks and nothing else (no Celery canvas task)."""
    if _ours(sender):
        keep_only_tasks(app, {task.value for task in CONTROL_TASKS})


@worker_ready.connect
def _start_sweeper(sender=None, **_) -> None:
    if not _ours(sender):
        return
    # Imported here, not above: Django's apps are ready only now (Celery's Django fixup loads them
    # after this module), and these read the models at import.
    from dashboard.actions.devices import HEARTBEATS  # lazy: models before apps are ready
    from dashboard.worker.inbox import INBOX  # lazy: models before apps are ready
    from dashboard.worker.sweeper import start  # lazy: models before apps are ready (the sweeper imports the actions)

    start()
    HEARTBEATS.start()  # every board's latest heartbeat, read in batches
    INBOX.start(app.send_task)  # every board's inbox, drained in turn onto the control queue

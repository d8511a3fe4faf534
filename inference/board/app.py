"""Celery for boards: the settings every worker shares, and the app an edge process runs.

A board's Celery app is built here from its ``BoardConfig`` alone (broker = the cache box's
server); it never loads the control plane's settings. The control plane's app
(``dashboard.celery``) takes the same ``celery_settings`` through Django settings.
"""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import task_unknown
from kombu import Exchange
from kombu import Queue as KombuQueue

from cachebox.broker import without_scripts
from cachebox.events import security_event
from cachebox.tls import kombu_options
from inference.contract.messages import CONTROL_TASKS, Queue, Task

BOARD_TASKS = frozenset(
    {Task.RUN_PROMPT.value, Task.ENCODE_SCHEMA.value, Task.AUDIT_ENTRY.value}
)  # all a board's worker runs


def celery_settings(broker_url: str, environ=os.environ) -> dict:
    """Settings (lower-case Celery names) shared by boards and the control plane."""

    def number(name: str, default: int) -> int:
        raw = environ.get(name, "").strip()
        return int(raw) if raw else default

    return {
        "broker_url": broker_url,
        "task_serializer": "json",  # never pickle: boards load what they receive
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,  # boards report results as control-plane tasks
        "task_acks_late": True,  # acknowledged after the task ran: a board killed mid-task loses nothing
        "task_reject_on_worker_lost": True,
        # Unacknowledged messages of a worker that died go back to the queue after the visibility
        # timeout. Keep it longer than any task (a task still running then would run twice; runs
        # are stored once by id) and shorter than EDGECACHE_TASK_EXPIRES. Every worker looks for
        # such messages every EDGECACHE_RESTORE_INTERVAL seconds (kombu's default throttle: 100 s).
        "broker_transport_options": {
            "visibility_timeout": number("EDGECACHE_VISIBILITY_TIMEOUT", 300),
            "unacked_restore_interval": number("EDGECACHE_RESTORE_INTERVAL", 10),
            "unacked_restore_throttle": 1,
        },
        "worker_prefetch_multiplier": 1,
        # No broadcast control commands (ping, cancel_consumer, shutdown, ...): any writer of the
        # broker could send them to every worker. Boards and control workers take work from their
        # queues and nothing else; no events are published for monitors either.
        "worker_enable_remote_control": False,
        "worker_send_task_events": False,
        "task_send_sent_event": False,
        "task_default_queue": Queue.CONTROL.value,
        "task_routes": {task.value: {"queue": Queue.CONTROL.value} for task in CONTROL_TASKS},
        "broker_connection_retry_on_startup": True,
        # TLS to the broker for a rediss:// URL: the server's certificate verified against
        # EDGECACHE_REDIS_CA_CERT (cachebox.tls); None for a plain URL.
        "broker_use_ssl": kombu_options(broker_url),
        "worker_hijack_root_logger": False,
    }


# A board's reports wait for a broker that is away (its Wi-Fi dropped, the broker restarted)
# instead of failing after Celery's default three quick retries: the answer is computed, and the
# report is what the control plane records; a heartbeat waits in its own thread the same way.
BOARD_PUBLISH_RETRY = {"max_retries": None, "interval_start": 0.5, "interval_step": 1.0, "interval_max": 5.0}


def board_app(broker_url: str, *, queues: list[str] | None = None, transport_options: dict | None = None) -> Celery:
    """The Celery app of one edge process: the board tasks, JSON only, current and default.

    ``queues``: the queues it consumes, used as they are (the control plane declares and binds
    them; a board's Redis user may not). ``transport_options``: the board's own Kombu keys
    (``cachebox.acl.board_transport_options``)."""
    # No fixups: Celery's Django fixup sets Django up in any worker whose environment names
    # DJANGO_SETTINGS_MODULE (make run's boards inherited it), which loaded the control plane's
    # settings, secrets folder and every app into the board (41 MB more of a board worker's RSS).
    app = Celery("edgecache-board", set_as_current=True, fixups=[])
    settings = celery_settings(broker_url)
    settings["broker_transport_options"] = {**settings["broker_transport_options"], **(transport_options or {})}
    if queues:
        settings["task_queues"] = [
            KombuQueue(name, Exchange(name), routing_key=name, no_declare=True) for name in queues
        ]
    app.conf.update(settings)
    app.conf.update(
        include=["inference.board.tasks"],
        task_publish_retry_policy=BOARD_PUBLISH_RETRY,
        broker_connection_max_retries=None,
    )
    app.set_default()
    app.loader.import_default_modules()  # its tasks, then nothing else: keep_only_tasks
    keep_only_tasks(app, BOARD_TASKS)
    without_scripts()  # this process is a board: its Redis user may run no script
    return app


def keep_only_tasks(app: Celery, names) -> list[str]:
    """Unregister every task of ``app`` but ``names``: Celery's built-in canvas tasks (``celery.group``,
    ``chain``, ``chord``, ``map``, ``starmap``, ``chunks``, ...) included, so that a message naming one
    is refused by the worker before anything runs (Celery's unknown-task path, logged on
    ``edgecache.security`` by ``_refused_task``). Call it when the worker has imported its tasks
    (``worker_init``); returns the names removed."""
    removed = [name for name in list(app.tasks) if name not in names]
    for name in removed:
        app.tasks.unregister(name)
    return removed


@task_unknown.connect
def _refused_task(sender=None, name=None, **_) -> None:
    security_event("task_refused", task=str(name)[:200], reason="not one of EdgeCache's own tasks: nothing ran")

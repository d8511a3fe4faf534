"""The control plane's Celery app (configured by Django settings, which take the settings boards
use from ``inference.worker``). JSON messages only. Boards run their own app, without Django.
Each control worker also runs the sweeper (``dashboard.sweeper``)."""

import os

from celery import Celery
from celery.signals import worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

app = Celery("edgecache")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def _start_sweeper(sender=None, **_) -> None:
    if getattr(getattr(sender, "app", None), "main", None) != app.main:
        return  # another app's worker in this process (a board's): not the control plane's
    from .actions.devices import HEARTBEATS
    from .sweeper import start

    start()
    HEARTBEATS.start()  # boards' heartbeats, taken off the broker's list in batches

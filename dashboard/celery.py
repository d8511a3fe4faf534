"""The control plane's Celery app (configured by Django settings, which take the settings boards
use from ``inference.worker``). JSON messages only. Boards run their own app, without Django."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

app = Celery("edgecache")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

"""The Celery app shared by the control plane and the boards. JSON messages only."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

app = Celery("edgecache")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

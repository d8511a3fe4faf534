"""Control-plane Celery tasks (queue ``control``): thin wrappers over dashboard.actions.

Only the control plane writes this queue: boards' messages reach it through the control inbox
(``dashboard.worker.inbox``), which hands on only these messages from the device their inbox names.
A control worker runs these tasks and nothing else (``inbox.refuse_foreign_tasks``: Celery's
built-in canvas tasks are unregistered). Each hands the raw message to its verb, which validates
it against the message contract (``inference.contract.messages``) and refuses (logs) what does not follow it.
"""

from celery import shared_task
from django.db import OperationalError

from inference.contract.messages import Task

from . import actions


# A computed answer must reach the database: a busy database (SQLite locked, PostgreSQL
# restarting) is retried with back-off; recording is idempotent (a run is stored once).
@shared_task(
    name=Task.RECORD_RUN.value,
    acks_late=True,
    ignore_result=True,
    autoretry_for=(OperationalError,),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=8,
)
def record_run(payload: dict) -> None:
    actions.record_run(payload)


@shared_task(name=Task.ENCODE_PROGRESS.value, ignore_result=True)
def encode_progress(payload: dict) -> None:
    actions.record_encode_progress(payload)


@shared_task(name=Task.ENCODED.value, acks_late=True, ignore_result=True)
def encoded(payload: dict) -> None:
    actions.record_encoded(payload)


@shared_task(name=Task.ENROLL.value, ignore_result=True)
def enroll(payload: dict) -> None:
    actions.enroll_device(payload)


@shared_task(
    name=Task.RECORD_AUDIT.value,
    acks_late=True,
    ignore_result=True,
    autoretry_for=(OperationalError,),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=8,
)
def record_audit(payload: dict) -> None:
    actions.record_audit(payload)  # an audit's verdict: a mismatch quarantines the producing board

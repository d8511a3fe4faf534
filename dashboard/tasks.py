"""Control-plane Celery tasks (queue ``control``): thin wrappers over dashboard.actions."""

from celery import shared_task

from . import actions


@shared_task(name="edgecache.record_run", acks_late=True, ignore_result=True)
def record_run(payload: dict) -> None:
    actions.record_run(payload)


@shared_task(name="edgecache.heartbeat", ignore_result=True)
def heartbeat(payload: dict) -> None:
    actions.record_heartbeat(payload)


@shared_task(name="edgecache.encode_progress", ignore_result=True)
def encode_progress(payload: dict) -> None:
    actions.record_encode_progress(payload)


@shared_task(name="edgecache.encoded", acks_late=True, ignore_result=True)
def encoded(payload: dict) -> None:
    actions.record_encoded(payload)

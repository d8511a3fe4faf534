"""The control worker's own loops: the control inbox (boards' messages, checked, handed to tasks) and
the sweeper. Started by the Celery app (dashboard.celery)."""

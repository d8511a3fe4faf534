"""The control plane: Django project settings, ASGI, the Celery app and the pages."""

from .celery import app as celery_app

__all__ = ["celery_app"]

import os

from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "EdgeCache control plane"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from .models import Device
        from .routing import CANDIDATES

        post_save.connect(CANDIDATES.forget, sender=Device, weak=False, dispatch_uid="routing-candidates-saved")
        post_delete.connect(CANDIDATES.forget, sender=Device, weak=False, dispatch_uid="routing-candidates-deleted")
        if os.environ.get("EDGECACHE_COUNT_DB_WRITES") == "1":  # bench fleet-sim: database writes/s of every process
            from .db_writes import count_writes

            count_writes()

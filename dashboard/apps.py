import os

from django.apps import AppConfig


def ensure_default_namespace(sender, using="default", **kwargs) -> None:
    """The namespace a device gets when none is chosen (migration 0002 made it): made again after
    every migrate, so that a database flushed since (``manage.py flush``, a transactional test) or
    one where it was deleted still has it."""
    from django.db import connections

    from .models import Namespace  # lazy: models before apps are ready (apps.py loads while the registry populates)

    if Namespace._meta.db_table in connections[using].introspection.table_names():  # not when migrated back past it
        Namespace.objects.using(using).get_or_create(name="default")


def _after_commit(receiver):
    """A signal receiver that runs ``receiver`` once the change it heard of is committed."""
    from django.db import transaction

    return lambda **kwargs: transaction.on_commit(receiver, using=kwargs.get("using"))


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "EdgeCache control plane"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_migrate, post_save

        from dashboard.router import CANDIDATES  # lazy: models before apps are ready (the router imports them)

        from .actions.api_keys import key_changed  # lazy: models before apps are ready (the actions import them)
        from .models import ApiKey, Device  # lazy: models before apps are ready (loaded while the registry populates)

        post_save.connect(CANDIDATES.forget, sender=Device, weak=False, dispatch_uid="routing-candidates-saved")
        post_delete.connect(CANDIDATES.forget, sender=Device, weak=False, dispatch_uid="routing-candidates-deleted")
        # Any change of an API key (the admin's edits and deletions too) reaches every web process's remembered keys.
        for signal, uid in ((post_save, "api-key-saved"), (post_delete, "api-key-deleted")):
            signal.connect(_after_commit(key_changed), sender=ApiKey, weak=False, dispatch_uid=uid)
        post_migrate.connect(ensure_default_namespace, sender=self, dispatch_uid="default-namespace")
        if os.environ.get("EDGECACHE_COUNT_DB_WRITES") == "1":  # bench fleet-sim: database writes/s of every process
            from dashboard.ops.db_writes import count_writes  # lazy: only when bench fleet-sim counts database writes

            count_writes()

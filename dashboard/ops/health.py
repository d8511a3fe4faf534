"""Whether the control plane can serve, for load balancers and orchestrators (as llama.cpp's server
answers ``/health``): ``health`` says whether this process is ready (its database answers with
every migration applied, its cache box answers), ``readiness`` whether any board of each model is
online."""

from __future__ import annotations

import logging

from django.db import DatabaseError, connection
from django.utils import timezone

from cachebox.errors import CacheBoxError
from dashboard.actions.cache import cachebox
from dashboard.models import Device

log = logging.getLogger("dashboard.ops.health")

_migrated = False  # once every migration is applied it stays so for this process


def _pending_migrations() -> int:
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    return len(executor.migration_plan(executor.loader.graph.leaf_nodes()))


def health() -> list[str]:
    """What this process still waits for before it can serve ([] when ready): the database, its
    migrations, the cache box (which is also the broker and the live pages' channel layer)."""
    global _migrated

    waiting = []
    try:
        connection.ensure_connection()
        if not _migrated:
            pending = _pending_migrations()
            if pending:
                waiting.append(f"{pending} database migration{'s' if pending != 1 else ''} (python manage.py migrate)")
            _migrated = not pending
    except DatabaseError as exc:
        waiting.append(f"the database ({type(exc).__name__})")
    try:
        if not cachebox().ping():
            waiting.append("the cache box")
    except CacheBoxError as exc:
        waiting.append(f"the cache box ({type(exc).__name__})")
    return waiting


def readiness(now=None) -> dict[str, dict]:
    """Per model the boards last said they serve: how many boards (not revoked) serve it, how many
    are online now, and ``ready`` when one is. Boards that never beat name no model yet."""
    now = now or timezone.now()
    models: dict[str, dict] = {}
    for device in Device.objects.filter(revoked_at__isnull=True).only("last_seen", "status", "revoked_at"):
        model = (device.status or {}).get("model")
        if not isinstance(model, str) or not model:
            continue
        entry = models.setdefault(model, {"boards": 0, "online": 0})
        entry["boards"] += 1
        entry["online"] += int(device.online_at(now))
    return {model: {**entry, "ready": entry["online"] > 0} for model, entry in sorted(models.items())}

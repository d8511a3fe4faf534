"""Verbs on cache entries: evict, pin, unpin, flush (the store and its mirror together)."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from cachebox.models import CacheEntry
from cachebox.store import CacheBox

from .audit import AuditAction, audit


def cachebox() -> CacheBox:
    """The control plane's client of the cache box."""
    return CacheBox(settings.REDIS_URL, connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT, timeout=settings.EDGECACHE_IO_TIMEOUT)


def evict_entries(user, entries) -> int:
    """Delete entries from the cache box and the mirror (their catalog bits stay until reconcile)."""
    names = [entry.key for entry in entries]
    cachebox().delete(names)  # raises CacheBoxUnavailable before the mirror changes
    with transaction.atomic():
        CacheEntry.objects.filter(key__in=names).delete()
        audit(user, AuditAction.CACHE_EVICT, f"{len(names)} entries", ", ".join(names[:20]))
    return len(names)


def pin_entries(user, entries, pinned: bool) -> int:
    names = [entry.key for entry in entries]
    store = cachebox()
    if pinned:
        store.pin(names)
    else:
        store.unpin(names, settings.EDGECACHE_ENTRY_TTL or 7 * 24 * 3600)
    with transaction.atomic():
        CacheEntry.objects.filter(key__in=names).update(pinned=pinned)
        audit(user, AuditAction.CACHE_PIN if pinned else AuditAction.CACHE_UNPIN, f"{len(names)} entries", ", ".join(names[:20]))
    return len(names)


def flush_entries(user, namespace: str | None, model: str | None) -> int:
    """Delete every entry of a namespace and/or model, in the store and the mirror."""
    removed = cachebox().flush(namespace, model)
    rows = CacheEntry.objects.all()
    if namespace:
        rows = rows.filter(namespace=namespace)
    if model:
        rows = rows.filter(model=model)
    with transaction.atomic():
        rows.delete()
        audit(user, AuditAction.CACHE_FLUSH, f"namespace={namespace or '*'} model={model or '*'}", f"{removed} entries")
    return removed

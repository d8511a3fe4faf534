"""Verbs on cache entries: evict, pin, unpin, flush (the store and its mirror together)."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction

from cachebox import embedded, quota
from cachebox.catalog import expected_filter_bytes
from cachebox.errors import CacheBoxError
from cachebox.events import security_event
from cachebox.keys import parse_entry_key_name
from cachebox.store import CacheBox
from dashboard.models import CacheEntry
from inference.contract.messages import StoredEntry

from .audit import AuditAction, audit

log = logging.getLogger("dashboard.actions")


def cachebox_url() -> str:
    """Where the cache box is: EDGECACHE_CACHEBOX_URL (it may be a cluster), else REDIS_URL's server."""
    return settings.EDGECACHE_CACHEBOX_URL or settings.REDIS_URL


def start_cachebox(bind: tuple[str, ...] | None = None) -> str:
    """Start this checkout's embedded cache box unless REDIS_URL names a server (the control plane's
    password for it comes from the secrets folder; ``bind``: the addresses it listens on besides
    loopback, default EDGECACHE_EMBEDDED_BIND); returns the cache box's URL.
    CacheBoxUnavailable when it cannot start."""
    if settings.REDIS_URL_IS_EMBEDDED:
        embedded.ensure_running(
            settings.EDGECACHE_EMBEDDED_DIR,
            port=settings.EDGECACHE_EMBEDDED_PORT,
            maxmemory=settings.EDGECACHE_EMBEDDED_MAXMEMORY,
            max_value=settings.EDGECACHE_BOARD.max_entry_bytes,
            password=settings.EDGECACHE_EMBEDDED_PASSWORD,
            bind=tuple(bind if bind is not None else settings.EDGECACHE_EMBEDDED_BIND),
        )
    return cachebox_url()


def stop_cachebox() -> bool:
    """Stop this checkout's embedded cache box; False when none ran (or REDIS_URL names a server)."""
    if not settings.REDIS_URL_IS_EMBEDDED:
        return False
    return embedded.stop(
        settings.EDGECACHE_EMBEDDED_DIR, settings.EDGECACHE_EMBEDDED_PORT, password=settings.EDGECACHE_EMBEDDED_PASSWORD
    )


def cachebox_limits(store: CacheBox) -> quota.Limits:
    """What the cache box's write functions allow on ``store``'s server(s) (settings): entry size and
    TTL, a namespace's budget (EDGECACHE_NAMESPACE_QUOTA, else a quarter of the server's maxmemory:
    one INFO), the catalog snapshot boards of this configuration make (with 10% and 4 KB to spare)."""
    board = settings.EDGECACHE_BOARD
    return quota.Limits(
        max_value=board.max_entry_bytes,
        max_ttl=settings.EDGECACHE_MAX_ENTRY_TTL,
        quota=settings.EDGECACHE_NAMESPACE_QUOTA or quota.default_quota(store.memory_limit_per_node()),
        max_snapshot=int(expected_filter_bytes(board.catalog_capacity, board.catalog_fp_rate) * 1.1) + 4096,
    )


def cachebox() -> CacheBox:
    """The control plane's client of the cache box."""
    return CacheBox(
        cachebox_url(), connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT, timeout=settings.EDGECACHE_IO_TIMEOUT
    )


_KEPT: dict[tuple, CacheBox] = {}


def kept_cachebox() -> CacheBox:
    """This process's lasting client of the cache box, its connections reused, for what every API
    request does (the bounded queues' counts, the marks of what a run's follower heard): a client
    per call opened a connection and logged in each time. No skipping after a failure (retry_after
    0): one slow connect under load must not make every call of the next seconds fail."""
    url = cachebox_url()
    kept = (url, settings.EDGECACHE_CONNECT_TIMEOUT, settings.EDGECACHE_IO_TIMEOUT)
    store = _KEPT.get(kept)
    if store is None:
        store = _KEPT[kept] = CacheBox(
            url,
            connect_timeout=max(2.0, settings.EDGECACHE_CONNECT_TIMEOUT),
            timeout=settings.EDGECACHE_IO_TIMEOUT,
            retry_after=0.0,
        )
    return store


def entry_names(names) -> list[str]:
    """The names among ``names`` that are cache entries: staff verbs never touch other keys
    (device records, catalogs, queues), whatever a mirror row says."""
    kept = []
    for name in names:
        try:
            parse_entry_key_name(name)
            kept.append(name)
        except ValueError:
            security_event("cache_action_refused", key=name[:200], reason="not a cache entry key")
    return kept


def acceptable_entries(device, entries: list[StoredEntry]) -> list[StoredEntry]:
    """The stored entries a board may report: well-formed entry names of its own namespace and model.

    A board that names another key (a device record, another tenant's entry) gets nothing
    mirrored for it, so a staff eviction can never be steered onto such a key (logged).
    """
    namespaces = {device.namespace_id, device.cache_namespace}
    model = (device.status or {}).get("fingerprint")
    kept = []
    for entry in entries:
        try:
            namespace, fingerprint, _ = parse_entry_key_name(entry.name)
            ok = (
                namespace == entry.namespace
                and fingerprint == entry.model
                and namespace in namespaces
                and (not model or fingerprint == model)
            )
        except ValueError:
            ok = False
        if ok:
            kept.append(entry)
        else:
            security_event(
                "mirror_refused",
                device=device.name,
                entry=entry.name[:200],
                reason="not an entry of this board's namespace and model",
            )
    return kept


def evict_entries(user, entries) -> int:
    """Delete entries from the cache box and the mirror (their catalog bits stay until reconcile)."""
    names = entry_names(entry.key for entry in entries)
    cachebox().delete(names)  # raises CacheBoxUnavailable before the mirror changes
    with transaction.atomic():
        CacheEntry.objects.filter(key__in=names).delete()
        audit(user, AuditAction.CACHE_EVICT, f"{len(names)} entries", ", ".join(names[:20]))
    return len(names)


def pin_entries(user, entries, pinned: bool) -> int:
    names = entry_names(entry.key for entry in entries)
    store = cachebox()
    if pinned:
        store.pin(names)
    else:
        store.unpin(names, settings.EDGECACHE_ENTRY_TTL or 7 * 24 * 3600)
    with transaction.atomic():
        CacheEntry.objects.filter(key__in=names).update(pinned=pinned)
        audit(
            user,
            AuditAction.CACHE_PIN if pinned else AuditAction.CACHE_UNPIN,
            f"{len(names)} entries",
            ", ".join(names[:20]),
        )
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


def delete_entries_of(device_name: str) -> int:
    """Delete from the cache box the entries the mirror says ``device_name`` stored (best effort:
    readers refuse them anyway once the producer table lists the board)."""
    names = list(CacheEntry.objects.filter(creator_device=device_name).values_list("key", flat=True))
    return delete_entries(names)


def delete_entries(names: list[str]) -> int:
    if not names:
        return 0
    try:
        removed = cachebox().delete(names)
    except CacheBoxError as exc:
        log.warning("quarantined entries not deleted now (readers refuse them): %s", exc)
        return 0
    CacheEntry.objects.filter(key__in=names).delete()
    return removed

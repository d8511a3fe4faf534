"""Keeping a board's catalog in step with the master copy in the cache box.

The master catalog of a namespace is a snapshot (filter bytes + the last log id
folded in) and a stream of keys announced since. A board loads the snapshot once,
then reads only new log records; a new epoch (cache box restarted empty or
flushed) makes it start over. Runs in a background thread: a lookup never waits
on the network.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from .catalog import Catalog, max_snapshot_bytes
from .errors import CacheBoxUnavailable, CatalogFormatError
from .events import security_event
from .store import CacheBox, _stream_id_after

log = logging.getLogger(__name__)

# A board folds the log into the master snapshot once it holds this many records.
COMPACT_AFTER_RECORDS = 20_000


class CatalogReplica:
    """A board's local catalog for one namespace."""

    def __init__(self, store: CacheBox, namespace: str, catalog: Catalog | None = None):
        self.store = store
        self.namespace = namespace
        self.catalog = catalog or Catalog()
        self.epoch = ""
        self.last_id = "0"
        self.last_sync: float | None = None  # wall-clock time of the last successful sync
        self._lock = threading.Lock()

    def sync(self) -> int:
        """Pull what other boards announced; returns the number of keys added.

        Raises CacheBoxUnavailable when the cache box cannot be reached.
        """
        with self._lock:
            epoch = self.store.catalog_epoch(self.namespace, uuid.uuid4().hex)
            if epoch != self.epoch:
                self._restart(epoch)
            else:
                first_id = self.store.catalog_log_first_id(self.namespace)
                if first_id and self.last_id != "0" and _stream_id_after(first_id, self.last_id):
                    # Records we never read were folded into the snapshot and trimmed.
                    self._merge_snapshot()
            added = self._read_log()
            if self.store.catalog_log_length(self.namespace) >= COMPACT_AFTER_RECORDS:
                self.store.catalog_put_snapshot(self.namespace, self.catalog.to_bytes(), self.last_id, self.epoch)
            self.last_sync = time.time()
            return added

    def announce(self, keys: list[bytes]) -> None:
        """Tell every board about entries this board just stored (and know them locally at once)."""
        self.store.catalog_append(self.namespace, keys)
        self.catalog.add_many(keys)

    def _restart(self, epoch: str) -> None:
        if self.epoch:
            log.info("catalog %s: cache box epoch changed, dropping the local filter", self.namespace)
        self.catalog.clear()
        self.epoch = epoch
        self.last_id = "0"
        self._merge_snapshot()

    def _merge_snapshot(self) -> None:
        own = (self.catalog.capacity, self.catalog.fp_rate)
        try:
            # Never more than a catalog of this size takes is fetched, and nothing of another size is loaded.
            bloom, last_id, snapshot_epoch = self.store.catalog_snapshot(
                self.namespace, max_bytes=max_snapshot_bytes(*own)
            )
            if bloom is None or snapshot_epoch != self.epoch:
                return
            self.catalog.merge(Catalog.from_bytes(bloom, expect=own))
        except CatalogFormatError as exc:
            # Refused before anything was allocated; dropped so no board or page reads it again.
            # The catalog is rebuilt from the announcements that follow (and whole by `reconcile`).
            security_event(
                "catalog_refused", namespace=self.namespace, reason=str(exc)[:300], action="snapshot dropped"
            )
            self.store.catalog_drop_snapshot(self.namespace)
            return
        if _stream_id_after(last_id, self.last_id):
            self.last_id = last_id

    def _read_log(self) -> int:
        added = 0
        while True:
            records = self.store.catalog_read_log(self.namespace, self.last_id)
            if not records:
                return added
            self.catalog.add_many(key for _, key in records if len(key) == 16)
            added += len(records)
            self.last_id = records[-1][0]


class CatalogRegistry:
    """A board's catalogs, one per namespace it serves."""

    def __init__(self, store: CacheBox, capacity: int, fp_rate: float):
        self.store = store
        self.capacity = capacity
        self.fp_rate = fp_rate
        self._replicas: dict[str, CatalogReplica] = {}
        self._lock = threading.Lock()

    def get(self, namespace: str) -> CatalogReplica:
        """The namespace's replica; a new one starts empty and fills at the next background sync."""
        with self._lock:
            replica = self._replicas.get(namespace)
            if replica is None:
                replica = CatalogReplica(self.store, namespace, Catalog(self.capacity, self.fp_rate))
                self._replicas[namespace] = replica
            return replica

    def forget(self, namespace: str) -> None:
        with self._lock:
            self._replicas.pop(namespace, None)

    @property
    def replicas(self) -> list[CatalogReplica]:
        with self._lock:
            return list(self._replicas.values())

    def sync_all(self) -> bool:
        """Sync every replica once; False if the cache box could not be reached."""
        ok = True
        for replica in self.replicas:
            try:
                replica.sync()
            except CacheBoxUnavailable:
                ok = False
            except Exception:  # never let the puller die silently
                log.exception("catalog sync of %s failed", replica.namespace)
                ok = False
        return ok


class CatalogSyncThread(threading.Thread):
    """Background puller: syncs every replica every ``interval`` seconds until stopped."""

    def __init__(self, registry: CatalogRegistry, interval: float = 1.0):
        super().__init__(name="edgecache-catalog-sync", daemon=True)
        self.registry = registry
        self.interval = interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.registry.sync_all()  # a failure is retried at the next tick

    def stop(self) -> None:
        self._stop_event.set()


def rebuild_master_catalog(
    store: CacheBox, namespace: str, keys: list[bytes], capacity: int = 1_000_000, fp_rate: float = 0.01
) -> str:
    """Replace a namespace's master catalog with exactly ``keys`` (drops evicted entries' bits).

    Starts a new epoch, so every board reloads the rebuilt filter at its next sync.
    Returns the new epoch.
    """
    catalog = Catalog(capacity, fp_rate)
    catalog.add_many(keys)
    epoch = uuid.uuid4().hex
    store.catalog_replace(namespace, catalog.to_bytes(), epoch)
    return epoch

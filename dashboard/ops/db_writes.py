"""Counting the control plane's database writes (``bench fleet-sim``; on with ``EDGECACHE_COUNT_DB_WRITES=1``).

Every INSERT, UPDATE and DELETE a process sends to the database is counted; a thread adds the
count to one key of Django's cache (Redis) every second, so the bench reads the writes of every web
process and control worker together. Off, it costs nothing.
"""

from __future__ import annotations

import logging
import threading

from django.db.backends.signals import connection_created

from dashboard.store.django_cache import CACHE_SERVER_ERRORS

log = logging.getLogger("dashboard")
KEY = "ec:bench:db-writes"
WRITES = ("insert", "update", "delete", "replace")
_count = 0
_lock = threading.Lock()
_started = False


def _counting(execute, sql, params, many, context):
    global _count
    if sql.lstrip()[:7].lower().startswith(WRITES):
        with _lock:
            _count += len(params) if many and params is not None and not isinstance(params, str) else 1
    return execute(sql, params, many, context)


def _install(sender, connection, **kwargs) -> None:
    if _counting not in connection.execute_wrappers:
        connection.execute_wrappers.append(_counting)


def written() -> int:
    """The writes counted so far by every process."""
    from django.core.cache import cache

    return int(cache.get(KEY) or 0)


def _flush_forever() -> None:
    import time

    from django.core.cache import cache

    global _count
    while True:
        time.sleep(1.0)
        with _lock:
            count, _count = _count, 0
        if count:
            try:
                cache.add(KEY, 0, timeout=None)
                cache.incr(KEY, count)
            except CACHE_SERVER_ERRORS as exc:
                log.warning("database writes not counted: %s", exc)
                with _lock:
                    _count += count


def count_writes() -> None:
    global _started
    connection_created.connect(_install, weak=False)
    if not _started:
        _started = True
        threading.Thread(target=_flush_forever, name="edgecache-db-writes", daemon=True).start()

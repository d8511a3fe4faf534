"""Security events counted for /metrics (``edgecache_security_events_total{event}``): a logging
handler on the ``edgecache.security`` logger adds each event of this process to one hash in the
cache box, which every control-plane process shares (the control worker refuses forged board
messages; the web process serves /metrics). Best effort: a count the cache box misses is only a
count; the log line is written anyway.

Imported by the logging configuration: no Django model at import time.
"""

from __future__ import annotations

import logging
import threading

from cachebox.errors import CacheBoxError
from cachebox.store import CacheBox

KEY = "edgecache:security-events"

_local = threading.local()
_clients: dict[str, object] = {}  # one client per cache box URL and process: its back-off spans events


def _store():
    from django.conf import settings

    # lazy: models before apps are ready (settings.LOGGING's handler loads this module in django.setup())
    from dashboard.actions.cache import cachebox_url

    url = cachebox_url()
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = CacheBox(
            url, connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT, timeout=settings.EDGECACHE_IO_TIMEOUT
        )
    return client


class SecurityEventCounter(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "security_event", None)
        if not event or getattr(_local, "busy", False):
            return
        _local.busy = True  # an event logged while counting one is not counted (no loop)
        try:
            _store().count(KEY, str(event)[:64])
        except Exception:  # the cache box is down or refuses: the count is lost, the log line is not
            pass
        finally:
            _local.busy = False


def security_counts() -> dict[str, int]:
    """Every security event counted so far, by name ({} when the cache box does not answer)."""

    try:
        return _store().counts(KEY)
    except (CacheBoxError, ValueError):
        return {}

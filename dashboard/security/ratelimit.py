"""A fixed-window rate limit on Django's cache (Redis: shared by every daphne process).

One counter per user and minute: ``cache.add`` creates it (only if missing, so the first
request of the window does not race another one), ``cache.incr`` counts atomically.

It never fails open: when the cache cannot be reached (down, or every pooled connection busy),
the count goes on in this process (``_local``), with the same window and limit. Several web
processes then each allow up to the limit until the cache answers again: bounded, not open.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from django.core.cache import caches

from dashboard.store.django_cache import CACHE_SERVER_ERRORS

log = logging.getLogger("dashboard.security.ratelimit")

WINDOW_SECONDS = 60
clock = time.time  # replaced in tests to move to the next window


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    count: int  # requests in this window, this one included
    limit: int
    retry_after: int  # seconds until the window ends (when refused)


def hit(
    scope: str, who: str | int, limit: int, *, window: int = WINDOW_SECONDS, cache_alias: str = "default"
) -> Verdict:
    """Count one request of ``who`` in ``scope``; refused once the window holds more than ``limit``.

    A limit of 0 or less turns the limit off. When the cache cannot be reached the request is
    counted in this process instead (logged once a window): refused past the limit all the same.
    """
    if limit <= 0:
        return Verdict(True, 0, limit, 0)
    now = clock()
    current = int(now // window)
    key = f"ratelimit:{scope}:{who}:{current}"
    cache = caches[cache_alias]
    # Every request is counted in this process too: one that the shared cache could not count (a
    # busy pool) is refused past the limit all the same, with the ones it did count.
    local = _local.count(key, current)
    try:
        cache.add(key, 0, timeout=window + 5)
        try:
            count = cache.incr(key)
        except ValueError:  # expired between add and incr
            cache.set(key, 1, timeout=window + 5)
            count = 1
    except CACHE_SERVER_ERRORS as exc:
        if _local.first_fallback(current):
            log.warning("rate limit %s counted in this process: the cache is unreachable (%s)", scope, exc)
        count = local
    else:
        count = max(count, local)
    retry_after = max(1, math.ceil((current + 1) * window - now))
    return Verdict(count <= limit, count, limit, retry_after)


class _LocalCounts:
    """Fixed-window counters of this process, for while the shared cache does not answer."""

    def __init__(self):
        self._lock = threading.Lock()
        self._window = None
        self._counts: dict[str, int] = {}
        self._warned = None  # the window whose first fallback was logged

    def count(self, key: str, window: int) -> int:
        with self._lock:
            if self._window != window:  # a new window: older counters are over
                self._window, self._counts = window, {}
            self._counts[key] = self._counts.get(key, 0) + 1
            return self._counts[key]

    def first_fallback(self, window: int) -> bool:
        """True the first time in ``window`` that the shared cache did not answer (logged once)."""
        with self._lock:
            first, self._warned = self._warned != window, window
            return first


_local = _LocalCounts()

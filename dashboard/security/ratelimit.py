"""A fixed-window rate limit on Django's cache (Redis: shared by every web process).

One counter per user and minute, created only if missing (so the first request of the window does
not race another one) and counted atomically: on the cache box's Redis in one round trip
(``CacheBoxRedisCache.count_and_read_unanswered``), which can bring back one more value beside the
count (the API keys' epoch, ``dashboard.api.keys``). ``hit_unanswered`` sends the count at once and
reads its verdict later, so that the round trip runs beside the caller's work.

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
from typing import Callable

from django.core.cache import caches

from dashboard.store.django_cache import CACHE_SERVER_ERRORS

log = logging.getLogger("dashboard.security.ratelimit")

WINDOW_SECONDS = 60
clock = time.time  # replaced in tests to move to the next window


UNREAD = object()  # what ``hit(read=...)`` gives when the shared cache could not be read


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    count: int  # requests in this window, this one included
    limit: int
    retry_after: int  # seconds until the window ends (when refused)
    read: object = UNREAD  # ``hit(read=NAME)``: NAME's value in the shared cache, read in the same round trip

    def under(self, limit: int) -> "Verdict":
        """The same count judged against another limit (0 or less: none)."""
        return Verdict(limit <= 0 or self.count <= limit, self.count, limit, self.retry_after, self.read)


def hit(
    scope: str,
    who: str | int,
    limit: int,
    *,
    window: int = WINDOW_SECONDS,
    cache_alias: str = "default",
    read: str | None = None,
) -> Verdict:
    """Count one request of ``who`` in ``scope``; refused once the window holds more than ``limit``.
    A limit of 0 or less turns the limit off (nothing is counted). When the cache cannot be reached
    the request is counted in this process instead (logged once a window): refused past the limit
    all the same. ``read``: a cache key whose value comes back in ``Verdict.read``, read in the same
    round trip where the cache can (``UNREAD`` when the cache could not be read).
    """
    return hit_unanswered(scope, who, limit, window=window, cache_alias=cache_alias, read=read)()


def hit_unanswered(
    scope: str,
    who: str | int,
    limit: int,
    *,
    window: int = WINDOW_SECONDS,
    cache_alias: str = "default",
    read: str | None = None,
) -> Callable[[], Verdict]:
    """``hit``, in two halves: the request is counted at once (sent to the shared cache where it
    can take a command without waiting for its answer, ``CacheBoxRedisCache``), and the returned
    function gives the verdict. Call it once, and always. The round trip runs beside the caller's
    work in between (an API request's parsing and routing)."""
    now = clock()
    current = int(now // window)
    key = f"ratelimit:{scope}:{who}:{current}"
    cache = caches[cache_alias]
    if limit <= 0:
        value = _read_unanswered(cache, read) if read else lambda: UNREAD
        return lambda: Verdict(True, 0, limit, 0, value())
    # Every request is counted in this process too: one that the shared cache could not count (a
    # busy pool) is refused past the limit all the same, with the ones it did count.
    local = _local.count(key, current)
    counted = _count_unanswered(cache, key, window + 5, read)

    def verdict() -> Verdict:
        value = UNREAD
        try:
            count, value = counted()
        except CACHE_SERVER_ERRORS as exc:
            if _local.first_fallback(current):
                log.warning("rate limit %s counted in this process: the cache is unreachable (%s)", scope, exc)
            count = local
        else:
            count = max(count, local)
        retry_after = max(1, math.ceil((current + 1) * window - now))
        return Verdict(count <= limit, count, limit, retry_after, value)

    return verdict


def _count_unanswered(cache, key: str, timeout: int, read: str | None) -> Callable[[], tuple[int, object]]:
    """One more in ``key``, and ``read``'s value: in one round trip, sent at once, where the cache
    can (``CacheBoxRedisCache.count_and_read_unanswered``), else add, incr and get. The returned
    function gives them, or raises what the cache raised."""
    try:
        if hasattr(cache, "count_and_read_unanswered"):
            answer = cache.count_and_read_unanswered(key, timeout, read or key)

            def counted_there() -> tuple[int, object]:
                count, value = answer()
                return count, value if read else UNREAD

            return counted_there
        cache.add(key, 0, timeout=timeout)
        try:
            count = cache.incr(key)
        except ValueError:  # expired between add and incr
            cache.set(key, 1, timeout=timeout)
            count = 1
        counted = (count, cache.get(read) if read else UNREAD)
        return lambda: counted
    except CACHE_SERVER_ERRORS as exc:
        failure = exc

        def failed():
            raise failure

        return failed


def _read_unanswered(cache, name: str) -> Callable[[], object]:
    """``name``'s value (``UNREAD`` when the cache cannot be read), sent at once where the cache can."""
    try:
        if hasattr(cache, "read_unanswered"):
            answer = cache.read_unanswered(name)
        else:
            value = cache.get(name)
            answer = lambda: value  # noqa: E731
    except CACHE_SERVER_ERRORS:
        return lambda: UNREAD

    def value() -> object:
        try:
            return answer()
        except CACHE_SERVER_ERRORS:
            return UNREAD

    return value


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

"""Django's cache on the cache box's Redis/Valkey server (see CACHES in settings), never pickled.

Django's stock Redis and local-memory caches pickle their values: anyone who can write the Redis
server could then run code in every process that reads the cache (a board's Redis credentials
were enough). Here values are JSON, and integers stay plain so that INCR still counts atomically.
"""

from __future__ import annotations

import json
import re
from typing import Callable

import redis
from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.redis import RedisCache, RedisCacheClient
from django.core.exceptions import ImproperlyConfigured

from cachebox.store import send_now_read_later

# What a Django cache on a Redis server raises when that server fails (for callers that
# degrade instead of failing, such as the run rate limit): no code outside cachebox imports redis.
CACHE_SERVER_ERRORS = (redis.RedisError, OSError)


class UnreadableCacheValue(ValueError):
    """A cached value that is not JSON (written by someone else, or by an older version): a miss."""


class JSONSerializer:
    """Values as JSON; integers as plain numbers (INCR works on them). A value that is not JSON is
    refused as unreadable, never evaluated."""

    def dumps(self, obj):
        if type(obj) is int:  # not bool: True must come back as True
            return obj
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()

    def loads(self, data):
        try:
            return int(data)
        except (TypeError, ValueError):
            pass
        try:
            return json.loads(data)
        except (TypeError, ValueError, UnicodeDecodeError) as exc:
            raise UnreadableCacheValue(f"a cached value is not JSON ({type(exc).__name__}); it is ignored") from None


class _KeptClients(RedisCacheClient):
    """Django's Redis cache client, with one redis-py client per connection pool kept: Django made
    a new one for every cache call, and each copies redis-py's table of reply parsers (0.16 ms, as
    much as the round trip itself; every API request counts its rate through this cache)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._clients: dict[int, redis.Redis] = {}

    def get_client(self, key=None, *, write=False):
        pool = self._get_connection_pool(write)
        client = self._clients.get(id(pool))
        if client is None:  # a race makes two, one is kept: both work
            client = self._clients[id(pool)] = self._client(connection_pool=pool)
        return client


class CacheBoxRedisCache(RedisCache):
    """Django's RedisCache with JSON values whose ``clear()`` deletes only this cache's own keys.

    The server also holds the cache entries, the catalogs, the device registry and the
    Celery queues; the stock ``clear()`` (FLUSHDB) would delete all of them. A value that is not
    JSON reads as a miss (logged by the caller's fallback), never as code.
    """

    def __init__(self, server, params):
        options = dict(params.get("OPTIONS") or {})
        if options.get("serializer") not in (None, JSONSerializer, "dashboard.store.django_cache.JSONSerializer"):
            raise ImproperlyConfigured("CacheBoxRedisCache stores JSON only: leave OPTIONS['serializer'] out")
        options["serializer"] = JSONSerializer
        super().__init__(server, {**params, "OPTIONS": options})
        self._class = _KeptClients
        if not self.key_prefix:
            raise ImproperlyConfigured("CacheBoxRedisCache needs a KEY_PREFIX: it shares its server with the cache box")

    def get(self, key, default=None, version=None):
        try:
            return super().get(key, default, version)
        except UnreadableCacheValue:
            return default

    def count_and_read_unanswered(self, key: str, timeout: int, other: str) -> Callable[[], tuple[int, object]]:
        """Count one in ``key`` (made, at 0, to last ``timeout`` s when missing) and read ``other``, in
        one round trip sent at once; the returned function reads the count and ``other``'s value (None
        when it is missing or unreadable). Call it once, and always: it gives the connection back."""
        name, other_name = self.make_and_validate_key(key), self.make_and_validate_key(other)
        answers = self._unanswered(
            name, [("SET", name, 0, "EX", int(timeout), "NX"), ("INCR", name), ("GET", other_name)]
        )

        def counted() -> tuple[int, object]:
            _, count, value = answers()
            return int(count), self._value(value)

        return counted

    def read_unanswered(self, key: str) -> Callable[[], object]:
        """``get(key)`` sent at once; the returned function reads the value (None when missing or
        unreadable). Call it once, and always."""
        name = self.make_and_validate_key(key)
        answers = self._unanswered(name, [("GET", name)])
        return lambda: self._value(answers()[0])

    def _unanswered(self, name: str, commands: list[tuple]) -> Callable[[], list]:
        client = self._cache.get_client(name, write=True)
        return send_now_read_later(client.connection_pool, commands)

    def _value(self, raw: bytes | None) -> object:
        try:
            return None if raw is None else self._cache._serializer.loads(raw)
        except UnreadableCacheValue:
            return None

    def clear(self) -> bool:
        client = self._cache.get_client(None, write=True)
        batch = []
        prefix = re.sub(r"([\\*?\[\]])", r"\\\1", self.key_prefix)  # glob characters match themselves
        for name in client.scan_iter(match=f"{prefix}:*", count=1000):
            batch.append(name)
            if len(batch) >= 500:
                client.delete(*batch)
                batch.clear()
        if batch:
            client.delete(*batch)
        return True


class JSONLocMemCache(LocMemCache):
    """Django's per-process memory cache with JSON values instead of pickles (tests, and a
    deployment without a Redis URL for the cache)."""

    _serializer = JSONSerializer()

    def add(self, key, value, timeout=DEFAULT_TIMEOUT, version=None):
        key = self.make_and_validate_key(key, version=version)
        stored = self._serializer.dumps(value)
        with self._lock:
            if self._has_expired(key):
                self._set(key, stored, timeout)
                return True
            return False

    def get(self, key, default=None, version=None):
        key = self.make_and_validate_key(key, version=version)
        with self._lock:
            if self._has_expired(key):
                self._delete(key)
                return default
            stored = self._cache[key]
            self._cache.move_to_end(key, last=False)
        try:
            return self._serializer.loads(stored)
        except UnreadableCacheValue:
            return default

    def set(self, key, value, timeout=DEFAULT_TIMEOUT, version=None):
        key = self.make_and_validate_key(key, version=version)
        stored = self._serializer.dumps(value)
        with self._lock:
            self._set(key, stored, timeout)

    def incr(self, key, delta=1, version=None):
        key = self.make_and_validate_key(key, version=version)
        with self._lock:
            if self._has_expired(key):
                self._delete(key)
                raise ValueError(f"Key '{key}' not found")
            new_value = self._serializer.loads(self._cache[key]) + delta
            self._cache[key] = self._serializer.dumps(new_value)
            self._cache.move_to_end(key, last=False)
        return new_value

"""Django's cache on the cache box's Redis/Valkey server (see CACHES in settings)."""

from __future__ import annotations

import re

import redis

from django.core.cache.backends.redis import RedisCache
from django.core.exceptions import ImproperlyConfigured

# What a Django cache on a Redis server raises when that server fails (for callers that
# degrade instead of failing, such as the run rate limit): no code outside cachebox imports redis.
CACHE_SERVER_ERRORS = (redis.RedisError, OSError)


class CacheBoxRedisCache(RedisCache):
    """Django's RedisCache whose ``clear()`` deletes only this cache's own keys.

    The server also holds the cache entries, the catalogs, the device registry and the
    Celery queues; the stock ``clear()`` (FLUSHDB) would delete all of them.
    """

    def __init__(self, server, params):
        super().__init__(server, params)
        if not self.key_prefix:
            raise ImproperlyConfigured("CacheBoxRedisCache needs a KEY_PREFIX: it shares its server with the cache box")

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

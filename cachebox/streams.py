"""Following a run while a board answers it: async pub/sub for the control plane's API.

A board publishes each answer token of a streamed run on the run's channel
(``keys.stream_channel``, through ``CacheBox.publish``); the control plane's ASGI view
subscribes before it dispatches the run (a message published while nobody listens is
gone), reads the events as they come and, when its HTTP client goes away, sets the run's
cancel flag (``keys.cancel_key_name``) that the board checks between tokens. Pub/sub, not
polling and not the Celery queue: a token reaches the client one hop after it was chosen.

Typed errors as everywhere in this package: an unreachable server is
``CacheBoxUnavailable``, an error the server answered ``CacheBoxRefused``.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

import redis
import redis.asyncio as aioredis

from .errors import CacheBoxRefused, CacheBoxUnavailable

T = TypeVar("T")

_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


def _client(url: str, connect_timeout: float, timeout: float) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, socket_connect_timeout=connect_timeout, socket_timeout=timeout, health_check_interval=0)


async def _guarded(call: Awaitable[T], url: str) -> T:
    try:
        return await call
    except _UNREACHABLE as exc:
        raise CacheBoxUnavailable(f"cache box {_safe(url)} is unreachable: {exc}") from exc
    except redis.RedisError as exc:
        raise CacheBoxRefused(f"cache box {_safe(url)} refused the command: {type(exc).__name__}: {exc}") from exc


def _safe(url: str) -> str:
    """The URL without a password, for messages."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rsplit('@', 1)[-1]}" if rest else url


class Subscription:
    """One channel, subscribed for as long as the ``async with`` block lasts (its own connection)."""

    def __init__(self, url: str, channel: str, *, connect_timeout: float = 0.5, timeout: float = 5.0):
        self.url = url
        self.channel = channel
        self._client = _client(url, connect_timeout, timeout)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)

    async def open(self) -> "Subscription":
        """Subscribe (one round trip); messages published from now on are kept for ``get``."""
        try:
            await _guarded(self._pubsub.subscribe(self.channel), self.url)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> "Subscription":
        return await self.open()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def get(self, timeout: float) -> bytes | None:
        """The next message published on the channel, or None when none came within ``timeout`` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            message = await _guarded(self._pubsub.get_message(timeout=remaining), self.url)
            if message is not None and message.get("type") == "message":
                return message["data"]

    async def close(self) -> None:
        # Best effort and shielded: closing runs in a `finally` of a request that may be cancelled.
        try:
            await asyncio.shield(self._close())
        except (asyncio.CancelledError, redis.RedisError, OSError):
            pass

    async def _close(self) -> None:
        try:
            await self._pubsub.aclose()
        finally:
            await self._client.aclose()


def subscribe(url: str, channel: str, *, connect_timeout: float = 0.5, timeout: float = 5.0) -> Subscription:
    """``async with subscribe(url, channel) as stream: data = await stream.get(timeout)``."""
    return Subscription(url, channel, connect_timeout=connect_timeout, timeout=timeout)


async def set_flag(url: str, name: str, ttl: int, *, connect_timeout: float = 0.5, timeout: float = 5.0) -> None:
    """Set the flag key ``name`` for ``ttl`` seconds (a run's cancel flag); one connection, one round trip."""
    client = _client(url, connect_timeout, timeout)
    try:
        await _guarded(client.set(name, b"1", ex=max(1, int(ttl))), url)
    finally:
        await client.aclose()

"""Following a run while a board answers it: async pub/sub for the control plane's API.

A board publishes each answer token of a streamed run on the run's channel
(``keys.stream_channel``, through ``CacheBox.publish``); the control plane's ASGI view
subscribes before it dispatches the run (a message published while nobody listens is
gone), reads the events as they come and, when its HTTP client goes away, sets the run's
cancel flag (``keys.cancel_key_name``) that the board checks between tokens. Pub/sub, not
polling and not the Celery queue: a token reaches the client one hop after it was chosen.

Typed errors as everywhere in this package: an unreachable server is
``CacheBoxUnavailable``, an error the server answered ``CacheBoxRefused``.

On a cluster cache box (``redis+cluster://``) a subscription listens on the first node of the
URL that answers: a PUBLISH to any node reaches the subscribers of every node. A cancel flag
is a key, so it goes to the node of its slot (the node first asked names it, MOVED).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import MovedError

from .cluster import is_cluster_url, parse_cluster_url
from .errors import CacheBoxRefused, CacheBoxUnavailable
from .tls import client_options

T = TypeVar("T")

_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


def _client(url: str, connect_timeout: float, timeout: float) -> aioredis.Redis:
    return _clients(url, connect_timeout, timeout)[0]


def _clients(url: str, connect_timeout: float, timeout: float) -> list[aioredis.Redis]:
    """A client of the server, or one per node a cluster URL names (each a plain client of that node)."""
    options = dict(socket_connect_timeout=connect_timeout, socket_timeout=timeout, health_check_interval=0, **client_options(url))
    if not is_cluster_url(url):
        return [aioredis.Redis.from_url(url, **options)]
    address = parse_cluster_url(url)
    return [
        aioredis.Redis(host=host, port=port, username=address.username, password=address.password, ssl=address.tls, retry=Retry(NoBackoff(), 0), **options)
        for host, port in address.nodes
    ]


async def _guarded(call: Awaitable[T], url: str) -> T:
    try:
        return await call
    except _UNREACHABLE as exc:
        raise CacheBoxUnavailable(f"cache box {_safe(url)} is unreachable: {exc}") from exc
    except redis.RedisError as exc:
        raise CacheBoxRefused(f"cache box {_safe(url)} refused the command: {type(exc).__name__}: {exc}") from exc


def _safe(url: str) -> str:
    """The URL without a password, for messages."""
    if is_cluster_url(url):
        try:
            return parse_cluster_url(url).safe_url
        except ValueError:
            return url.split("://", 1)[0] + "://?"
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rsplit('@', 1)[-1]}" if rest else url


class Subscription:
    """One channel, subscribed for as long as the ``async with`` block lasts (its own connection)."""

    def __init__(self, url: str, channel: str, *, connect_timeout: float = 0.5, timeout: float = 5.0):
        self.url = url
        self.channel = channel
        self._candidates = _clients(url, connect_timeout, timeout)  # a cluster: one per node named
        self._client = self._candidates[0]
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)

    async def open(self) -> "Subscription":
        """Subscribe (one round trip); messages published from now on are kept for ``get``.
        On a cluster, a node that does not answer passes the subscription to the next one."""
        try:
            for index, client in enumerate(self._candidates):
                if client is not self._client:
                    await self._close()
                    self._client, self._pubsub = client, client.pubsub(ignore_subscribe_messages=True)
                try:
                    await _guarded(self._pubsub.subscribe(self.channel), self.url)
                    break
                except CacheBoxRefused:
                    raise
                except CacheBoxUnavailable:
                    if index == len(self._candidates) - 1:
                        raise
        except BaseException:
            await self.close()
            raise
        finally:
            for client in self._candidates:
                if client is not self._client:
                    await client.aclose()
        return self

    async def add(self, channel: str) -> None:
        """Listen on ``channel`` too, on the same connection (a run moved to another board)."""
        await _guarded(self._pubsub.subscribe(channel), self.url)
        self.channel = channel

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


async def set_flag(url: str, name: str, ttl: int, value: bytes = b"1", *, connect_timeout: float = 0.5, timeout: float = 5.0) -> None:
    """Set the flag key ``name`` to ``value`` for ``ttl`` seconds (a run's signed cancel flag); one
    connection, one round trip."""
    if is_cluster_url(url):
        await _guarded(_set_on_cluster(url, name, ttl, value, connect_timeout, timeout), url)
        return
    client = _client(url, connect_timeout, timeout)
    try:
        await _guarded(client.set(name, value, ex=max(1, int(ttl))), url)
    finally:
        await client.aclose()


async def _set_on_cluster(url: str, name: str, ttl: int, value: bytes, connect_timeout: float, timeout: float) -> None:
    # Asked of the first node that answers; one that does not serve the key's slot answers
    # MOVED with the node that does (one more round trip). No slot map to load for one SET.
    unreachable: Exception | None = None
    for client in _clients(url, connect_timeout, timeout):
        try:
            try:
                await client.set(name, value, ex=max(1, int(ttl)))
                return
            except MovedError as moved:
                address = parse_cluster_url(url)
                owner = aioredis.Redis(
                    host=moved.host, port=moved.port, username=address.username, password=address.password, ssl=address.tls,
                    socket_connect_timeout=connect_timeout, socket_timeout=timeout, retry=Retry(NoBackoff(), 0), **client_options(url),
                )
                try:
                    await owner.set(name, value, ex=max(1, int(ttl)))
                    return
                finally:
                    await owner.aclose()
            except _UNREACHABLE as exc:
                unreachable = exc
        finally:
            await client.aclose()
    raise unreachable or redis.ConnectionError("no node answered")

"""Following a run while a board answers it: async pub/sub for the control plane's API.

A board publishes each answer token of a streamed run on the run's channel
(``keys.stream_channel``, through ``CacheBox.publish``); the control plane's ASGI view
subscribes before it dispatches the run (a message published while nobody listens is
gone), on one connection its event loop shares for every run it follows, reads the events as they come and, when its HTTP client goes away, sets the run's
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

from cachebox.cluster import is_cluster_url, parse_cluster_url
from cachebox.errors import CacheBoxError, CacheBoxRefused, CacheBoxUnavailable
from cachebox.tls import client_options

T = TypeVar("T")

_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


def _client(url: str, connect_timeout: float, timeout: float) -> aioredis.Redis:
    return _clients(url, connect_timeout, timeout)[0]


def _clients(url: str, connect_timeout: float, timeout: float, retry: Retry | None = None) -> list[aioredis.Redis]:
    """A client of the server, or one per node a cluster URL names (each a plain client of that node)."""
    options = dict(
        socket_connect_timeout=connect_timeout, socket_timeout=timeout, health_check_interval=0, **client_options(url)
    )
    if not is_cluster_url(url):
        return [aioredis.Redis.from_url(url, **options, **({"retry": retry} if retry is not None else {}))]
    address = parse_cluster_url(url)
    return [
        aioredis.Redis(
            host=host,
            port=port,
            username=address.username,
            password=address.password,
            ssl=address.tls,
            retry=retry or Retry(NoBackoff(), 0),
            **options,
        )
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


class _Listener:
    """One pub/sub connection to a server (a cluster: the first node of its URL that answers),
    shared by every ``Subscription`` of one event loop: a run's channel is subscribed on it in one
    round trip instead of a connection of its own per request (a connect, and AUTH where there is a
    password). A reader task hands each message to the subscriptions of its channel. When the
    connection fails, every subscription on it hears ``CacheBoxUnavailable`` (nothing published
    while it was down can be replayed) and the next one connects afresh."""

    def __init__(self, url: str, connect_timeout: float, timeout: float):
        self.url = url
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self.loop = asyncio.get_running_loop()
        self.broken = False
        self._client: aioredis.Redis | None = None
        self._pubsub = None
        self._reader: asyncio.Task | None = None
        self._connecting = asyncio.Lock()
        self._members: dict[bytes, set["Subscription"]] = {}
        self._confirming: dict[bytes, list[asyncio.Future]] = {}

    async def _connect(self) -> None:
        async with self._connecting:
            if self._pubsub is not None or self.broken:
                return
            # No silent reconnect: what was published meanwhile is lost, so the followers must hear it.
            candidates = _clients(self.url, self.connect_timeout, self.timeout, retry=Retry(NoBackoff(), 0))
            try:
                for index, client in enumerate(candidates):
                    pubsub = client.pubsub()
                    try:
                        await _guarded(pubsub.connect(), self.url)
                    except CacheBoxRefused:
                        raise
                    except CacheBoxUnavailable:  # a cluster node that does not answer passes to the next
                        await pubsub.aclose()
                        if index == len(candidates) - 1:
                            raise
                        continue
                    self._client, self._pubsub = client, pubsub
                    break
            finally:
                for client in candidates:
                    if client is not self._client:
                        await client.aclose()
            self._reader = self.loop.create_task(self._read(), name=f"edgecache-streams-{_safe(self.url)}")

    async def join(self, member: "Subscription", channel: str) -> None:
        """``member`` hears ``channel`` from now on (the server confirmed the subscription)."""
        await self._connect()
        name = channel.encode()
        members = self._members.setdefault(name, set())
        members.add(member)
        if len(members) > 1 and name not in self._confirming:
            return  # subscribed already, for another follower of the same run
        confirmed = self.loop.create_future()
        waiting = self._confirming.setdefault(name, [])
        waiting.append(confirmed)
        try:
            if len(waiting) == 1:
                await _guarded(self._pubsub.subscribe(name), self.url)
            await asyncio.wait_for(asyncio.shield(confirmed), self.connect_timeout + self.timeout)
        except (asyncio.TimeoutError, CacheBoxError) as exc:
            self.leave(member, channel)
            if isinstance(exc, asyncio.TimeoutError):
                self._fail(
                    CacheBoxUnavailable(
                        f"cache box {_safe(self.url)} did not confirm a subscription within {self.connect_timeout + self.timeout:g} s"
                    )
                )
                raise CacheBoxUnavailable(f"cache box {_safe(self.url)} did not confirm a subscription") from None
            raise

    def leave(self, member: "Subscription", channel: str) -> None:
        name = channel.encode()
        members = self._members.get(name)
        if members is None:
            return
        members.discard(member)
        if not members:
            del self._members[name]
            if not self.broken and self._pubsub is not None:
                self.loop.create_task(self._unsubscribe(name))

    async def _unsubscribe(self, name: bytes) -> None:
        if name in self._members:
            return  # followed again meanwhile
        try:
            await self._pubsub.unsubscribe(name)
        except (redis.RedisError, OSError) as exc:
            self._fail(CacheBoxUnavailable(f"cache box {_safe(self.url)} is unreachable: {exc}"))

    async def _read(self) -> None:
        try:
            while True:
                message = await self._pubsub.get_message(timeout=None)
                if message is None:
                    continue
                kind, name = message.get("type"), message.get("channel")
                if kind == "message":
                    for member in tuple(self._members.get(name, ())):
                        member._queue.put_nowait(message["data"])
                elif kind == "subscribe":
                    for confirmed in self._confirming.pop(name, ()):
                        if not confirmed.done():
                            confirmed.set_result(True)
        except asyncio.CancelledError:
            self._fail(CacheBoxUnavailable(f"stopped following cache box {_safe(self.url)}"))
            await self._close()
            raise
        except (redis.RedisError, OSError, RuntimeError) as exc:
            self._fail(CacheBoxUnavailable(f"cache box {_safe(self.url)} is unreachable: {exc}"))
            await self._close()

    def _fail(self, error: CacheBoxUnavailable) -> None:
        """Every follower hears ``error``; the next subscription connects afresh."""
        self.broken = True
        if _LISTENERS.get((self.loop, self.url)) is self:
            del _LISTENERS[(self.loop, self.url)]
        for waiting in self._confirming.values():
            for confirmed in waiting:
                if not confirmed.done():
                    confirmed.set_exception(error)
        self._confirming.clear()
        for members in self._members.values():
            for member in members:
                member._queue.put_nowait(error)
        self._members.clear()
        if self._reader is not None and asyncio.current_task() is not self._reader:
            self._reader.cancel()

    async def _close(self) -> None:
        try:
            if self._pubsub is not None:
                await self._pubsub.aclose()
            if self._client is not None:
                await self._client.aclose()
        except (redis.RedisError, OSError, RuntimeError):
            pass


_LISTENERS: dict[tuple[asyncio.AbstractEventLoop, str], _Listener] = {}


def _listener(url: str, connect_timeout: float, timeout: float) -> _Listener:
    loop = asyncio.get_running_loop()
    for key in [key for key in _LISTENERS if key[0].is_closed()]:
        del _LISTENERS[key]
    found = _LISTENERS.get((loop, url))
    if found is None or found.broken:
        found = _LISTENERS[(loop, url)] = _Listener(url, connect_timeout, timeout)
    return found


class Subscription:
    """One run's channel, followed for as long as the ``async with`` block lasts, on its event
    loop's shared connection to the server (``_Listener``)."""

    def __init__(self, url: str, channel: str, *, connect_timeout: float = 0.5, timeout: float = 5.0):
        self.url = url
        self.channel = channel
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self._listener: _Listener | None = None
        self._channels: list[str] = []
        self._queue: asyncio.Queue = asyncio.Queue()

    async def open(self) -> "Subscription":
        """Subscribe (one round trip on the shared connection, a connect first when there is none):
        messages published from now on are kept for ``get``. On a cluster, a node that does not
        answer passes the connection to the next one."""
        self._listener = _listener(self.url, self.connect_timeout, self.timeout)
        await self.add(self.channel)
        return self

    async def add(self, channel: str) -> None:
        """Listen on ``channel`` too (a run moved to another board)."""
        if self._listener is None or self._listener.broken:
            raise CacheBoxUnavailable(f"lost cache box {_safe(self.url)} while following {self.channel}")
        await self._listener.join(self, channel)
        self._channels.append(channel)
        self.channel = channel

    async def __aenter__(self) -> "Subscription":
        return await self.open()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def get(self, timeout: float) -> bytes | None:
        """The next message published on the channel, or None when none came within ``timeout`` s;
        CacheBoxUnavailable when the connection was lost."""
        try:
            if not self._queue.empty() or timeout <= 0:
                item = self._queue.get_nowait()
            else:
                # A deadline on this task, not ``wait_for``'s task of its own around the get: one
                # task and one turn of the loop fewer between a token's arrival and its chunk.
                async with asyncio.timeout(timeout):
                    item = await self._queue.get()
        except (asyncio.TimeoutError, asyncio.QueueEmpty):
            return None
        if isinstance(item, CacheBoxUnavailable):
            raise item
        return item

    async def close(self) -> None:
        """Stop following (no round trip waited for: the shared connection unsubscribes behind)."""
        if self._listener is not None:
            for channel in self._channels:
                self._listener.leave(self, channel)
        self._channels = []


def subscribe(url: str, channel: str, *, connect_timeout: float = 0.5, timeout: float = 5.0) -> Subscription:
    """``async with subscribe(url, channel) as stream: data = await stream.get(timeout)``."""
    return Subscription(url, channel, connect_timeout=connect_timeout, timeout=timeout)


async def set_flag(
    url: str, name: str, ttl: int, value: bytes = b"1", *, connect_timeout: float = 0.5, timeout: float = 5.0
) -> None:
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
                    host=moved.host,
                    port=moved.port,
                    username=address.username,
                    password=address.password,
                    ssl=address.tls,
                    socket_connect_timeout=connect_timeout,
                    socket_timeout=timeout,
                    retry=Retry(NoBackoff(), 0),
                    **client_options(url),
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

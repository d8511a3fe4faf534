"""The cache box store: entries and the master catalog in Redis/Valkey.

A thin adapter over redis-py (with the hiredis parser, which decides whether a
hit costs 3 ms or 40 ms). Every call is bounded by socket timeouts and turns every
redis failure into ``CacheBoxUnavailable``: a connection failure (which also makes
the client skip the network for ``retry_after`` seconds) or, as ``CacheBoxRefused``,
an error the server answered with (OOM at maxmemory, WRONGTYPE). A board that sees
either answers from local prefill. Nothing outside this package touches ``.redis``.

A cluster URL (``redis+cluster://host:port[,host:port...]``, see ``cluster.py``) spreads the
entries over a Redis/Valkey Cluster. Each command then goes to the node that serves its key's
slot, multi-key work as one pipeline per node, and a node that does not answer costs only its
own keys: they read as missing (a miss, local prefill) and the node is skipped for
``retry_after`` seconds, while every other node keeps serving. A call raises only when none of
the nodes it needed answered.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import redis
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

from . import quota
from .cluster import TOPOLOGY_ERRORS, cluster_client, is_cluster_url, parse_cluster_url
from .errors import CacheBoxOverQuota, CacheBoxRefused, CacheBoxUnavailable, CatalogFormatError
from .keys import catalog_key_names, device_key_name, entry_key_pattern, producers_key_name, schema_key_pattern
from .link import LinkProfile
from .shaping import LinkShaper, ShapedConnection, ShapedSSLConnection
from .tls import client_options, is_tls_url

# The server could not be reached: back off. Any other redis.RedisError is an answer
# (OOM, WRONGTYPE, NOPERM, a wrong password, ...): typed too, but the next call may go to the
# network at once. (redis-py raises a refused AUTH as a ConnectionError: it is checked first.)
_NOT_ALLOWED = (redis.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)
# A cluster node that answers "not now" for its slots (cluster down, slot migrating): its keys
# are missing for this call, the node is not skipped (MOVED is handled: the slot map is reloaded).
_NODE_NOT_SERVING = (ClusterDownError, TryAgainError)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Log entries kept in the catalog stream before boards fold them into the snapshot.
CATALOG_LOG_MAXLEN = 200_000


def send_now_read_later(pool: redis.ConnectionPool, commands: Sequence[Sequence]) -> Callable[[], list]:
    """Send ``commands`` (each a command's words) at once on one of ``pool``'s connections, without
    waiting for the answers; the returned function reads them (one per command) and gives the
    connection back. Call it once, and always. The round trip then runs beside whatever the caller
    does in between. An error answer raises there (``redis.ResponseError``), as a lost connection
    does; the connection is then dropped, never reused with answers unread. Raises redis's errors
    (the callers map them to their own)."""
    connection = pool.get_connection()
    try:
        connection.send_packed_command(connection.pack_commands(commands))
    except BaseException:
        pool.release(connection)
        raise
    read: list = []  # [answers] or [None, the error]: read once, whatever happens

    def answers() -> list:
        if not read:
            try:
                read.append([connection.read_response() for _ in commands])
            except BaseException as exc:
                read.extend((None, exc))
                connection.disconnect()
            finally:
                pool.release(connection)
        if read[0] is None:
            raise read[1]
        return read[0]

    return answers


class CacheBox:
    """Client side of one cache box (a Redis/Valkey server)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 0.5,
        timeout: float = 5.0,
        retry_after: float = 2.0,
        link: LinkProfile | None = None,
    ):
        self.url = url
        self.retry_after = retry_after
        self.link = link
        self._down_until = 0.0
        self._limits: quota.Limits | None = None  # what load_functions loaded, if this client loaded it
        options = dict(
            socket_connect_timeout=connect_timeout,
            socket_timeout=timeout,
            retry_on_timeout=False,
            health_check_interval=0,
            **client_options(url),
        )
        # A cluster URL: the client connects (loads the slot map) at first use, so that a board
        # starts while the cluster is away, like with one server.
        self.cluster = parse_cluster_url(url) if is_cluster_url(url) else None
        self._node_down_until: dict[str, float] = {}  # cluster nodes skipped after a failure
        self._client_lock = threading.Lock()
        self._redis: redis.Redis | redis.RedisCluster | None = None
        if self.cluster is not None:
            # The same timeouts reach every node's connections (and one paced link is shared by all).
            self._cluster_options = dict(
                socket_connect_timeout=connect_timeout, socket_timeout=timeout, **client_options(url)
            )
            if link is not None:
                self._cluster_options["connection_class"] = _shaped_connection_class(
                    LinkShaper(link), tls=self.cluster.tls
                )
        elif link is not None and not url.startswith("unix"):
            # Emulated link: every connection of this client shares one paced link.
            connection_class = ShapedSSLConnection if is_tls_url(url) else ShapedConnection
            pool = redis.ConnectionPool.from_url(
                url, connection_class=connection_class, shaper=LinkShaper(link), **options
            )
            self._redis = redis.Redis(connection_pool=pool)
        else:
            self._redis = redis.Redis.from_url(url, **options)

    @property
    def redis(self) -> redis.Redis | redis.RedisCluster:
        """The redis-py client: ``redis.Redis``, or ``redis.RedisCluster`` for a cluster URL (which
        connects on first use and then raises redis-py's errors if no node answers)."""
        if self._redis is None:
            with self._client_lock:
                if self._redis is None:
                    self._redis = cluster_client(self.cluster, **self._cluster_options)
        return self._redis

    @property
    def link_label(self) -> str:
        """How this client reaches the cache box, for every figure taken through it."""
        if self.link is None:
            return "unshaped"
        if self.link.bandwidth_mbps == float("inf"):  # the network shapes the bandwidth; the socket adds the round trip
            return self.link.label or f"{self.link.rtt_ms:g} ms RTT added per round trip"
        return f"emulated link {self.link.bandwidth_mbps:g} Mbit/s, {self.link.rtt_ms:g} ms RTT"

    # -- availability -------------------------------------------------------------
    def _guard(self) -> None:
        # After a failure, skip the network for `retry_after` seconds so that a dead
        # cache box costs every request nothing, not a connect timeout each time.
        if time.monotonic() < self._down_until:
            raise CacheBoxUnavailable(f"cache box {self.safe_url} was unreachable moments ago")

    def _failed(self, exc: Exception) -> CacheBoxUnavailable:
        self._down_until = time.monotonic() + self.retry_after
        return CacheBoxUnavailable(f"cache box {self.safe_url} is unreachable: {exc}")

    def _refused(self, exc: redis.RedisError) -> CacheBoxRefused:
        # No back-off: the server is up; a full memory or one bad key must not
        # cut every other request off the cache box for `retry_after` seconds.
        refused = quota.refusal(str(exc))
        if refused is not None:
            return CacheBoxOverQuota(
                f"cache box {self.safe_url} refused the write ({refused[0]}): {refused[1]}", refused[0]
            )
        return CacheBoxRefused(f"cache box {self.safe_url} refused the command: {type(exc).__name__}: {exc}")

    @property
    def safe_url(self) -> str:
        """The URL without any password, for messages."""
        if self.cluster is not None:
            return self.cluster.safe_url
        kwargs = self.redis.connection_pool.connection_kwargs
        if "path" in kwargs:
            return f"unix://{kwargs['path']}"
        return f"redis://{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"

    def ping(self) -> bool:
        """True when the server answers now (ignores the recent-failure guard); for a cluster,
        when some node answers."""
        try:
            if self.cluster is not None:
                return any(self._ping_node(node) for node in self.redis.get_primaries())
            return bool(self.redis.ping())
        except (
            redis.RedisError,
            OSError,
            *TOPOLOGY_ERRORS,
        ):  # unreachable, or answering with an error (LOADING, NOAUTH)
            return False

    def _ping_node(self, node) -> bool:
        try:
            return bool(self.redis.get_redis_connection(node).ping())
        except (redis.RedisError, OSError):
            return False

    def _run(self, func):
        self._guard()
        try:
            return func()
        except _NOT_ALLOWED as exc:  # a wrong user or password: an answer, not an outage
            raise self._refused(exc) from exc
        except _UNREACHABLE as exc:
            raise self._failed(exc) from exc
        except redis.RedisError as exc:
            raise self._refused(exc) from exc

    def _scan(self, pattern: str) -> Iterator[str]:
        # A generator cannot use _run: each page of SCAN is its own round trip.
        if self.cluster is not None:
            # Each primary holds part of the keys: one walk per node. Strict: a listing with a
            # node left out would let a flush or a reconcile believe it saw every entry.
            for node in self._topology().get_primaries():
                yield from self._scan_node(node, pattern)
            return
        self._guard()
        try:
            for name in self.redis.scan_iter(match=pattern, count=1000):
                yield name.decode()
        except _NOT_ALLOWED as exc:
            raise self._refused(exc) from exc
        except _UNREACHABLE as exc:
            raise self._failed(exc) from exc
        except redis.RedisError as exc:
            raise self._refused(exc) from exc

    # -- routing: which server a command goes to (one, or the cluster node of each key) --------
    def _on_key(self, name: str, func: Callable[[redis.Redis], T]) -> T:
        """``func(client)`` on the server that holds key ``name`` (on a cluster: its slot's node)."""
        if self.cluster is None:
            return self._run(lambda: func(self.redis))
        for attempt in (1, 2):
            client = self._topology()
            try:
                return self._on_node(self._node_of(client, name), func)
            except MovedError as exc:  # the cluster was resharded: reload the slot map, once
                if attempt == 2:
                    raise self._refused(exc) from exc
                self._reload_slots()
        raise AssertionError("unreachable")

    def _on_any_node(self, func: Callable[[redis.Redis], T]) -> T:
        """``func(client)`` for a command of no key (PUBLISH): on a cluster, the first node that answers
        (a PUBLISH reaches the subscribers of every node)."""
        if self.cluster is None:
            return self._run(lambda: func(self.redis))
        failure: CacheBoxUnavailable | None = None
        for node in self._topology().get_primaries():
            try:
                return self._on_node(node, func)
            except CacheBoxRefused:
                raise
            except CacheBoxUnavailable as exc:
                failure = exc
        raise failure or CacheBoxUnavailable(f"cache box {self.safe_url} lists no node")

    def _batch(
        self,
        items: Sequence[T],
        name_of: Callable[[T], str],
        queue: Callable[[object, T], None],
        width: int = 1,
        *,
        raise_on_error: bool = True,
    ) -> list[list | None]:
        """Pipeline ``queue(pipe, item)`` (``width`` commands each) for every item; each item's replies.

        One round trip with one server. On a cluster no command spans two slots: one pipeline
        (one round trip) per node holding some of the items, in turn; the items of a node that
        does not answer get None (the caller reads them as missing), and the call raises only
        when no node answered.
        """

        def run(client: redis.Redis, chosen: Sequence[T]) -> list[list]:
            pipe = client.pipeline(transaction=False)
            for item in chosen:
                queue(pipe, item)
            flat = pipe.execute(raise_on_error=raise_on_error)
            if not raise_on_error and any(
                isinstance(reply, redis.ResponseError) and "Function not found" in str(reply) for reply in flat
            ):
                raise next(
                    reply
                    for reply in flat
                    if isinstance(reply, redis.ResponseError) and "Function not found" in str(reply)
                )
            return [flat[i * width : (i + 1) * width] for i in range(len(chosen))]

        if not items:
            return []
        if self.cluster is None:
            return self._run(lambda: run(self.redis, items))
        results: list[list | None] = [None] * len(items)
        pending = list(range(len(items)))
        failures: list[CacheBoxUnavailable] = []
        for attempt in (1, 2):
            client = self._topology()
            groups: dict[str, tuple[object, list[int]]] = {}
            for index in pending:
                node = self._node_of(client, name_of(items[index]))
                groups.setdefault(node.name, (node, []))[1].append(index)
            moved: list[int] = []
            for node, indices in groups.values():
                try:
                    replies = self._on_node(node, lambda node_client: run(node_client, [items[i] for i in indices]))
                except MovedError as exc:  # resharded under us: reload the slot map and redo these, once
                    if attempt == 2:
                        raise self._refused(exc) from exc
                    moved.extend(indices)
                    continue
                except CacheBoxRefused:
                    raise
                except CacheBoxUnavailable as exc:
                    failures.append(exc)
                    continue
                for index, reply in zip(indices, replies):
                    results[index] = reply
            if not moved:
                break
            self._reload_slots()
            pending = moved
        if failures and all(reply is None for reply in results):
            raise failures[0]
        return results

    def _topology(self) -> redis.RedisCluster:
        """The cluster client and its slot map (loaded at first use; reloaded before a node that
        failed is tried again, since a replica may have taken its slots over)."""
        self._guard()
        try:
            client = self.redis
            now = time.monotonic()
            expired = [name for name, until in list(self._node_down_until.items()) if until <= now]
            if expired:
                for name in expired:
                    self._node_down_until.pop(name, None)
                client.nodes_manager.initialize()
            return client
        except _NOT_ALLOWED as exc:
            raise self._refused(exc) from exc
        except (*_UNREACHABLE, *TOPOLOGY_ERRORS) as exc:
            raise self._failed(exc) from exc
        except redis.RedisError as exc:
            raise self._refused(exc) from exc

    def _reload_slots(self) -> None:
        try:
            self.redis.nodes_manager.initialize()
        except (*_UNREACHABLE, *TOPOLOGY_ERRORS) as exc:
            raise self._failed(exc) from exc

    def _node_of(self, client: redis.RedisCluster, name: str):
        try:
            return client.nodes_manager.get_node_from_slot(client.keyslot(name))
        except TOPOLOGY_ERRORS as exc:  # a slot no node serves
            raise CacheBoxUnavailable(f"cache box {self.safe_url}: no node serves the slot of {name!r}: {exc}") from exc

    def _on_node(self, node, func: Callable[[redis.Redis], T]) -> T:
        """``func(client of one cluster node)`` with typed errors; a node that fails is skipped
        for ``retry_after`` seconds (its keys read as missing meanwhile, at no network cost).
        MovedError passes through: the caller reloads the slot map."""
        if time.monotonic() < self._node_down_until.get(node.name, 0.0):
            raise CacheBoxUnavailable(f"cache box node {node.name} was unreachable moments ago")
        try:
            return func(self.redis.get_redis_connection(node))
        except _NOT_ALLOWED as exc:
            raise self._refused(exc) from exc
        except _UNREACHABLE as exc:
            self._node_down_until[node.name] = time.monotonic() + self.retry_after
            log.warning(
                "cache box node %s of %s is unreachable, its entries are misses for %g s: %s",
                node.name,
                self.safe_url,
                self.retry_after,
                exc,
            )
            raise CacheBoxUnavailable(f"cache box node {node.name} of {self.safe_url} is unreachable: {exc}") from exc
        except MovedError:
            raise
        except (AskError, *_NODE_NOT_SERVING) as exc:
            raise CacheBoxUnavailable(f"cache box node {node.name} does not serve its slots now: {exc}") from exc
        except redis.RedisError as exc:
            raise self._refused(exc) from exc

    def _scan_node(self, node, pattern: str) -> Iterator[str]:
        if time.monotonic() < self._node_down_until.get(node.name, 0.0):
            raise CacheBoxUnavailable(f"cache box node {node.name} was unreachable moments ago")
        try:
            for name in self.redis.get_redis_connection(node).scan_iter(match=pattern, count=1000):
                yield name.decode()
        except _UNREACHABLE as exc:
            self._node_down_until[node.name] = time.monotonic() + self.retry_after
            raise CacheBoxUnavailable(f"cache box node {node.name} of {self.safe_url} is unreachable: {exc}") from exc
        except redis.RedisError as exc:
            raise self._refused(exc) from exc

    # -- entries ----------------------------------------------------------------
    def put_entries(self, items: Sequence[tuple[str, bytes]], ttl: int | None = None) -> int:
        """Store entries (name, blob) in one round trip through the cache box's ``ec_put`` function
        (``cachebox.quota``: size cap, TTL, the namespace's budget); returns bytes written.

        Entries expire after ``ttl`` seconds (None: the longest TTL the library allows) and, under
        ``volatile-lru``, are what the server evicts first when full; only the control plane pins
        an entry (no TTL). CacheBoxOverQuota when the function refused one of them (the others of
        the batch are stored; the refused one is not). On a cluster, the entries of a node that
        does not answer are not written (not counted).
        """
        seconds = str(int(ttl)) if ttl else "max"

        def queue(pipe, item):
            if _is_entry(item[0]):
                pipe.fcall(quota.PUT, 1, item[0], item[1], seconds)
            else:  # a key outside every namespace (the lab's own key space): the caller's own write, with a TTL
                pipe.psetex(item[0], int(ttl or 3600) * 1000, item[1])

        replies = self._with_functions(lambda: self._batch(items, lambda item: item[0], queue, raise_on_error=False))
        refused = [reply[0] for reply in replies if reply is not None and isinstance(reply[0], Exception)]
        if refused:
            raise self._refused(refused[0])
        return sum(len(blob) for (_, blob), reply in zip(items, replies) if reply is not None)

    def read_prefixes(self, names: Sequence[str], length: int) -> list[bytes]:
        """First ``length`` bytes of each entry (b"" where the key does not exist)."""
        replies = self._batch(names, str, lambda pipe, name: pipe.getrange(name, 0, length - 1))
        return [reply[0] if reply is not None else b"" for reply in replies]

    def read_heads(self, names: Sequence[str], length: int) -> list[tuple[bytes, int]]:
        """(first ``length`` bytes, whole size) of each entry in one round trip; (b"", 0) where missing.

        The size lets a board refuse an entry larger than its header says, or than its
        limits, before downloading it.
        """

        def queue(pipe, name):
            pipe.getrange(name, 0, length - 1)
            pipe.strlen(name)

        replies = self._batch(names, str, queue, width=2)
        return [(reply[0], int(reply[1])) if reply is not None else (b"", 0) for reply in replies]

    def sizes(self, names: Sequence[str]) -> list[int]:
        """Stored size of each entry in one round trip (0 where missing)."""
        replies = self._batch(names, str, lambda pipe, name: pipe.strlen(name))
        return [int(reply[0]) if reply is not None else 0 for reply in replies]

    def read_entries(self, names: Sequence[str]) -> list[bytes | None]:
        """Whole entries in one round trip (None where missing).

        GET rather than GETRANGE from the state offset: the server sends a stored
        value as it is, but copies a range first (about 3x slower for 1 MB values).
        """
        replies = self._batch(names, str, lambda pipe, name: pipe.get(name))
        return [reply[0] if reply is not None else None for reply in replies]

    def pin(self, names: Iterable[str]) -> int:
        """Keep entries until unpinned: no TTL, so LRU eviction passes them by."""
        replies = self._batch(list(names), str, lambda pipe, name: pipe.persist(name))
        return sum(1 for reply in replies if reply is not None and reply[0])

    def unpin(self, names: Iterable[str], ttl: int) -> int:
        """Make entries evictable again (they expire after ``ttl`` seconds unless used)."""
        replies = self._batch(list(names), str, lambda pipe, name: pipe.expire(name, ttl))
        return sum(1 for reply in replies if reply is not None and reply[0])

    def touch(self, names: Iterable[str], ttl: int) -> None:
        """Restart the TTL of entries just used (pinned entries, with no TTL, stay pinned), through
        the ``ec_touch`` function (a TTL within the library's bound; the ledger follows)."""
        seconds = str(int(ttl)) if ttl else "max"
        self._with_functions(
            lambda: self._batch(list(names), str, lambda pipe, name: pipe.fcall(quota.TOUCH, 1, name, seconds))
        )

    def delete(self, names: Iterable[str]) -> int:
        """Delete keys; returns how many existed. One round trip (a cluster: one pipeline per node,
        since one DEL may not name keys of two slots). Entries go through the ``ec_del`` function,
        which gives their bytes back to the namespace's budget."""
        names = [name.decode() if isinstance(name, bytes) else name for name in names]  # as SCAN gives them, or str
        if not names:
            return 0
        entries = [name for name in names if _is_entry(name)]
        others = [name for name in names if not _is_entry(name)]
        removed = 0
        if entries:
            replies = self._with_functions(
                lambda: self._batch(entries, str, lambda pipe, name: pipe.fcall(quota.DELETE, 1, name))
            )
            removed += sum(int(reply[0]) for reply in replies if reply is not None)
        if others and self.cluster is None:
            removed += self._run(lambda: self.redis.delete(*others))
        elif others:
            removed += sum(
                int(reply[0])
                for reply in self._batch(others, str, lambda pipe, name: pipe.delete(name))
                if reply is not None
            )
        return removed

    def exists(self, names: Sequence[str]) -> list[bool]:
        """Whether each key exists, in one round trip."""
        replies = self._batch(names, str, lambda pipe, name: pipe.exists(name))
        return [bool(reply[0]) if reply is not None else False for reply in replies]

    def pop_oldest(self, name: str, count: int) -> list[bytes]:
        """Up to ``count`` items of the list ``name`` that producers push on the left, oldest first,
        taken off it (one RPOP; several consumers never get the same item)."""
        return self._on_key(name, lambda client: client.rpop(name, count)) or []

    def pop_from_any(self, names: Sequence[str], count: int, wait_s: float) -> tuple[str, list[bytes]] | None:
        """Up to ``count`` oldest items of the first non-empty list of ``names`` (in the order given),
        taken off it, waiting up to ``wait_s`` seconds for one (one BLMPOP: several consumers never
        get the same item); None when every list stayed empty. Lists of one server (not a cluster):
        a caller that wants fairness rotates ``names`` between calls."""
        if not names:
            return None
        reply = self._run(lambda: self.redis.blmpop(wait_s, len(names), *names, direction="RIGHT", count=count))
        if not reply:
            return None
        name, items = reply
        return (name.decode() if isinstance(name, bytes) else name), list(items)

    def ttls(self, names: Sequence[str]) -> list[int]:
        """Seconds each key has left, in one round trip: -1 no TTL (pinned), -2 missing."""
        replies = self._batch(names, str, lambda pipe, name: pipe.ttl(name))
        return [int(reply[0]) if reply is not None else -2 for reply in replies]

    def scan_entries(self, namespace: str | None = None, fingerprint: str | None = None) -> Iterator[str]:
        """Yield entry key names (str) of a namespace and/or model.

        One round trip per 1000 keys the server holds: SCAN walks all of them, matching or not.
        """
        return self._scan(entry_key_pattern(namespace, fingerprint))

    def scan_schema_entries(self, schema_digest: str) -> Iterator[str]:
        """Yield the key names (str) of every module entry of one schema version (any namespace,
        any model); costs what ``scan_entries`` costs."""
        return self._scan(schema_key_pattern(schema_digest))

    def flush(self, namespace: str | None = None, fingerprint: str | None = None) -> int:
        """Delete the entries of a namespace and/or model; with a namespace, its catalog and its budget's ledger too."""
        removed = 0
        batch: list[str] = []
        for name in self.scan_entries(namespace, fingerprint):
            batch.append(name)
            if len(batch) >= 500:
                removed += self.delete(batch)
                batch = []
        removed += self.delete(batch)
        if namespace and fingerprint is None:
            self.delete(
                [*catalog_key_names(namespace).values(), *self._scan(quota.quota_key_pattern(namespace))]
            )  # and its budget
        return removed

    # -- master catalog ---------------------------------------------------------------
    def catalog_epoch(self, namespace: str, new_epoch: str) -> str:
        """The namespace's catalog epoch, created as ``new_epoch`` if the cache box has none
        (``ec_cat_epoch``: with a TTL, renewed at each call).

        The epoch changes only when the cache box loses its catalog (restarted empty,
        flushed, or every board of the namespace away for longer than the longest entry TTL):
        boards then drop their local filters instead of trusting stale bits.
        """
        name = catalog_key_names(namespace)["epoch"]
        reply = self._with_functions(
            lambda: self._on_key(name, lambda client: client.fcall(quota.CATALOG_EPOCH, 1, name, new_epoch))
        )
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def catalog_append(self, namespace: str, keys: Sequence[bytes]) -> None:
        """Announce new entry keys to every board (one stream record per 16-byte key; ``ec_cat_append``
        keeps the log to its length and gives it a TTL)."""
        name = catalog_key_names(namespace)["log"]
        if keys:
            self._with_functions(
                lambda: self._on_key(name, lambda client: client.fcall(quota.CATALOG_APPEND, 1, name, *keys))
            )

    def catalog_read_log(self, namespace: str, after_id: str, count: int = 10_000) -> list[tuple[str, bytes]]:
        """Keys announced after stream id ``after_id`` ("0" for all), oldest first."""
        name = catalog_key_names(namespace)["log"]
        records = self._on_key(
            name, lambda client: client.xrange(name, min=f"({after_id}" if after_id != "0" else "-", count=count)
        )
        return [(rid.decode(), fields.get(b"k", b"")) for rid, fields in records]

    def catalog_log_first_id(self, namespace: str) -> str | None:
        name = catalog_key_names(namespace)["log"]
        first = self._on_key(name, lambda client: client.xrange(name, count=1))
        return first[0][0].decode() if first else None

    def catalog_snapshot(self, namespace: str, max_bytes: int | None = None) -> tuple[bytes | None, str, str]:
        """(filter bytes, last log id folded into them, epoch) of the master copy.

        ``max_bytes``: its size is read first (HSTRLEN, one round trip) and a larger snapshot is never
        fetched: CatalogFormatError says so (anyone who may write the namespace's catalog may plant one
        of hundreds of MB). The size and the read are one transaction (WATCH): a snapshot replaced
        between them is not read this time (None)."""
        name = catalog_key_names(namespace)["snapshot"]
        if max_bytes is None:
            doc = self._on_key(name, lambda client: client.hgetall(name))
            return doc.get(b"bloom"), (doc.get(b"last_id") or b"0").decode(), (doc.get(b"epoch") or b"").decode()

        def read(client) -> tuple[int, list]:
            with client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(name)
                    size = int(pipe.hstrlen(name, "bloom"))
                    if size > max_bytes:
                        pipe.unwatch()
                        return size, [None, None, None]
                    pipe.multi()
                    for field in ("bloom", "last_id", "epoch"):
                        pipe.hget(name, field)
                    return size, pipe.execute()
                except redis.WatchError:
                    return 0, [None, None, None]

        size, (bloom, last_id, epoch) = self._on_key(name, read)
        if size > max_bytes:
            raise CatalogFormatError(
                f"the master snapshot holds {size} bytes, over the {max_bytes} a catalog of this namespace's size takes: not fetched"
            )
        return bloom, (last_id or b"0").decode(), (epoch or b"").decode()

    def catalog_put_snapshot(self, namespace: str, bloom: bytes, last_id: str, epoch: str) -> bool:
        """Replace the master copy if it is older than ``last_id`` and of the live epoch; trims the
        folded log. One atomic call (``ec_cat_snapshot``: a size cap, a TTL, counted in the
        namespace's budget)."""
        names = catalog_key_names(namespace)
        keys = (names["snapshot"], names["epoch"], names["log"])
        # The namespace's catalog keys share one hash tag: one node, one call.
        reply = self._with_functions(
            lambda: self._on_key(
                names["snapshot"], lambda client: client.fcall(quota.CATALOG_SNAPSHOT, 3, *keys, bloom, last_id, epoch)
            )
        )
        return bool(int(reply))

    def catalog_drop_snapshot(self, namespace: str) -> None:
        """Delete the master snapshot (an unreadable one); the log and the epoch stay. One round trip."""
        name = catalog_key_names(namespace)["snapshot"]
        self._with_functions(lambda: self._on_key(name, lambda client: client.fcall(quota.CATALOG_DROP, 1, name)))

    def catalog_replace(self, namespace: str, bloom: bytes, epoch: str) -> None:
        """Install a rebuilt master catalog under a new epoch and drop the old log."""
        names = catalog_key_names(namespace)

        def replace(client):
            pipe = client.pipeline(transaction=True)
            pipe.delete(names["log"])
            pipe.hset(names["snapshot"], mapping={"bloom": bloom, "last_id": "0", "epoch": epoch})
            pipe.set(names["epoch"], epoch)
            pipe.execute()

        self._on_key(names["snapshot"], replace)

    def catalog_log_length(self, namespace: str) -> int:
        name = catalog_key_names(namespace)["log"]
        return int(self._on_key(name, lambda client: client.xlen(name)))

    # -- the write functions (cachebox.quota) ----------------------------------------------
    def load_functions(self, limits: quota.Limits, *, replace: bool = True) -> None:
        """Load (``FUNCTION LOAD REPLACE``) the ``edgecache`` library with ``limits`` on the server,
        or on every primary of a cluster (functions are per node). The control plane's credentials:
        CacheBoxRefused for a board's user."""
        source = quota.library_source(limits)
        self._on_every_server(lambda client: client.function_load(source, replace=replace))
        self._limits = limits

    def _with_functions(self, call: Callable[[], T]) -> T:
        """``call()``; when the server has no ``edgecache`` library (a server just started, a test's),
        load it with the default limits (a namespace's quota: a quarter of maxmemory) and call
        again. A user that may not load it (a board's) gets a CacheBoxRefused that says who loads it."""
        try:
            return call()
        except CacheBoxRefused as exc:
            if "function not found" not in str(exc).lower():
                raise
            try:
                self.load_functions(
                    self._limits or quota.Limits(quota=quota.default_quota(self.memory_limit_per_node())), replace=False
                )
            except CacheBoxRefused as load_exc:
                if "already exists" in str(load_exc):
                    return call()
                if "NOPERM" not in str(load_exc) and "no permissions" not in str(load_exc):
                    raise
                raise CacheBoxRefused(
                    f"cache box {self.safe_url} has no EdgeCache write functions (library {quota.LIBRARY!r}); the control plane "
                    "loads them when it applies the boards' users: start it (`make run`, `manage.py run`) and try again"
                ) from exc
            return call()

    # -- device registry ------------------------------------------------------------------
    def get_device_record(self, name: str) -> bytes | None:
        """A device's published record (JSON bytes), None when there is none; one round trip."""
        key = device_key_name(name)
        return self._on_key(key, lambda client: client.get(key))

    def put_device_record(self, name: str, raw: str | bytes) -> None:
        """Publish (replace) a device's record; one round trip. No TTL: boards read it at any time."""
        key = device_key_name(name)
        self._on_key(key, lambda client: client.set(key, raw))

    def get_producer_table(self, tenant: str) -> bytes | None:
        """A tenant's signed producer table (JSON bytes), None when none was published; one round trip."""
        key = producers_key_name(tenant)
        return self._on_key(key, lambda client: client.get(key))

    def put_producer_table(self, tenant: str, raw: str | bytes) -> None:
        """Publish (replace) a tenant's producer table; one round trip, no TTL (the control plane's write)."""
        key = producers_key_name(tenant)
        self._on_key(key, lambda client: client.set(key, raw))

    # -- streams (a run's tokens to the control plane while a board answers) ------------------
    def publish(self, channel: str, data: bytes) -> int:
        """Publish ``data`` on a pub/sub channel; returns how many subscribers received it (0: none
        listens, the message is gone). One round trip."""
        return int(self._on_any_node(lambda client: client.publish(channel, data)))

    def publish_unanswered(self, channel: str, data: bytes) -> Callable[[], int]:
        """``publish``, without waiting for the server's answer: the PUBLISH is sent at once, and the
        returned function reads its answer (how many subscribers received it). Call it once, before
        anything else whose order after this message matters is published (another connection's
        PUBLISH could overtake this one), and always (it returns the connection to the pool). The
        answer's round trip then runs beside the caller's next work instead of before it. On a
        cluster the PUBLISH is answered at once, as ``publish``."""
        if self.cluster is not None:
            count = self.publish(channel, data)
            return lambda: count
        answers = self._run(lambda: send_now_read_later(self.redis.connection_pool, [("PUBLISH", channel, data)]))
        return lambda: int(self._run(answers)[0])

    def read_flags(self, names: Sequence[str]) -> list[bytes | None]:
        """Several small keys' values (a record, flags) in one round trip (None where unset).
        CacheBoxUnavailable when any of them could not be read (a cluster node that did not
        answer): a value not read is not a value unset, and a board must not take its registry
        record's absence from a node that is down."""
        names = list(names)
        replies = self._batch(names, str, lambda pipe, name: pipe.get(name))
        unread = [name for name, reply in zip(names, replies) if reply is None]
        if unread:
            raise CacheBoxUnavailable(f"the cache box node holding {', '.join(unread)} did not answer")
        return [reply[0] for reply in replies]

    def read_flag(self, name: str) -> bytes | None:
        """The value of the flag key ``name``, None when it is not set (one GET round trip; cancel flags)."""
        return self._on_key(name, lambda client: client.get(name))

    def set_flag(self, name: str, ttl: int, value: bytes = b"1") -> None:
        """Set the flag key ``name`` to ``value`` for ``ttl`` seconds; one round trip."""
        self._on_key(name, lambda client: client.set(name, value, ex=max(1, int(ttl))))

    # -- admission: bounded queues of runs under way (the control plane only) ------------------
    # Each name is a sorted set of request ids scored by when they stop counting (their client's
    # deadline): a run whose release was lost (a web process killed) stops counting then.
    _ADMIT = """
    for i, name in ipairs(KEYS) do
        redis.call('ZREMRANGEBYSCORE', name, '-inf', ARGV[1])
        if redis.call('ZSCORE', name, ARGV[3]) == false and redis.call('ZCARD', name) >= tonumber(ARGV[3 + i]) then
            return {i, redis.call('ZCARD', name), tonumber(redis.call('ZRANGE', name, 0, 0, 'WITHSCORES')[2])}
        end
    end
    for i, name in ipairs(KEYS) do
        redis.call('ZADD', name, ARGV[2], ARGV[3])
        local keep = math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])) + 1
        if redis.call('TTL', name) < keep then redis.call('EXPIRE', name, keep) end
    end
    return {0, 0, 0}
    """

    def admit(
        self, names: Sequence[str], limits: Sequence[int], member: str, *, now: float, until: float
    ) -> tuple[int, int, float]:
        """Count ``member`` as under way in every set of ``names`` (one hash tag) until ``until``, if
        each holds fewer than its limit (0 or less: no limit) of members still counting at ``now``.
        Returns (0, 0, 0) when admitted, else (which set is full, 1-based; how many it holds; when
        its oldest stops counting). One atomic round trip."""
        caps = [int(limit) if limit > 0 else 2**31 for limit in limits]
        reply = self._on_key(
            names[0],
            lambda client: client.eval(
                self._ADMIT, len(names), *names, repr(float(now)), repr(float(until)), member, *caps
            ),
        )
        return int(reply[0]), int(reply[1]), float(reply[2])

    def admit_unanswered(
        self, names: Sequence[str], limits: Sequence[int], member: str, *, now: float, until: float
    ) -> Callable[[], tuple[int, int, float]]:
        """``admit``, without waiting for the server's answer: the count is sent at once and the
        returned function reads its verdict (call it once, always: it gives the connection back).
        The round trip runs beside the caller's work (an API request's routing). On a cluster it
        is answered at once, as ``admit``."""
        if self.cluster is not None:
            verdict = self.admit(names, limits, member, now=now, until=until)
            return lambda: verdict
        caps = [int(limit) if limit > 0 else 2**31 for limit in limits]
        command = ("EVAL", self._ADMIT, len(names), *names, repr(float(now)), repr(float(until)), member, *caps)
        answers = self._run(lambda: send_now_read_later(self.redis.connection_pool, [command]))

        def verdict() -> tuple[int, int, float]:
            reply = self._run(answers)[0]
            return int(reply[0]), int(reply[1]), float(reply[2])

        return verdict

    def release(self, names: Sequence[str], member: str) -> None:
        """``member`` is no longer under way (its answer came, or its client left); one round trip."""
        if not names:
            return

        def remove(client):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.zrem(name, member)
            pipe.execute()

        self._on_key(names[0], remove)

    def under_way(self, name: str, now: float) -> int:
        """How many members of the set ``name`` still count at ``now``."""
        return int(self._on_key(name, lambda client: client.zcount(name, f"({float(now)!r}", "+inf")))

    # -- identities (ACL users; the control plane's credentials only) ------------------------
    def _on_every_server(self, func: Callable[[redis.Redis], T]) -> list[T]:
        """``func(client)`` on the server, or on every primary of a cluster (ACLs are per node)."""
        if self.cluster is None:
            return [self._run(lambda: func(self.redis))]
        return [self._on_node(node, func) for node in self._topology().get_primaries()]

    def set_user(self, name: str, rules: Sequence[str]) -> None:
        """Create or replace the ACL user ``name`` (``ACL SETUSER``) on every server; its existing
        connections keep their old rights until they reconnect, so callers that narrow a user
        also ``kill_user``. A command the server does not know (``client|setinfo`` before Redis
        7.2) is left out of the rules: nothing can run it there anyway. Raises CacheBoxRefused when
        the server has no ACLs or refuses us."""

        def apply(client) -> None:
            kept = list(rules)
            while True:
                try:
                    client.execute_command("ACL", "SETUSER", name, *kept)
                    return
                except redis.ResponseError as exc:
                    unknown = re.search(r"modifier '([^']+)': Unknown command", str(exc))
                    if unknown is None or unknown.group(1) not in kept:
                        raise
                    kept.remove(unknown.group(1))

        self._on_every_server(apply)

    def delete_user(self, name: str) -> None:
        """Delete the ACL user ``name`` everywhere: its connections are closed at once."""
        self._on_every_server(lambda client: client.execute_command("ACL", "DELUSER", name))

    def kill_user(self, name: str) -> None:
        """Close every connection of ``name`` (they reconnect under its current rules, or not at all)."""
        self._on_every_server(lambda client: client.execute_command("CLIENT", "KILL", "USER", name))

    def users(self) -> list[str]:
        """The ACL users of the server (of its first primary, on a cluster)."""
        return [
            name.decode() if isinstance(name, bytes) else str(name)
            for name in self._on_every_server(lambda client: client.execute_command("ACL", "USERS"))[0]
        ]

    def save_users(self) -> bool:
        """Write the ACL users to the server's ACL file (``ACL SAVE``), so they outlive a restart;
        False where the server keeps no ACL file (then the control plane applies them at start)."""
        try:
            self._on_every_server(lambda client: client.execute_command("ACL", "SAVE"))
            return True
        except CacheBoxRefused:
            return False

    # -- counters (the control plane's shared counts: every process adds, /metrics reads) -----
    def count(self, name: str, field: str, by: int = 1) -> None:
        """Add ``by`` to ``field`` of the hash ``name``; one round trip (HINCRBY)."""
        self._on_key(name, lambda client: client.hincrby(name, field, by))

    def counts(self, name: str) -> dict[str, int]:
        """Every field of the hash ``name`` with its count; one round trip (HGETALL)."""
        raw = self._on_key(name, lambda client: client.hgetall(name))
        return {(key.decode() if isinstance(key, bytes) else str(key)): int(value) for key, value in raw.items()}

    # -- server -----------------------------------------------------------------------------
    def memory_bytes(self) -> tuple[int, int]:
        """(used, maxmemory) in bytes, summed over a cluster's primaries; maxmemory 0: no limit
        (on a cluster: 0 when a node has none). One round trip per server (INFO memory)."""
        infos = (
            [self._run(lambda: self.redis.info("memory"))]
            if self.cluster is None
            else [
                self._on_node(node, lambda client: client.info("memory")) for node in self._topology().get_primaries()
            ]
        )
        limits = [int(info.get("maxmemory", 0) or 0) for info in infos]
        return sum(int(info.get("used_memory", 0) or 0) for info in infos), (0 if 0 in limits else sum(limits))

    def memory_limit_per_node(self) -> int:
        """The smallest ``maxmemory`` of the server or of a cluster's primaries, in bytes (0: some
        node has none). One round trip per server (INFO memory)."""
        infos = (
            [self._run(lambda: self.redis.info("memory"))]
            if self.cluster is None
            else [
                self._on_node(node, lambda client: client.info("memory")) for node in self._topology().get_primaries()
            ]
        )
        return min(int(info.get("maxmemory", 0) or 0) for info in infos)

    def memory_used(self) -> str:
        """The server's used memory, human readable ("1.21M"); one round trip (INFO memory).
        A cluster: the sum over the nodes that answer, "(2 of 3 nodes)" when some did not."""
        if self.cluster is None:
            return str(self._run(lambda: self.redis.info("memory")).get("used_memory_human", "?"))
        nodes = self._topology().get_primaries()
        used = []
        for node in nodes:
            try:
                used.append(int(self._on_node(node, lambda client: client.info("memory")).get("used_memory", 0)))
            except CacheBoxRefused:
                raise
            except CacheBoxUnavailable:
                continue
        if not used:
            raise CacheBoxUnavailable(f"no node of cache box {self.safe_url} answers")
        total = f"{sum(used) / 1048576:.2f}M"
        return total if len(used) == len(nodes) else f"{total} ({len(used)} of {len(nodes)} nodes)"


def _is_entry(name: str) -> bool:
    return name.startswith(("ec:e:", "ec:m:"))


def _stream_id_after(candidate: str, current: str) -> bool:
    def parse(stream_id: str) -> tuple[int, int]:
        ms, _, seq = stream_id.partition("-")
        return int(ms), int(seq or 0)

    return parse(candidate) > parse(current)


def _shaped_connection_class(shaper: LinkShaper, tls: bool = False) -> type:
    """A connection class bound to one paced link, for clients that build connections from a class
    and keyword arguments they filter (every node of a cluster client)."""

    class ClusterShapedConnection(ShapedSSLConnection if tls else ShapedConnection):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("shaper", shaper)
            super().__init__(*args, **kwargs)

    return ClusterShapedConnection

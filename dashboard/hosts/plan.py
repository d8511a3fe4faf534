"""Boards as hosts on one machine: the names, addresses, link shaping and resource limits of each.

Each board runs in a network namespace of its own, with its own address on one end of a veth
pair; the other end is attached to a bridge in the root namespace whose address is where the
cache box, the broker and the control plane listen (the "hub"). Every board's link is shaped by
the kernel: a ``tbf`` queue on each end of its veth, one per direction (downloads leave the hub's
end, uploads the board's). The kernel here has no ``netem``, so it adds no delay: a board's round
trip time is added where its cache-box connections read a reply (``cachebox.shaping``, RTT only),
and the bandwidth is the kernel's. Each board's processes sit in a cgroup (v1) capping memory at
the board's registered size and CPU at a quota of its threads.

Pure: this module only computes names and the commands to run (``dashboard.hosts.network`` runs them).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from cachebox.link import LinkProfile

CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_PARENT = "edgecache"  # every board host's cgroups live under this one, per controller
CPU_PERIOD_US = 100_000
TBF_LATENCY = "400ms"  # how long a packet may queue before tbf drops it (a Wi-Fi queue, not a delay added)
IFNAME_MAX = 15  # Linux interface names


@dataclass(frozen=True)
class Hub:
    """The root namespace's side: one bridge, one /24, the hub's address first."""

    prefix: str  # a few letters naming this set of hosts (namespaces, links, cgroups), unique on the machine
    subnet: str  # e.g. "10.77.3.0/24"

    def __post_init__(self) -> None:
        if not self.prefix.isalnum() or not 1 <= len(self.prefix) <= 6:
            raise ValueError(f"a host prefix is 1 to 6 letters or digits, got {self.prefix!r}")
        network = ipaddress.ip_network(self.subnet)
        if network.prefixlen > 24 or network.version != 4:
            raise ValueError(f"the hub needs an IPv4 /24 or larger, got {self.subnet}")

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(self.subnet)  # type: ignore[return-value]

    @property
    def address(self) -> str:
        """Where the cache box, the broker and the control plane listen for the boards."""
        return str(self.network.network_address + 1)

    def setup(self) -> list[list[str]]:
        return [
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{self.address}/{self.network.prefixlen}", "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
        ]

    def teardown(self) -> list[list[str]]:
        return [["ip", "link", "del", self.bridge]]


@dataclass(frozen=True)
class BoardHost:
    """One board as a host: its namespace, its veth ends, its address, its link and its limits."""

    hub: Hub
    index: int  # 1 .. 200 within its hub
    name: str  # the device name
    memory_mb: int
    threads: int
    link: LinkProfile | None  # None: an unshaped LAN

    def __post_init__(self) -> None:
        if not 1 <= self.index <= 200:
            raise ValueError("a hub holds boards 1 to 200")
        if self.memory_mb < 16 or self.threads < 1:
            raise ValueError("a board host needs at least 16 MB and one thread")

    @property
    def namespace(self) -> str:
        return f"{self.hub.prefix}-{self.index}-{self.name}"[:64]

    @property
    def hub_end(self) -> str:
        """The veth end in the root namespace, on the bridge."""
        return f"{self.hub.prefix}{self.index}h"[:IFNAME_MAX]

    @property
    def board_end(self) -> str:
        """The veth end inside the board's namespace (created under this name, moved there)."""
        return f"{self.hub.prefix}{self.index}b"[:IFNAME_MAX]

    @property
    def address(self) -> str:
        return str(self.hub.network.network_address + 10 + self.index)

    @property
    def cgroup(self) -> str:
        """The cgroup's path under each controller (memory, cpu)."""
        return f"{CGROUP_PARENT}/{self.namespace}"

    def cgroup_dir(self, controller: str) -> str:
        return f"{CGROUP_ROOT}/{controller}/{self.cgroup}"

    def limits(self) -> dict[str, dict[str, str]]:
        """What to write in each controller's files: memory capped at the registered size (no swap
        either), CPU at ``threads`` cores' worth of time per period."""
        memory = str(self.memory_mb * 1024 * 1024)
        return {
            "memory": {"memory.limit_in_bytes": memory, "memory.memsw.limit_in_bytes": memory},
            "cpu": {"cpu.cfs_period_us": str(CPU_PERIOD_US), "cpu.cfs_quota_us": str(self.threads * CPU_PERIOD_US)},
        }

    def setup(self) -> list[list[str]]:
        """Commands that make the namespace, its link (addressed, up, shaped both ways)."""
        ns = ["ip", "netns", "exec", self.namespace]
        commands = [
            ["ip", "netns", "add", self.namespace],
            ["ip", "link", "add", self.hub_end, "type", "veth", "peer", "name", self.board_end],
            ["ip", "link", "set", self.board_end, "netns", self.namespace],
            ["ip", "link", "set", self.hub_end, "master", self.hub.bridge],
            ["ip", "link", "set", self.hub_end, "up"],
            [*ns, "ip", "addr", "add", f"{self.address}/{self.hub.network.prefixlen}", "dev", self.board_end],
            [*ns, "ip", "link", "set", self.board_end, "up"],
            [*ns, "ip", "link", "set", "lo", "up"],
        ]
        return commands + self.shaping()

    def shaping(self) -> list[list[str]]:
        """tbf on both ends: the hub's end paces what the board downloads, the board's end what it uploads."""
        if self.link is None:
            return []
        rate = tbf_rate(self.link)
        burst = tbf_burst(self.link)
        return [
            [
                "tc",
                "qdisc",
                "replace",
                "dev",
                self.hub_end,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                TBF_LATENCY,
            ],
            [
                "ip",
                "netns",
                "exec",
                self.namespace,
                "tc",
                "qdisc",
                "replace",
                "dev",
                self.board_end,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                TBF_LATENCY,
            ],
        ]

    def link_down(self) -> list[list[str]]:
        """The board loses its network (as when its Wi-Fi drops): its veth end goes down."""
        return [["ip", "link", "set", self.hub_end, "down"]]

    def link_up(self) -> list[list[str]]:
        return [["ip", "link", "set", self.hub_end, "up"]]

    def teardown(self) -> list[list[str]]:
        """Deleting the namespace deletes the veth pair with it (the hub's end too)."""
        return [["ip", "netns", "del", self.namespace], ["ip", "link", "del", self.hub_end]]

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run in this host: it joins the cgroups, then enters the namespace (``ip netns exec``)."""
        join = 'for group in "$1" "$2"; do echo $$ > "$group/cgroup.procs" || exit 111; done; shift 2; exec ip netns exec "$@"'
        return [
            "sh",
            "-c",
            join,
            "board-host",
            self.cgroup_dir("memory"),
            self.cgroup_dir("cpu"),
            self.namespace,
            *argv,
        ]


def tbf_rate(link: LinkProfile) -> str:
    return f"{link.bandwidth_mbps:g}mbit"


def tbf_burst(link: LinkProfile) -> str:
    """The bucket: at least 32 kbit, and 10 ms of the rate (a fast link needs a deeper bucket, since
    the kernel refills it once per timer tick)."""
    return f"{max(32.0, link.bandwidth_mbps * 1000 / 100):g}kbit"

"""Boards as hosts on this machine (Linux, root): network namespaces, veth links shaped by ``tc``,
cgroup memory and CPU limits. The names and commands come from ``dashboard.hosts.plan``; this
module runs them, starts processes inside a host, reads its cgroup's counters, and cleans up,
also after a failure and after an earlier run that died before it could.

    with HostNetwork.create("ect", "10.77.3.0/24") as network:
        host = network.add("zero", memory_mb=512, threads=1, link=LINK_PRESETS["wifi4"])
        process = host.spawn(["edgecache-board", "--name", "zero"], env)
        ...
        host.link_down(); host.link_up()
        host.memory_counters()  # max usage, failcnt, OOM kills

Used by the tests (``tests/hosts.py``) and by ``manage.py run`` with EDGECACHE_BOARD_HOSTS=1.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from cachebox.link import LinkProfile
from dashboard.hosts.plan import CGROUP_PARENT, CGROUP_ROOT, BoardHost, Hub

log = logging.getLogger(__name__)
CONTROLLERS = ("memory", "cpu")


class HostsUnavailable(RuntimeError):
    """This machine cannot run boards as hosts; the message says why."""


def unavailable_reason() -> str:
    """Why boards cannot be hosts here ("" when they can): root, ``ip``, ``tc``, cgroup v1."""
    if os.geteuid() != 0:
        return "boards as hosts need root (network namespaces, veth links, tc and cgroups)"
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return f"`{tool}` (iproute2) is not installed"
    for controller in CONTROLLERS:
        if not os.access(f"{CGROUP_ROOT}/{controller}", os.W_OK):
            return f"no writable cgroup v1 {controller} controller at {CGROUP_ROOT}/{controller}"
    return ""


def free_subnet(first: int = 100, last: int = 249) -> str:
    """A 10.77.X.0/24 (X from ``first`` to ``last``) that no interface of this machine uses."""
    used = _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    for _ in range(200):
        candidate = f"10.77.{random.randint(first, last)}"
        if f" {candidate}." not in used:
            return f"{candidate}.0/24"
    raise HostsUnavailable(f"no free 10.77.X.0/24 subnet (X from {first} to {last}) on this machine")


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass
class Host:
    """A board host made on this machine: spawn processes in it, cut its link, read its counters."""

    plan: BoardHost
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.plan.address

    @property
    def name(self) -> str:
        return self.plan.name

    def spawn(
        self, argv: list[str], env: dict[str, str], *, stdout=None, cwd: str | os.PathLike | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` in this host (its cgroups, its namespace) with exactly ``env``."""
        process = subprocess.Popen(
            self.plan.wrap(argv),
            env=env,
            cwd=cwd,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def link_down(self) -> None:
        for argv in self.plan.link_down():
            _run(argv)

    def link_up(self) -> None:
        for argv in self.plan.link_up():
            _run(argv)

    def memory_counters(self) -> dict:
        """The memory cgroup's counters: peak usage (MB), how often the limit was hit, OOM kills."""
        folder = Path(self.plan.cgroup_dir("memory"))

        def read(name: str) -> str:
            try:
                return (folder / name).read_text()
            except OSError:
                return ""

        oom = dict(line.split() for line in read("memory.oom_control").splitlines() if len(line.split()) == 2)
        return {
            "limit_mb": int(read("memory.limit_in_bytes") or 0) // 2**20,
            "max_usage_mb": round(int(read("memory.max_usage_in_bytes") or 0) / 2**20, 1),
            "usage_mb": round(int(read("memory.usage_in_bytes") or 0) / 2**20, 1),
            "failcnt": int(read("memory.failcnt") or 0),
            "oom_kill": int(oom.get("oom_kill", 0)),
            "under_oom": int(oom.get("under_oom", 0)),
        }

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every process started here (their sessions), SIGKILL what is left after ``timeout``."""
        for process in self.processes:
            if process.poll() is None:
                _signal_session(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_session(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class HostNetwork:
    """A hub (bridge + address in the root namespace) and the board hosts attached to it."""

    hub: Hub
    hosts: list[Host] = field(default_factory=list)

    @classmethod
    def create(cls, prefix: str, subnet: str) -> "HostNetwork":
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        hub = Hub(prefix, subnet)
        sweep(prefix)  # what an earlier run that died left behind
        network = cls(hub)
        try:
            for argv in hub.setup():
                _run(argv)
        except BaseException:
            network.destroy()
            raise
        return network

    def add(self, name: str, *, memory_mb: int, threads: int, link: LinkProfile | None) -> Host:
        plan = BoardHost(self.hub, len(self.hosts) + 1, name, memory_mb, threads, link)
        host = Host(plan)
        self.hosts.append(host)  # before making it: destroy() cleans up a half-made host too
        for controller, settings in plan.limits().items():
            folder = Path(plan.cgroup_dir(controller))
            folder.mkdir(parents=True, exist_ok=True)
            for name_, value in settings.items():
                if name_ == "memory.memsw.limit_in_bytes" and not (folder / name_).exists():
                    continue  # no swap accounting on this kernel: the memory limit is the cap
                (folder / name_).write_text(value)
        for argv in plan.setup():
            _run(argv)
        return host

    def destroy(self) -> None:
        """Stop every process, delete the namespaces, links, bridge and cgroups (never raises)."""
        for host in self.hosts:
            try:
                host.stop()
            except Exception as exc:  # pragma: no cover - best effort
                log.warning("stopping the processes of %s: %s", host.name, exc)
        sweep(self.hub.prefix)
        self.hosts.clear()

    def __enter__(self) -> "HostNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


def sweep(prefix: str) -> None:
    """Remove every namespace, link and cgroup named with ``prefix`` (killing what runs in them)."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    for line in listed:
        namespace = line.split(" ")[0].strip()
        if namespace.startswith(f"{prefix}-"):
            for pid in _run(["ip", "netns", "pids", namespace], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", namespace], check=False)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
    for line in links:
        parts = line.split(":")
        if len(parts) > 1:
            link = parts[1].strip().split("@")[0]
            if link.startswith(prefix) and (link == f"{prefix}br" or link[len(prefix) :].rstrip("hb").isdigit()):
                _run(["ip", "link", "del", link], check=False)
    for controller in CONTROLLERS:
        parent = Path(CGROUP_ROOT) / controller / CGROUP_PARENT
        if not parent.is_dir():
            continue
        for group in parent.iterdir():
            if group.is_dir() and group.name.startswith(f"{prefix}-"):
                _empty_cgroup(group)
                try:
                    group.rmdir()
                except OSError as exc:
                    log.warning("cgroup %s not removed: %s", group, exc)
        try:
            parent.rmdir()  # only once no other set of hosts uses it
        except OSError:
            pass


def _empty_cgroup(group: Path) -> None:
    """Kill what is left in a cgroup and wait until it is empty (a cgroup with tasks cannot be removed)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            pids = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)

"""Boards as hosts for the tests: a private control plane whose broker and cache box listen on a
hub address, and boards started in network namespaces of their own (``dashboard.hosts.network``), each
behind a veth link shaped by the kernel and in a cgroup capped at its registered memory.

The connection settings a board receives are made in one place, ``HostedPlane.board_env``:
everything a board process knows comes from there (the lead adds each board's own Redis
credentials there). Needs root; ``hosts_or_skip`` says why a machine cannot run these.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachebox import embedded
from cachebox.link import LINK_PRESETS
from dashboard.hosts.network import Host, HostNetwork, free_subnet, unavailable_reason
from dashboard.outbox import control_worker_argv
from tests.conftest import ROOT, opened_text
from tests.stack import ProcessPlane


def hosts_or_skip() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"boards as hosts cannot run here: {reason}")


def until(condition, timeout: float, what: str, every: float = 0.2):
    """Poll ``condition`` until it is truthy (returns its value) or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class HostedPlane(ProcessPlane):
    """A control plane (SQLite, control worker) with a broker and a cache box of its own, both
    embedded Valkeys listening on loopback and on the hub, and boards as hosts behind the hub."""

    def __init__(self, home: Path, network: HostNetwork):
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("REDIS_URL", "DATABASE_URL", "EDGECACHE_CACHEBOX_URL")
        }
        env.update(
            {
                "EDGECACHE_HOME": str(home),
                "EDGECACHE_EMBEDDED_BIND": network.hub.address,
                "EDGECACHE_N_CTX": "2048",
                "EDGECACHE_VISIBILITY_TIMEOUT": "60",
                "EDGECACHE_RESTORE_INTERVAL": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        super().__init__(home, env)
        self.network = network
        self.hosts: dict[str, Host] = {}
        self.cachebox_dir = home / "cachebox"
        self.cachebox_password = secrets.token_urlsafe(24)  # the control plane's alone, as the broker's

    # -- the control plane -------------------------------------------------------------------------
    def start(self) -> None:
        out = self.manage("cachebox", "start")  # the broker (and channel layer): the plane's embedded Valkey
        self.broker_port = int(out.split(" at ")[1].split(" ")[0].rsplit(":", 1)[1].split("/")[0])
        self.start_cachebox()
        self.env["EDGECACHE_CACHEBOX_URL"] = embedded.url_for(self.cachebox_dir, password=self.cachebox_password)
        self.manage("migrate", "--verbosity", "0")
        self.control = self.spawn(
            "control",
            control_worker_argv("control", "info"),
        )

    def start_cachebox(self) -> str:
        """The cache box: a Valkey of its own (so that it can restart while the broker stays)."""
        return embedded.ensure_running(
            self.cachebox_dir, maxmemory="512mb", bind=(self.network.hub.address,), password=self.cachebox_password
        )

    def stop_cachebox(self) -> None:
        embedded.stop(self.cachebox_dir, password=self.cachebox_password)

    def stop_broker(self) -> None:
        self.manage("cachebox", "stop")

    def start_broker(self) -> None:
        self.manage("cachebox", "start")

    def register(self, name: str, *, memory_mb: int, threads: int, link: str) -> str:
        """A device on the dashboard (its record goes to the cache box); returns its token."""
        profile = LINK_PRESETS[link]
        fields = {
            "name": name,
            "kind": f"{name} (host)",
            "cpu_threads": threads,
            "memory_mb": memory_mb,
            "link_bandwidth_mbps": profile.bandwidth_mbps if profile else None,
            "link_rtt_ms": profile.rtt_ms if profile else None,
        }
        return self.shell(f"from dashboard import actions; print(actions.register_device(None, **{fields!r})[1])")

    # -- boards ------------------------------------------------------------------------------------------
    def board_env(self, name: str, token: str, *, hosted: bool = True, extra: dict | None = None) -> dict[str, str]:
        """Everything a board process is told: where its broker and cache box are (the hub's address
        from a host, loopback from this namespace), its token, how its link is shaped."""
        address = self.network.hub.address if hosted else "127.0.0.1"
        cachebox_port = embedded.default_port(self.cachebox_dir)
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONUNBUFFERED": "1",
            "EDGECACHE_HOME": str(self.home),
            "EDGECACHE_N_CTX": self.env["EDGECACHE_N_CTX"],
            "REDIS_URL": f"redis://{address}:{self.broker_port}/0",
            "EDGECACHE_CACHEBOX_URL": f"redis://{address}:{cachebox_port}/0",
            "EDGECACHE_DEVICE_TOKEN": token,
            "EDGECACHE_LINK_SHAPED_BY": "kernel" if hosted else "socket",
            "EDGECACHE_LOG_LEVEL": "INFO",
            **(extra or {}),
        }

    def start_board(
        self, name: str, token: str, *, memory_mb: int, threads: int, link: str, extra: dict | None = None
    ) -> tuple[Host, subprocess.Popen]:
        """Start ``manage.py edge`` for ``name`` as a host of its own (does not wait for it)."""
        host = self.network.add(name, memory_mb=memory_mb, threads=threads, link=LINK_PRESETS[link])
        self.hosts[name] = host
        log = open(self.home / f"board-{name}.log", "ab")
        process = host.spawn(
            [sys.executable, "manage.py", "edge", "--name", name, "--heartbeat", "1"],
            self.board_env(name, token, extra=extra),
            stdout=log,
            cwd=ROOT,
        )
        return host, process

    def start_local_board(self, name: str, token: str, extra: dict | None = None) -> subprocess.Popen:
        """A board in this namespace, its link paced in its sockets (how `make run` emulates one)."""
        log = open(self.home / f"board-{name}.log", "ab")
        process = subprocess.Popen(
            [sys.executable, "manage.py", "edge", "--name", name, "--heartbeat", "1"],
            cwd=ROOT,
            env=self.board_env(name, token, hosted=False, extra=extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def wait_ready(self, name: str, process: subprocess.Popen, timeout: float = 240) -> None:
        until(
            lambda: f"board {name} ready" in self.log(f"board-{name}") or process.poll() is not None,
            timeout,
            f"board {name} to load its model",
        )
        assert process.poll() is None, self.log(f"board-{name}")[-3000:]

    # -- runs ----------------------------------------------------------------------------------------------
    def dispatch(self, jobs: list[dict]) -> list[str]:
        """Send runs ({device, segments, max_tokens, use_cache}) through the control plane; their request ids."""
        code = (
            "import json, os; from dashboard import actions; from dashboard.models import Device; ids = []\n"
            "for job in json.loads(os.environ['HOSTED_JOBS']):\n"
            "    spec = actions.run_request(segments=job['segments'], max_tokens=job.get('max_tokens', 4), use_cache=job.get('use_cache', True), title=job.get('title', 'hosted'))\n"
            "    ids.append(actions.dispatch_run(None, [Device.objects.get(name=job['device'])], spec)[0]['request_id'])\n"
            "print(json.dumps(ids))"
        )
        return json.loads(self.shell(code, env={"HOSTED_JOBS": json.dumps(jobs)}))

    def _db(self):
        return sqlite3.connect(f"file:{self.home / 'db.sqlite3'}?mode=ro", uri=True, timeout=30)

    def run(self, request_id: str) -> dict | None:
        with self._db() as db:
            row = db.execute(
                'select text, error, "case", ttft_ms, breakdown, fetched_bytes, uploaded_bytes, cachebox_unavailable from dashboard_inferencerun where replace(request_id, "-", "") = ?',
                (request_id.replace("-", ""),),
            ).fetchone()
        if row is None:
            return None
        text, error, case, ttft, breakdown, fetched, uploaded, unavailable = row
        return {
            "text": opened_text(self.home, text),
            "error": error,
            "case": case,
            "ttft_ms": ttft,
            "breakdown": json.loads(breakdown),
            "fetched_bytes": fetched,
            "uploaded_bytes": uploaded,
            "cachebox_unavailable": bool(unavailable),
        }

    def wait_runs(self, request_ids: list[str], timeout: float = 300) -> list[dict]:
        until(lambda: all(self.run(request_id) for request_id in request_ids), timeout, f"runs {request_ids}")
        return [self.run(request_id) for request_id in request_ids]

    def device_status(self, name: str) -> dict:
        with self._db() as db:
            row = db.execute("select status from dashboard_device where name = ?", (name,)).fetchone()
        return json.loads(row[0]) if row and row[0] else {}

    def catalog_items(self, name: str) -> int:
        """Entries a board's catalog counts, as its last heartbeat said."""
        return sum(
            catalog.get("approx_items", 0) for catalog in (self.device_status(name).get("catalogs") or {}).values()
        )

    def heartbeats_after(self, name: str, moment: float) -> bool:
        return (self.device_status(name).get("sent") or 0) > moment

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self.network.destroy()
        for action in (self.stop_cachebox, self.stop_broker):
            try:
                action()
            except Exception:  # pragma: no cover - best effort at teardown
                pass


def hosted_plane(home: Path, prefix: str) -> HostedPlane:
    """A started plane on a fresh hub (cleaned up by ``close``, also when starting fails)."""
    hosts_or_skip()
    network = HostNetwork.create(prefix, free_subnet())
    plane = HostedPlane(home, network)
    try:
        plane.start()
    except BaseException:
        plane.close()
        raise
    return plane

"""`python manage.py bench fleet-sim --boards N --seconds S [--cluster]`: N simulated boards against the real control plane.

The command starts a whole stack of its own in a temporary home (``manage.py run --no-boards``:
the embedded Valkey as broker and cache box, the control-plane worker, the ASGI server; with
``--cluster`` a 3-node Valkey Cluster holds the entries), then a driver process with that stack's
settings which registers N devices, starts the simulated boards (``dashboard.bench.sim_board``: a few
processes of asyncio boards, each enrolling its own keys and speaking the signed contract),
sends API requests at a set rate to "any board" and measures, as medians and p99:

- heartbeat ingest lag: a heartbeat's send time (signed, in its status) to the control plane's
  record of it; sampled every second, with its trend over the run (ms per minute);
- routing decision time: ``dashboard.router.plan`` as the API runs it (``decided_ms`` on each routed run);
- API first-chunk overhead: the client's first chunk minus the board's TTFT (what the API adds,
  and any queue the run waited in); and the same beyond the wait the router chose for it (a run
  sent to wait for the board that holds its prompt, when that beat a cold prefill elsewhere);
- dispatch-to-board latency: the control plane's signature time on a request to the board opening it;
- catalog sync lag: an entry's announcement (its stream id) to each board's replica holding it;
- cache-box ops/s and MB/s (Valkey's own counters), database writes/s (every INSERT/UPDATE/DELETE
  of the control plane's processes), control-plane CPU seconds per board per minute (/proc);
- server render time of ``/``, ``/devices/`` and ``/cache/`` with N devices (Django's test client in
  the driver, against the live database: the view's own time, no network);
- errors (HTTP, stream and board errors, refused messages) and lost runs (a dispatch without a stored run).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cachebox import embedded
from dashboard.bench.api import stream_chat
from dashboard.bench.base import BenchError, Benchmark
from dashboard.bench.common import percentile
from dashboard.bench.html_report import write_report
from dashboard.bench.sim_board import SIM_MODEL
from dashboard.ops import db_writes

FORMAT = 1
ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PROMPTS = 40  # distinct shared system prompts the load generator draws from (what entries hold)


# -- the summary maths (pure) ---------------------------------------------------------------------
def p50_p99(values) -> dict:
    """Median and 99th percentile (``dashboard.bench.common.percentile``), and the count."""
    values = [value for value in values if value is not None]
    return {"p50": _round(percentile(values, 50)), "p99": _round(percentile(values, 99)), "n": len(values)}


def beyond_chosen_wait(overhead_ms, queue_ms, chosen_wait_ms) -> float | None:
    """The first chunk's overhead (first chunk minus the board's TTFT) less the queue the router
    chose for the run: up to the wait it expected (``Dispatch.routing["queued_ms"]``), no more. A
    wait it did not expect stays in, and so does any wait when the run's record is unknown."""
    if overhead_ms is None:
        return None
    if not isinstance(queue_ms, (int, float)) or not chosen_wait_ms:
        return overhead_ms
    return overhead_ms - min(max(0.0, queue_ms), chosen_wait_ms)


def trend_per_minute(points) -> float | None:
    """The least-squares slope of ``(t_s, value)`` points, per minute (None for fewer than 3 or one instant)."""
    points = list(points)
    if len(points) < 3:
        return None
    ts = [t for t, _ in points]
    mean_t, mean_v = statistics.fmean(ts), statistics.fmean(v for _, v in points)
    spread = sum((t - mean_t) ** 2 for t in ts)
    if spread == 0:
        return None
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / spread
    return round(slope * 60.0, 3)


def thirds_p99(points) -> list[float | None]:
    """The p99 of ``(t_s, value)`` points in each third of their time span (is a lag growing?)."""
    points = sorted(points)
    if not points:
        return [None, None, None]
    first, last = points[0][0], points[-1][0]
    width = (last - first) / 3 or 1.0
    buckets: list[list[float]] = [[], [], []]
    for t, value in points:
        buckets[min(2, int((t - first) / width))].append(value)
    return [_round(percentile(bucket, 99)) for bucket in buckets]


def per_board_minute(cpu_seconds: float, boards: int, seconds: float) -> float | None:
    """CPU seconds per board per minute of ``cpu_seconds`` spent over ``seconds`` for ``boards`` boards."""
    if boards <= 0 or seconds <= 0:
        return None
    return round(cpu_seconds / boards / (seconds / 60.0), 6)


def rate(delta: float, seconds: float) -> float | None:
    return round(delta / seconds, 3) if seconds > 0 else None


def verdicts(doc: dict) -> dict:
    """Each target of issues 24 and 41 at this run's size: met or not (None: not measured)."""

    def at_most(value, limit):
        return None if value is None else value <= limit

    lag = doc["heartbeat_ingest_lag_ms"]
    thirds = lag.get("p99_by_third") or [None]
    growing = None if None in thirds else thirds[-1] > max(2 * thirds[0], thirds[0] + 500)
    return {
        "routing_decision_p99_le_5ms": at_most(doc["routing_decision_ms"]["p99"], 5.0),
        "routing_decision_p99_le_5ms_quiet": at_most((doc.get("routing_decision_quiet_ms") or {}).get("p99"), 5.0),
        "heartbeat_lag_p99_le_1s": at_most(lag["p99"], 1000.0),
        "heartbeat_lag_not_growing": None if growing is None else not growing,
        "catalog_sync_lag_p99_le_2s": at_most(doc["catalog_sync_lag_ms"]["p99"], 2000.0),
        # Issue 41: what the API adds to the first chunk, beyond the wait the router chose.
        "api_overhead_p99_le_60ms": at_most((doc.get("api_overhead_beyond_chosen_wait_ms") or {}).get("p99"), 60.0),
        "pages_le_300ms": None
        if not doc["render_ms"]
        else all(row["p50"] is not None and row["p50"] <= 300.0 for row in doc["render_ms"].values()),
        "pages_le_300ms_quiet": None
        if not doc.get("render_quiet_ms")
        else all(row["p50"] is not None and row["p50"] <= 300.0 for row in doc["render_quiet_ms"].values()),
        "no_lost_runs": doc["lost_runs"] == 0,
        "no_errors": doc["errors"]["total"] == 0,
    }


def _round(value):
    return None if value is None else round(value, 3)


# -- the command (outside the stack) --------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--boards", type=int, default=100, help="simulated boards (default 100)")
    parser.add_argument(
        "--seconds", type=float, default=60, help="how long the load runs once every board is online (default 60)"
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="entries and catalogs on a 3-node Valkey Cluster (the broker stays one server)",
    )
    parser.add_argument("--rate", type=float, default=5.0, help="API requests per second to 'any board' (default 5)")
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        help="processes the simulated boards run in (default: one per 500 boards, at least 2)",
    )
    parser.add_argument(
        "--heartbeat", type=float, default=5.0, help="seconds between a board's heartbeats (default 5, as a board)"
    )
    parser.add_argument(
        "--namespaces",
        type=int,
        default=1,
        help="namespaces the boards are spread over (default 1: every board a candidate of every request)",
    )
    parser.add_argument(
        "--bytes-per-token",
        type=int,
        default=18_500,
        help="bytes of state per prompt token in an entry (default 18,500: Gemma-3 270M, f16)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="boards compute this many times as long as their measured rates say (default 1; tests use less)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the stack's temporary home (logs, database) after the run"
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_http(url: str, process: subprocess.Popen, timeout: float = 120) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"the stack exited early ({process.returncode}); see its log")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.3)
    raise BenchError(f"{url} did not answer within {timeout:g} s")


def run(
    ctx,
    *,
    boards,
    seconds,
    cluster,
    rate,
    processes,
    heartbeat,
    namespaces,
    bytes_per_token,
    keep,
    time_scale=1.0,
    **options,
) -> dict:
    if (
        boards < 1
        or not 0 < seconds <= 3600
        or rate < 0
        or heartbeat <= 0
        or namespaces < 1
        or bytes_per_token < 1
        or time_scale <= 0
    ):
        raise BenchError(
            "--boards and --namespaces must be at least 1, --seconds between 0 and 3600, --rate at least 0, --heartbeat and --bytes-per-token positive"
        )
    processes = processes or max(2, -(-boards // 500))
    home = Path(tempfile.mkdtemp(prefix="fleet-sim-"))
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("REDIS_URL", "DATABASE_URL", "EDGECACHE_CACHEBOX_URL")
    }
    env.update(
        {
            "EDGECACHE_HOME": str(home),
            "EDGECACHE_ADMIN_PASSWORD": "fleet-" + secrets.token_hex(12),
            "EDGECACHE_EMBEDDED_PORT": str(free_port()),
            "EDGECACHE_COUNT_DB_WRITES": "1",
            "DJANGO_SETTINGS_MODULE": "dashboard.settings",
            "EDGECACHE_EMBEDDED_MAXMEMORY": os.environ.get("EDGECACHE_EMBEDDED_MAXMEMORY", "4gb"),
        }
    )
    started_cluster = None
    if cluster:
        started_cluster = embedded.ensure_cluster(home / "cluster")
        env["EDGECACHE_CACHEBOX_URL"] = started_cluster.url
    log = open(home / "stack.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "run", "--no-boards", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/accounts/login/", server)
        ctx.write(f"stack up at http://127.0.0.1:{port}/ (home {home}); registering {boards} devices")
        options_file = home / "driver.json"
        result_file = home / "result.json"
        options_file.write_text(
            json.dumps(
                {
                    "boards": boards,
                    "seconds": seconds,
                    "rate": rate,
                    "processes": processes,
                    "heartbeat": heartbeat,
                    "namespaces": namespaces,
                    "bytes_per_token": bytes_per_token,
                    "url": f"http://127.0.0.1:{port}",
                    "server_pid": server.pid,
                    "home": str(home),
                    "result": str(result_file),
                    "cluster": bool(cluster),
                    "time_scale": time_scale,
                    "cluster_nodes": [started_cluster.node_url(index) for index in range(len(started_cluster.ports))]
                    if started_cluster
                    else [],
                }
            )
        )
        driver = subprocess.run(
            [sys.executable, "-m", "dashboard.bench.fleet_sim", str(options_file)],
            cwd=ROOT,
            env=env,
            timeout=seconds + 3600,
        )
        if driver.returncode != 0 or not result_file.exists():
            raise BenchError(
                f"the fleet-sim driver failed ({driver.returncode}); see its output above and {home}/stack.log (rerun with --keep)"
            )
        doc = json.loads(result_file.read_text())
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        subprocess.run(
            [sys.executable, "manage.py", "cachebox", "stop"], cwd=ROOT, env=env, capture_output=True, timeout=60
        )
        if started_cluster is not None:
            started_cluster.stop()
        log.close()
        if not keep:
            import shutil

            shutil.rmtree(home, ignore_errors=True)
            shutil.rmtree(
                home.with_name(f"{home.name}-secrets"), ignore_errors=True
            )  # inference.board.config.secrets_home
    return doc


def lines(doc: dict) -> list[str]:
    out = [f"\n{doc['summary']}", f"{'figure':<34}{'p50':>12}{'p99':>12}{'n':>9}"]
    for name in (
        "heartbeat_ingest_lag_ms",
        "routing_decision_ms",
        "routing_decision_cpu_ms",
        "routing_decision_quiet_ms",
        "api_first_chunk_overhead_ms",
        "api_overhead_beyond_chosen_wait_ms",
        "dispatch_to_board_ms",
        "catalog_sync_lag_ms",
        "api_first_chunk_ms",
    ):
        row = doc.get(name)  # a result saved before the figure existed has none
        if not row:
            continue
        out.append(f"{name:<34}{row['p50']!s:>12}{row['p99']!s:>12}{row['n']:>9}")
    for page, row in doc["render_ms"].items():
        out.append(f"{'render ' + page:<34}{row['p50']!s:>12}{row['p99']!s:>12}{row['n']:>9}")
    for page, row in (doc.get("render_quiet_ms") or {}).items():
        out.append(f"{'render ' + page + ' (quiet)':<34}{row['p50']!s:>12}{row['p99']!s:>12}{row['n']:>9}")
    out.append(
        f"cache box: {doc['cachebox']['ops_per_s']} ops/s, {doc['cachebox']['mb_per_s']} MB/s; database writes: {doc['db_writes_per_s']}/s"
    )
    out.append(f"CPU s per board per minute: {json.dumps(doc['cpu_s_per_board_minute'])}")
    out.append(f"errors: {json.dumps(doc['errors'])}; lost runs: {doc['lost_runs']}")
    out.append(
        f"load average (1, 5, 15 min) at the window's start and end: {doc['load_average']['window_start']}, {doc['load_average']['window_end']} on {os.cpu_count()} CPUs"
    )
    out.append(f"targets: {json.dumps(doc['targets'])}")
    return out


def report(path, doc: dict):
    import plotly.graph_objects as go

    lag = go.Figure()
    points = doc.get("heartbeat_lag_series") or []
    lag.add_scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="markers", name="heartbeat ingest lag")
    lag.update_layout(
        title="Heartbeat ingest lag over the run",
        xaxis_title="s since the load began",
        yaxis_title="ms",
        template="plotly_white",
    )
    rows = [
        {"figure": name, **{k: doc[name][k] for k in ("p50", "p99", "n")}}
        for name in (
            "heartbeat_ingest_lag_ms",
            "routing_decision_ms",
            "routing_decision_cpu_ms",
            "routing_decision_quiet_ms",
            "api_first_chunk_overhead_ms",
            "api_first_chunk_ms",
            "dispatch_to_board_ms",
            "catalog_sync_lag_ms",
        )
        if doc.get(name)
    ]
    rows += [{"figure": f"render {page}", **row} for page, row in doc["render_ms"].items()]
    rows += [
        {"figure": f"render {page} (load stopped)", **row} for page, row in (doc.get("render_quiet_ms") or {}).items()
    ]
    costs = [{"what": key, "value": value} for key, value in doc["cpu_s_per_board_minute"].items()]
    costs += [
        {"what": "cache box ops/s", "value": doc["cachebox"]["ops_per_s"]},
        {"what": "cache box MB/s", "value": doc["cachebox"]["mb_per_s"]},
        {"what": "database writes/s", "value": doc["db_writes_per_s"]},
    ]
    targets = [{"target": key, "met": value} for key, value in doc["targets"].items()]
    return write_report(
        path,
        f"bench fleet-sim: {doc['boards']} boards",
        doc["summary"],
        [lag],
        {"Latency": rows, "Costs": costs, "Targets": targets},
        doc,
    )


def headline(doc: dict) -> str:
    return doc.get("summary", "")


BENCH = Benchmark(
    name="fleet-sim",
    format=FORMAT,
    help="N simulated boards (no model, the real signed contract) against a stack of its own: ingest, routing, dispatch, catalog lags, costs per board",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=report,
    headline=headline,
)


# -- the driver (inside the stack: its settings, its database) ------------------------------------
def _register(options: dict) -> dict:
    """Namespaces, devices (with tokens) and one API key per namespace."""
    from django.contrib.auth import get_user_model

    # lazy (both): the actions (and channels) only here; manage.py bench imports every bench
    from dashboard.actions import register_device  # lazy: see above
    from dashboard.actions.api_keys import create_key  # lazy: see above

    # lazy: models before apps are ready (python -m dashboard.bench.fleet_sim imports this module; drive() sets Django up)
    from dashboard.models import Namespace

    started = time.monotonic()
    names = [f"site-{index:02d}" for index in range(options["namespaces"])]
    for name in names:
        Namespace.objects.get_or_create(name=name)
    boards = []
    for index in range(options["boards"]):
        namespace = Namespace.objects.get(name=names[index % len(names)])
        device, token = register_device(
            None, name=f"sim-{index:05d}", kind="simulated board", namespace=namespace, memory_mb=4096, cpu_threads=4
        )
        boards.append({"name": device.name, "token": token, "namespace": namespace.name})
    keys = {name: create_key(None, name, name="fleet-sim", rate_per_minute=0)[1] for name in names}
    admin = get_user_model().objects.filter(is_superuser=True).first()
    return {
        "boards": boards,
        "keys": keys,
        "register_s": round(time.monotonic() - started, 3),
        "admin_id": admin.pk if admin else None,
    }


def _children(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    found, frontier = [pid], [pid]
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(parent, []).append(int(entry))
    while frontier:
        frontier = [child for pid in frontier for child in parents.get(pid, [])]
        found += frontier
    return found


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _cpu_by_role(server_pid: int, sim_pids: list[int], home: Path) -> dict:
    roles = {
        "web": 0.0,
        "control_worker": 0.0,
        "cachebox": 0.0,
        "simulated_boards": sum(_cpu_seconds(pid) for pid in sim_pids),
    }
    for pidfile in home.glob("**/valkey.pid"):  # the embedded servers run detached: found by their pid files
        try:
            roles["cachebox"] += _cpu_seconds(int(pidfile.read_text().strip()))
        except (OSError, ValueError):
            continue
    for pid in _children(server_pid):
        line = _cmdline(pid)
        if "valkey" in line or "redis-server" in line:
            continue
        elif "celery" in line:
            roles["control_worker"] += _cpu_seconds(pid)
        else:
            roles["web"] += _cpu_seconds(pid)
    return roles


def _valkey_counters(urls: list[str]) -> dict:
    import redis

    totals = {"ops": 0, "bytes": 0}
    for url in urls:
        client = redis.Redis.from_url(url)
        info = client.info("stats")
        totals["ops"] += int(info["total_commands_processed"])
        totals["bytes"] += int(info["total_net_input_bytes"]) + int(info["total_net_output_bytes"])
        client.close()
    return totals


def _chat(url: str, key: str, model: str, system: str, question: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "stream": True,
    }
    answer = stream_chat(url, key, body, timeout=120)
    first_ms, figures, error = answer["first_ms"], answer["figures"], answer["error"]
    board_ttft = figures.get("ttft_ms")
    if not error and first_ms is None:
        error = "no content chunk"
    return {
        "first_chunk_ms": first_ms,
        "board_ttft_ms": board_ttft,
        "device": figures.get("device", ""),
        "queue_ms": figures.get("queue_ms"),
        "api_ms": figures.get("api_ms"),
        "overhead_ms": first_ms - board_ttft if first_ms is not None and isinstance(board_ttft, (int, float)) else None,
        "request_id": str(figures.get("request_id", "")).replace("-", ""),
        "error": error,
    }


def _render_times(pages: list[str], admin_id, repeats: int = 5) -> dict:
    from django.contrib.auth import get_user_model
    from django.test import Client

    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(get_user_model().objects.get(pk=admin_id))
    out = {}
    for page in pages:
        times, status = [], None
        for _ in range(repeats):
            began = time.perf_counter()
            response = client.get(page)
            times.append((time.perf_counter() - began) * 1000.0)
            status = response.status_code
        out[page] = {**p50_p99(times), "status": status}
    return out


def _heartbeat_lags(seen: dict, t0: float) -> list[tuple[float, float]]:
    """New heartbeats since the last call: (seconds since t0, ingest lag ms) each."""
    # lazy: the actions (and channels) only here; manage.py bench imports every bench
    from dashboard.actions.devices import heartbeat_records

    points = []
    for name, sent, received in heartbeat_records():
        if sent and received and seen.get(name) != sent:
            seen[name] = sent
            points.append((round(received - t0, 3), (received - sent) * 1000.0))
    return points


def _quiet_decisions(namespace: str, system: str, repeats: int = 50) -> list[float]:
    """Routing decisions over every device of ``namespace`` taken by this process once the load has
    stopped: the decision's own cost, without a busy web process around it. The devices come as the
    API reads them (``Candidates``: at most once a second per process, each read timed apart)."""
    # lazy: the actions (and channels) only here; manage.py bench imports every bench
    from dashboard import actions, router

    devices = router.CANDIDATES.roster(namespace, fresh=True)
    prompt = actions.run_request(messages=(("system", system), ("user", "Which board is quietest?")), max_tokens=4)
    router.plan(devices, prompt)  # the vocabulary, loaded once
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        router.plan(devices, prompt)
        times.append((time.perf_counter() - began) * 1000.0)
    return times


@dataclass
class _Window:
    """What the measured window saw: its clock, load averages, counters before and after, lags, samples, render times."""

    t0: float  # time.time() at the window's start
    window_s: float
    load_start: list
    load_end: list
    before: dict  # _counters at the start
    after: dict  # ... and at the end
    lag_points: list  # (s since t0, heartbeat ingest lag ms)
    samples: list  # one per API request
    render: dict  # render times under load
    render_quiet: dict  # ... once the load stopped
    quiet: list  # routing decisions taken once the load stopped (ms)


def _start_sims(options: dict, fleet: dict, home: Path, stop_file: Path, redis_url: str, cachebox_url: str) -> list:
    """Start the simulated-board processes, each with its share of the boards; their Popen objects."""
    processes, sims = options["processes"], []
    groups = [fleet["boards"][index::processes] for index in range(processes)]
    for index, group in enumerate(groups):
        spec = {
            "redis_url": redis_url,
            "cachebox_url": cachebox_url,
            "boards": group,
            "heartbeat_s": options["heartbeat"],
            "bytes_per_token": options["bytes_per_token"],
            "stop_file": str(stop_file),
            "time_scale": options.get("time_scale", 1.0),
            "ready_file": str(home / f"sim-{index}.ready"),
            "out": str(home / f"sim-{index}.out.json"),
        }
        path = home / f"sim-{index}.json"
        path.write_text(json.dumps(spec))
        # The simulated boards stand in for other machines: below the control plane's CPU priority,
        # as make run's demo boards are, so that their share of this machine's cores is not the
        # control plane's latency (CPU seconds are counted per process either way).
        # lazy: the run command (and the actions) only here; manage.py bench imports every bench
        from ..management.commands.run import board_command

        argv = board_command([sys.executable, "-m", "dashboard.bench.sim_board", str(path)])
        sims.append(
            subprocess.Popen(argv, cwd=ROOT, stdout=open(home / f"sim-{index}.log", "wb"), stderr=subprocess.STDOUT)
        )
    return sims


def _wait_enrolled(home: Path, sims: list, processes: int) -> None:
    """Wait until every simulated-board process says its boards enrolled (at most 30 minutes)."""
    deadline = time.monotonic() + 1800
    while not all((home / f"sim-{index}.ready").exists() for index in range(processes)):
        if any(process.poll() is not None for process in sims):
            raise RuntimeError(f"a simulated-board process exited during enrollment; see {home}/sim-*.log")
        if time.monotonic() > deadline:
            raise RuntimeError("enrollment did not finish within 30 minutes")
        time.sleep(0.5)


def _wait_online(options: dict) -> int:
    """Wait (a few heartbeats at most) until every board is online; how many are."""
    # lazy: models before apps are ready (python -m dashboard.bench.fleet_sim imports this module; drive() sets Django up)
    from dashboard.models import Device

    deadline = time.monotonic() + options["heartbeat"] * 4 + 60
    while time.monotonic() < deadline:
        online = sum(1 for device in Device.objects.all() if device.online)
        if online >= options["boards"]:
            break
        time.sleep(1)
    return sum(1 for device in Device.objects.all() if device.online)


def _counters(server_pid: int, sim_pids: list[int], home: Path, cachebox_urls: list[str], broker_url) -> dict:
    """CPU seconds by role, the cache box's (and a separate broker's) Valkey counters, database writes so far."""
    return {
        "cpu": _cpu_by_role(server_pid, sim_pids, home),
        "box": _valkey_counters(cachebox_urls),
        "broker": _valkey_counters([broker_url]) if broker_url else None,
        "writes": db_writes.written(),
    }


def _sample_lags(stop: threading.Event, seen: dict, t0: float, lag_points: list) -> None:
    """Every second until ``stop``: the new heartbeats' ingest lags into ``lag_points``."""
    while not stop.wait(1.0):
        lag_points.extend(_heartbeat_lags(seen, t0))


def _page_renderer(pages: list[str], admin_id) -> subprocess.Popen:
    """A process that renders ``pages`` once told to (a line on its stdin) and prints their times
    (one JSON line). Started before the window, so its imports load nothing during it. Rendering in
    the driver held the interpreter's lock from the threads that time the API's first chunks: each
    render counted in their figures (the overhead's p99 came from the window's middle, where the
    renders start)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dashboard.bench.fleet_sim",
            "--render",
            json.dumps({"pages": pages, "admin_id": admin_id}),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _render_under_load(render: dict, renderer: subprocess.Popen) -> None:
    """The pages' render times into ``render``, from the page renderer (in a thread of its own: the
    requests keep their schedule meanwhile)."""
    out, _ = renderer.communicate("render\n", timeout=600)
    if renderer.returncode != 0 or not out.strip():
        raise RuntimeError(f"the page renderer failed (exit {renderer.returncode})")
    render.update(json.loads(out.strip().splitlines()[-1]))


def _render_when_told(spec: dict) -> int:
    """The page renderer's process (``_page_renderer``): Django set up, then the renders once told."""
    import django

    django.setup()
    from django.db import connections

    if not sys.stdin.readline():  # the driver ended without asking
        return 0
    try:
        print(json.dumps(_render_times(spec["pages"], spec["admin_id"])), flush=True)
    finally:
        connections.close_all()
    return 0


def _send_load(pool, options: dict, fleet: dict, systems: list[str], renderer: threading.Thread, model: str) -> list:
    """Send the API requests at the set rate over the window (the pages rendered from half-way); (s, future) each."""
    names = sorted(fleet["keys"])
    futures = []
    total = int(options["rate"] * options["seconds"])
    window_start = time.monotonic()
    for index in range(total):
        time.sleep(max(0.0, window_start + index / options["rate"] - time.monotonic()))
        namespace = names[index % len(names)]
        futures.append(
            (
                time.monotonic() - window_start,
                pool.submit(
                    _chat,
                    options["url"],
                    fleet["keys"][namespace],
                    model,
                    systems[index % SYSTEM_PROMPTS],
                    f"Question {index}: how is board {index % 97} doing?",
                ),
            )
        )
        if renderer.ident is None and time.monotonic() - window_start > options["seconds"] / 2:
            renderer.start()
    time.sleep(max(0.0, window_start + options["seconds"] - time.monotonic()))
    if renderer.ident is None:
        renderer.start()
    renderer.join()
    return futures


def _measure_window(
    options: dict, fleet: dict, sims: list, home: Path, cachebox_urls: list[str], broker_url
) -> _Window:
    """The measured window: the load, heartbeat lags sampled, counters before and after, render times; then quiet figures."""
    from concurrent.futures import ThreadPoolExecutor

    # Warm-up (not measured): the web process loads the vocabulary the router tokenizes with.
    names = sorted(fleet["keys"])
    for namespace in names:
        _chat(options["url"], fleet["keys"][namespace], SIM_MODEL, "You are a warm-up.", "Hello?")
    # -- the measured window --
    seen: dict = {}
    _heartbeat_lags(seen, 0.0)  # what was there before
    t0 = time.time()
    load_start = [round(value, 2) for value in os.getloadavg()]
    sim_pids = [process.pid for process in sims]
    before = _counters(options["server_pid"], sim_pids, home, cachebox_urls, broker_url)
    lag_points: list[tuple[float, float]] = []
    samples: list[dict] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_lags, args=(stop, seen, t0, lag_points), daemon=True)
    sampler.start()
    systems = [
        f"You are assistant number {index} of site operations. "
        + ("Answer briefly and precisely about the fleet, its boards and their caches. " * 12)
        for index in range(SYSTEM_PROMPTS)
    ]
    render: dict = {}
    pages = ["/", "/devices/", "/cache/"]
    renderer = threading.Thread(
        target=_render_under_load,
        args=(render, _page_renderer(pages, fleet["admin_id"])),
        name="fleet-sim-render",
        daemon=True,
    )
    with ThreadPoolExecutor(64) as pool:
        futures = _send_load(pool, options, fleet, systems, renderer, SIM_MODEL)
        window = time.time() - t0
        load_end = [round(value, 2) for value in os.getloadavg()]
        after = _counters(options["server_pid"], sim_pids, home, cachebox_urls, broker_url)
        for at, future in futures:
            samples.append({"t_s": round(at, 3), **future.result()})
    stop.set()
    sampler.join()
    quiet = _quiet_decisions(names[0], systems[0])
    render_quiet = _render_times(pages, fleet["admin_id"])  # the load stopped, the boards still beat
    return _Window(t0, window, load_start, load_end, before, after, lag_points, samples, render, render_quiet, quiet)


def _drain(home: Path, processes: int, stop_file: Path, redis_url: str) -> list[dict]:
    """Stop the simulated boards, wait for their results and for the control plane to record their reports; the results."""
    import redis

    broker = redis.Redis.from_url(redis_url)
    stop_file.write_text("stop")
    deadline = time.monotonic() + 180  # each writes its results once its boards answered what they took
    while (
        not all((home / f"sim-{index}.out.json").exists() for index in range(processes)) and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    deadline = time.monotonic() + 120
    while _reports_waiting(broker) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)  # the worker's last tasks commit
    results = []
    for index in range(processes):
        path = home / f"sim-{index}.out.json"
        if not path.exists():
            raise RuntimeError(
                f"simulated-board process {index} wrote no results within 3 minutes of the stop; see {home}/sim-{index}.log"
            )
        results.append(json.loads(path.read_text()))
    return results


def _stored_runs(t0: float) -> dict:
    """What the database says after the window: runs dispatched and stored, lost and failed, the window's decision times."""
    from datetime import datetime
    from datetime import timezone as tz

    # lazy: models before apps are ready (python -m dashboard.bench.fleet_sim imports this module; drive() sets Django up)
    from dashboard.models import Dispatch, InferenceRun

    dispatched = list(Dispatch.objects.filter(kind="run").values_list("request_id", "routing", "created"))
    stored = {str(run_id): error for run_id, error in InferenceRun.objects.values_list("request_id", "error")}
    window_began = datetime.fromtimestamp(t0, tz.utc)
    routed = [
        record
        for _, record, created in dispatched
        if created >= window_began and isinstance(record, dict) and record.get("decided_ms") is not None
    ]
    return {
        "dispatched": len(dispatched),
        "stored": len(stored),
        # The queue each routed run was sent to wait in: the router's choice, where waiting for a board
        # that holds the prompt beat a cold prefill on an idle one.
        "chosen_wait": {
            str(run_id).replace("-", ""): record.get("queued_ms") or 0.0
            for run_id, record, created in dispatched
            if created >= window_began and isinstance(record, dict)
        },
        "lost": [str(run_id) for run_id, _, _ in dispatched if str(run_id) not in stored],
        "failed_runs": [error for error in stored.values() if error],
        "decided": [record["decided_ms"] for record in routed],
        "decided_cpu": [record["decided_cpu_ms"] for record in routed if record.get("decided_cpu_ms") is not None],
    }


def _document(
    options: dict,
    fleet: dict,
    enroll_s: float,
    online_at_start: int,
    measured: _Window,
    results: list[dict],
    runs: dict,
    cachebox_urls: list[str],
) -> dict:
    """The result document: the run's settings, its figures as medians and p99, costs, errors, targets and summary."""
    window, samples, lag_points = measured.window_s, measured.samples, measured.lag_points
    lost, failed_runs = runs["lost"], runs["failed_runs"]
    broker_before, broker_after = measured.before["broker"], measured.after["broker"]
    counts = {key: sum(result["counts"][key] for result in results) for key in results[0]["counts"]}
    sim_samples = {
        key: [value for result in results for value in result["samples"][key]] for key in results[0]["samples"]
    }
    http_errors = [sample["error"] for sample in samples if sample["error"]]
    ok = [sample for sample in samples if not sample["error"]]
    cpu = {role: round(measured.after["cpu"][role] - measured.before["cpu"][role], 3) for role in measured.after["cpu"]}
    control_cpu = cpu["web"] + cpu["control_worker"]
    box_delta = {key: measured.after["box"][key] - measured.before["box"][key] for key in measured.after["box"]}
    doc = {
        "boards": options["boards"],
        "seconds": options["seconds"],
        "window_s": round(window, 3),
        "rate_per_s": options["rate"],
        "namespaces": options["namespaces"],
        "processes": options["processes"],
        "heartbeat_s": options["heartbeat"],
        "time_scale": options.get("time_scale", 1.0),
        "bytes_per_token": options["bytes_per_token"],
        "cluster": options["cluster"],
        "register_s": fleet["register_s"],
        "enroll_s": round(enroll_s, 3),
        "online_at_start": online_at_start,
        "heartbeat_ingest_lag_ms": {
            **p50_p99(lag for _, lag in lag_points),
            "p99_by_third": thirds_p99(lag_points),
            "trend_ms_per_min": trend_per_minute(lag_points),
        },
        "routing_decision_ms": p50_p99(runs["decided"]),
        # ... of which the deciding thread ran (its CPU time); the rest it waited, for the interpreter or a CPU
        "routing_decision_cpu_ms": p50_p99(runs["decided_cpu"]),
        "routing_decision_quiet_ms": p50_p99(measured.quiet),
        "load_average": {"window_start": measured.load_start, "window_end": measured.load_end},
        "api_first_chunk_ms": p50_p99(sample["first_chunk_ms"] for sample in ok),
        "api_first_chunk_overhead_ms": p50_p99(sample["overhead_ms"] for sample in ok),
        "api_overhead_without_queue_ms": p50_p99(
            sample["overhead_ms"] - sample["queue_ms"]
            for sample in ok
            if sample["overhead_ms"] is not None and isinstance(sample["queue_ms"], (int, float))
        ),
        "api_overhead_beyond_chosen_wait_ms": p50_p99(
            beyond_chosen_wait(
                sample["overhead_ms"], sample["queue_ms"], runs["chosen_wait"].get(sample.get("request_id"))
            )
            for sample in ok
        ),
        "runs_sent_to_wait": sum(1 for wait in runs["chosen_wait"].values() if wait > 0),
        "api_queue_ms": p50_p99(sample["queue_ms"] for sample in ok),
        "api_ms": p50_p99(sample["api_ms"] for sample in ok),
        "dispatch_to_board_ms": p50_p99(sim_samples["dispatch_ms"]),
        "catalog_sync_lag_ms": p50_p99(sim_samples["catalog_lag_ms"]),
        "board_ttft_ms": p50_p99(sim_samples["board_ttft_ms"]),
        "cachebox": {
            "ops_per_s": rate(box_delta["ops"], window),
            "mb_per_s": rate(box_delta["bytes"] / 1e6, window),
            "servers": len(cachebox_urls),
        },
        "broker": {
            "ops_per_s": rate(broker_after["ops"] - broker_before["ops"], window),
            "mb_per_s": rate((broker_after["bytes"] - broker_before["bytes"]) / 1e6, window),
        }
        if broker_before
        else None,
        "db_writes_per_s": rate(measured.after["writes"] - measured.before["writes"], window),
        "cpu_s": cpu,
        "cpu_s_per_board_minute": {
            "control_plane": per_board_minute(control_cpu, options["boards"], window),
            "web": per_board_minute(cpu["web"], options["boards"], window),
            "control_worker": per_board_minute(cpu["control_worker"], options["boards"], window),
            "cachebox": per_board_minute(cpu["cachebox"], options["boards"], window),
            "simulated_boards": per_board_minute(cpu["simulated_boards"], options["boards"], window),
        },
        "render_ms": measured.render,
        "render_quiet_ms": measured.render_quiet,
        "requests": len(samples),
        "answered": len(ok),
        "runs_dispatched": runs["dispatched"],
        "runs_stored": runs["stored"],
        "board_counts": counts,
        "errors": {
            "total": len(http_errors) + counts["errors"] + len(failed_runs),
            "api": len(http_errors),
            "boards": counts["errors"],
            "failed_runs": len(failed_runs),
            "examples": sorted(set(http_errors))[:5]
            + [e for result in results for e in result["errors"]][:5]
            + sorted(set(failed_runs))[:5],
        },
        "lost_runs": len(lost),
        "lost_examples": lost[:5],
        "heartbeat_lag_series": [[t, round(lag, 1)] for t, lag in lag_points[:: max(1, len(lag_points) // 2000)]],
        "api_samples": samples[:: max(1, len(samples) // 1000)],
    }
    doc["targets"] = verdicts(doc)
    doc["summary"] = (
        f"{options['boards']} simulated boards, {window:.0f} s at {options['rate']:g} requests/s: heartbeat ingest lag p99 {doc['heartbeat_ingest_lag_ms']['p99']} ms, "
        f"routing decision p99 {doc['routing_decision_ms']['p99']} ms, API overhead p50 {doc['api_first_chunk_overhead_ms']['p50']} ms, "
        f"catalog sync lag p99 {doc['catalog_sync_lag_ms']['p99']} ms, control plane {doc['cpu_s_per_board_minute']['control_plane']} CPU s per board per minute, "
        f"{doc['errors']['total']} errors, {len(lost)} lost runs"
    )
    return doc


def drive(options: dict) -> dict:
    """The driver: register the fleet, start its boards, wait for them online, measure the window, drain, the document."""
    import django

    django.setup()
    from django.conf import settings

    home = Path(options["home"])
    print(f"fleet-sim: registering {options['boards']} devices", flush=True)
    fleet = _register(options)
    cachebox_urls = [settings.REDIS_URL]
    if options["cluster"]:
        cachebox_urls = options["cluster_nodes"]
    processes = options["processes"]
    stop_file = home / "stop"
    print(
        f"fleet-sim: {options['boards']} devices registered in {fleet['register_s']} s; enrolling in {processes} processes",
        flush=True,
    )
    enroll_started = time.monotonic()
    sims = _start_sims(
        options, fleet, home, stop_file, settings.REDIS_URL, settings.EDGECACHE_CACHEBOX_URL or settings.REDIS_URL
    )
    try:
        _wait_enrolled(home, sims, processes)
        enroll_s = time.monotonic() - enroll_started
        print(f"fleet-sim: enrolled in {enroll_s:.1f} s; waiting for every board online", flush=True)
        online_at_start = _wait_online(options)
        print(
            f"fleet-sim: {online_at_start} online; load for {options['seconds']:g} s at {options['rate']:g} requests/s",
            flush=True,
        )
        measured = _measure_window(
            options, fleet, sims, home, cachebox_urls, settings.REDIS_URL if options["cluster"] else None
        )
        print(f"fleet-sim: load done ({len(measured.samples)} requests); draining", flush=True)
        results = _drain(home, processes, stop_file, settings.REDIS_URL)
    finally:
        stop_file.write_text("stop")
        for process in sims:
            if process.poll() is None:
                process.kill()
    runs = _stored_runs(measured.t0)  # after the window: what the database says
    return _document(options, fleet, enroll_s, online_at_start, measured, results, runs, cachebox_urls)


def _reports_waiting(broker) -> int:
    """Reports not recorded yet: on the boards' inboxes, or handed on to the control queue."""
    return broker.llen("control") + sum(broker.llen(key) for key in broker.scan_iter(match="ec:inbox:*", count=1000))


def main(argv: list[str]) -> int:
    if argv[0] == "--render":
        return _render_when_told(json.loads(argv[1]))
    options = json.loads(Path(argv[0]).read_text())
    doc = drive(options)
    Path(options["result"]).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

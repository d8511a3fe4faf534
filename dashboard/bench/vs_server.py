"""`python manage.py bench vs-server`: EdgeCache against llama.cpp's own `llama-server`, the server a
user would otherwise run on each board, side by side on the same work on this machine.

Both systems are driven through their OpenAI APIs by the same code (the official ``openai``
client, streaming, temperature 0), with the same model file, threads and context size, one after
the other (on one board, both up and asked in turn, request by request, so that a shared
machine's changing load weighs on both alike; the fleets one system after the other); each
workload starts fresh processes of both (a fresh namespace for EdgeCache):

- one-board-warm: a 5-shot MMLU prompt repeated, then a ~450-token system prompt with 10 questions;
- one-board-many: 40 MMLU prompts of 4 topics interleaved (more than one context holds);
- chat: 3 conversations of 4 turns, interleaved;
- fleet-loopback, fleet-wifi4: 4 boards against 4 llama-servers behind a round-robin and a
  prefix-hash balancer, 4 topics interleaved, one arrival every cold TTFT of one board.

EdgeCache runs as ``manage.py run`` runs it (its own stack in a temporary folder: embedded Valkey,
control worker, the ASGI server) with boards as ``manage.py edge`` processes. On Wi-Fi 4, where
this machine can (root, ``tc``, cgroup v1), every board and every llama-server is a host of its own
(``dashboard.hosts.network``: a network namespace, a veth shaped by ``tc tbf`` both ways, cgroups for its
CPU and memory): a board's tasks, answers and states cross its link to the hub, a server's requests
and streams cross its own. The kernel has no ``netem``: the round trip is added in EdgeCache's
cache-box sockets only. Elsewhere Wi-Fi 4 is paced in the boards' cache-box sockets
(``cachebox.shaping``) and the peer, which has no traffic between its servers, is not paced.
llama-server runs with ``--cache-ram`` and ``--cache-reuse 256``, one slot (a board serves one run
at a time).

Both get the same memory. ``--cache-ram`` bounds llama-server's prompt cache alone, so what it may
hold in all is its RSS once loaded and warmed (measured first) plus ``--cache-ram``. EdgeCache's
boards are registered with the memory whose budget (``inference.engine.memory_plan``) is that figure, and
each board's planner sizes its RAM tier to what its model, context and runtime leave: the speed is
compared within the same memory (``--board-memory-mb`` registers another figure, with a RAM tier of
``--ram-mb``, as runs before did).

Every request is asked again afterwards with the system's cache off (EdgeCache:
``edgecache.cache: false``; llama-server: ``cache_prompt: false``): agreement is the share of
answers identical to those. Peak RSS is each board or server process's VmHWM (``/proc``).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator, Sequence

from cachebox import embedded
from cachebox.link import LINK_PRESETS
from dashboard.bench import llama_server
from dashboard.bench import side_by_side as sbs
from dashboard.bench.base import BenchError, Benchmark, prompts_of, topics_named
from dashboard.bench.common import host_info
from inference.board.config import ROOT, BoardConfig
from inference.engine.memory_plan import RSS_SHARE
from inference.engine.model_file import resolve_model
from inference.engine.proc_memory import ProcessMemory

WORKLOADS = ("one-board-warm", "one-board-many", "chat", "fleet-loopback", "fleet-wifi4")
DEFAULT_TOPICS = ("astronomy", "high_school_biology", "world_religions", "marketing")
WARM_TOPIC = "college_medicine"
CALIBRATION_TOPIC = "philosophy"  # the fleet's arrival interval is a cold TTFT of a prompt not in the stream
CACHE_REUSE = 256
STARTUP_TIMEOUT_S = 240
DEFAULT_HOST_MB = 2048  # a host's memory cgroup when the boards are not registered with a memory


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    process: subprocess.Popen | None = None,
    log: Path | None = None,
):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:] if log is not None and log.exists() else ""
            raise BenchError(f"{what}: the process exited with {process.returncode}\n{tail}")
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise BenchError(f"{what}: not within {timeout:g} s")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False
    except OSError:
        return False


def _stop(processes: Sequence[subprocess.Popen], timeout: float = 30) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def peak_rss(processes: dict[str, subprocess.Popen]) -> dict[str, float]:
    """Each live process's peak RSS (VmHWM), MB."""
    return {name: ProcessMemory.read(p.pid).peak_rss_mb for name, p in processes.items() if p.poll() is None}


# -- the client: the same openai code for both systems ----------------------------------------
class _Counted:
    """Bytes of request and response bodies, per thread (each request runs on one thread)."""

    local = threading.local()

    @classmethod
    def reset(cls) -> None:
        cls.local.bytes = 0

    @classmethod
    def add(cls, count: int) -> None:
        cls.local.bytes = getattr(cls.local, "bytes", 0) + count

    @classmethod
    def value(cls) -> int:
        return getattr(cls.local, "bytes", 0)


def openai_client(base_url: str, key: str):
    """An ``openai.OpenAI`` for ``base_url`` whose transport counts the bytes of each request."""
    import httpx2 as httpx
    import openai

    class CountingStream(httpx.SyncByteStream):
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            for piece in self.inner:
                _Counted.add(len(piece))
                yield piece

        def close(self):
            self.inner.close()

    class CountingTransport(httpx.HTTPTransport):
        def handle_request(self, request):
            _Counted.add(len(request.content or b""))
            response = super().handle_request(request)
            response.stream = CountingStream(response.stream)
            return response

    return openai.OpenAI(
        api_key=key,
        base_url=base_url.rstrip("/") + "/v1",
        max_retries=0,
        timeout=300,
        http_client=openai.DefaultHttpxClient(transport=CountingTransport()),
    )


@dataclass
class Target:
    """One system as the driver sees it: a client, the model name, and how to ask it cold."""

    system: str
    client: object
    model: str
    cold_client: object  # where cold references are asked (the peer: one server directly)
    cold_extra: dict  # the request fields that turn its cache off


def ask(target: Target, payload: dict, *, cold: bool = False) -> dict:
    """Send one streamed request; what the client saw (never raises for a refused request)."""
    client = target.cold_client if cold else target.client
    extra = dict(target.cold_extra) if cold else {}
    kind = "chat" if "messages" in payload else "completion"
    _Counted.reset()
    sent = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    tokens = 0
    usage = extension = timings = None
    error = ""
    try:
        common = dict(
            model=target.model,
            max_tokens=payload["max_tokens"],
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra or None,
        )
        if kind == "chat":
            stream = client.chat.completions.create(messages=payload["messages"], **common)
        else:
            stream = client.completions.create(prompt=payload["prompt"], **common)
        for chunk in stream:
            text = ""
            if chunk.choices:
                choice = chunk.choices[0]
                text = (choice.delta.content or "") if kind == "chat" else (choice.text or "")
            if text:
                if ttft is None:
                    ttft = (time.perf_counter() - sent) * 1000.0
                pieces.append(text)
                tokens += 1
            extra_fields = chunk.model_extra or {}
            extension = extra_fields.get("edgecache") or extension
            timings = extra_fields.get("timings") or timings
            usage = chunk.usage or usage
    except Exception as exc:  # a refused or broken request is a sample with its error
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    total = (time.perf_counter() - sent) * 1000.0
    sample = {
        "ttft_ms": round(ttft, 2) if ttft is not None else None,
        "total_ms": round(total, 2),
        "text": "".join(pieces),
        "tokens": (usage.completion_tokens if usage is not None and usage.completion_tokens else tokens),
        "http_bytes": _Counted.value(),
        "error": error or ("" if ttft is not None or tokens else ""),
    }
    if ttft is None and not error:
        sample["ttft_ms"] = round(total, 2)  # an empty answer: its end is its first chunk
    if usage is not None:
        details = getattr(usage, "prompt_tokens_details", None)
        sample["prompt_tokens"] = usage.prompt_tokens
        sample["cached_tokens"] = getattr(details, "cached_tokens", None) if details is not None else None
    if timings:  # llama-server's own figures
        sample["cached_tokens"] = timings.get("cache_n", sample.get("cached_tokens"))
        sample["prefill_ms"] = timings.get("prompt_ms")  # its own prefill of what it had not cached
    if extension:  # EdgeCache's own figures
        sample.update(
            {
                "board_ttft_ms": extension.get("ttft_ms"),
                "prefill_ms": extension.get("prefill_ms"),  # the board's prefill of what it had not restored
                "api_ms": extension.get("api_ms"),
                "queue_ms": extension.get("queue_ms"),
                "case": extension.get("case"),
                "server": extension.get("device", ""),
                "cache_bytes": int(extension.get("fetched_bytes", 0) or 0)
                + int(extension.get("uploaded_bytes", 0) or 0),
            }
        )
    return sample


def _payload(request: sbs.Request, history: dict[int, list]) -> dict:
    if request.kind == "chat":
        return {
            "messages": sbs.chat_messages(request, history.get(request.conversation, [])),
            "max_tokens": request.max_tokens,
        }
    return {"prompt": request.prompt, "max_tokens": request.max_tokens}


def run_arrivals(
    target: Target, requests: Sequence[sbs.Request], interval_s: float, progress: Callable[[], None]
) -> tuple[list[dict], float]:
    """One request every ``interval_s`` (open loop: none waits for another), each on its thread."""
    samples: list[dict | None] = [None] * len(requests)
    started = time.perf_counter()

    def one(position: int, request: sbs.Request) -> None:
        payload = _payload(request, {})
        samples[position] = {**_identity(target, request), **ask(target, payload), "payload": payload}
        progress()

    threads = []
    for position, request in enumerate(requests):
        delay = started + position * interval_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=one, args=(position, request), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(600)
    return [s for s in samples if s is not None], time.perf_counter() - started


def _identity(target: Target, request: sbs.Request) -> dict:
    return {
        "system": target.system,
        "workload": request.workload,
        "index": request.index,
        "group": request.group,
        "warm": request.warm,
    }


def add_cold_answers(target: Target, samples: list[dict], cache: dict, progress: Callable[[], None]) -> None:
    """Each sample's ``cold_text``: the same request with the system's cache off (``cache``: asked
    once per system and payload)."""
    for sample in samples:
        if sample.get("error"):
            continue
        key = json.dumps(sample["payload"], sort_keys=True)
        if key not in cache:
            cold = ask(target, sample["payload"], cold=True)
            cache[key] = None if cold["error"] else cold["text"]
            progress()
        sample["cold_text"] = cache[key]


# -- llama-server -------------------------------------------------------------------------------
@dataclass
class Settings:
    model: Path
    n_ctx: int
    threads: int
    ram_mb: int
    peer: Path

    def as_dict(self) -> dict:
        return {
            "model": self.model.name,
            "n_ctx": self.n_ctx,
            "threads": self.threads,
            "ram_mb": self.ram_mb,
            "cache_reuse": CACHE_REUSE,
        }


def peer_flags(settings: Settings, threads: int) -> list[str]:
    return [
        "-c",
        str(settings.n_ctx),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        "1",
        "--cache-ram",
        str(settings.ram_mb),
        "--cache-reuse",
        str(CACHE_REUSE),
    ]


@contextmanager
def llama_servers(
    settings: Settings, count: int, threads: int, folder: Path, hosts: "FleetHosts | None" = None
) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """``count`` llama-servers of the model (url, process), stopped on exit; with ``hosts``, each
    one a host of its own behind its shaped link."""
    started: list[tuple[str, subprocess.Popen]] = []
    logs = []
    try:
        for number in range(count):
            port = free_port()
            log_path = folder / f"llama-server-{port}.log"
            log = open(log_path, "wb")
            logs.append(log)
            address = "127.0.0.1"
            host = hosts.add(f"peer{number}", threads) if hosts is not None else None
            if host is not None:
                address = host.address
            argv = [
                str(settings.peer),
                "-m",
                str(settings.model),
                *peer_flags(settings, threads),
                "--host",
                address,
                "--port",
                str(port),
            ]
            if host is not None:
                process = host.spawn(argv, dict(os.environ), stdout=log)
            else:
                process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            url = f"http://{address}:{port}"
            started.append((url, process))
            _wait(lambda: _http_ok(url + "/health"), STARTUP_TIMEOUT_S, f"llama-server {number}", process, log_path)
        yield started
    finally:
        _stop([p for _, p in started])
        for log in logs:
            log.close()


class Balancer:
    """An HTTP proxy in front of llama-servers: each POST goes to the server ``policy`` picks
    (by the prompt, or the messages' text), streamed back as it comes."""

    def __init__(self, upstreams: Sequence[str], policy):
        self.upstreams, self.policy = list(upstreams), policy
        self.lock = threading.Lock()
        balancer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                balancer._forward(self, "GET", b"", 0)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    parsed = json.loads(body)
                    text = parsed.get("prompt") or "\n".join(m.get("content", "") for m in parsed.get("messages", []))
                except (ValueError, AttributeError):
                    text = ""
                with balancer.lock:
                    chosen = balancer.policy.pick(text if isinstance(text, str) else str(text))
                balancer._forward(self, "POST", body, chosen)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _forward(self, handler: BaseHTTPRequestHandler, method: str, body: bytes, chosen: int) -> None:
        host, port = self.upstreams[chosen].removeprefix("http://").split(":")
        upstream = http.client.HTTPConnection(host, int(port), timeout=600)
        try:
            headers = {
                "Content-Type": handler.headers.get("Content-Type", "application/json"),
                "Authorization": handler.headers.get("Authorization", ""),
            }
            upstream.request(method, handler.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            handler.send_response(response.status)
            handler.send_header("Content-Type", response.getheader("Content-Type", "application/json"))
            handler.send_header("X-Upstream", str(chosen))
            handler.send_header("Connection", "close")
            handler.end_headers()
            while True:
                piece = response.read1(65536)
                if not piece:
                    break
                handler.wfile.write(piece)
                handler.wfile.flush()
        finally:
            upstream.close()

    def __enter__(self) -> "Balancer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- the fleet on a shaped link: boards and servers as hosts ----------------------------------------
HOSTS_PREFIX = "ecvs"  # the namespaces, links and cgroups of this bench's hosts (dashboard.hosts.network)
KERNEL_SHAPED = ("fleet-wifi4",)  # the workloads whose boards and servers run as hosts where this machine can


@dataclass
class FleetHosts:
    """A hub (``dashboard.hosts.network``) whose hosts are the fleet's boards and servers: each in a network
    namespace of its own, its link shaped by the kernel (``tc tbf``, both directions), its CPU and
    memory capped by cgroups. EdgeCache's cache box and broker listen on the hub's address."""

    network: object  # dashboard.hosts.network.HostNetwork
    link: object  # cachebox.link.LinkProfile
    memory_mb: int

    @property
    def hub(self) -> str:
        return self.network.hub.address

    def add(self, name: str, threads: int):
        return self.network.add(name, memory_mb=self.memory_mb, threads=threads, link=self.link)

    @classmethod
    def create(cls, link: str, memory_mb: int, write: Callable[[str], None]) -> "FleetHosts | None":
        """The hub, or None (saying why) where boards cannot be hosts here: the fleet is then paced in-process."""
        # lazy: the boards-as-hosts harness only with hosts; manage.py bench imports every bench
        from dashboard.hosts.network import HostNetwork, HostsUnavailable, free_subnet, unavailable_reason

        reason = unavailable_reason()
        if not reason:
            try:
                return cls(HostNetwork.create(HOSTS_PREFIX, free_subnet()), LINK_PRESETS[link], memory_mb)
            except HostsUnavailable as exc:
                reason = str(exc)
        write(
            f"the fleet on {link} runs as processes, paced in EdgeCache's sockets: boards cannot be hosts here ({reason})"
        )
        return None

    def close(self) -> None:
        self.network.destroy()


def link_shaping(hosts: FleetHosts | None) -> str:
    if hosts is None:
        return "in-process (EdgeCache boards' cache-box sockets); the peer unpaced"
    return (
        f"kernel: every board and server a host (network namespace, veth shaped by tc tbf both ways, {hosts.link.bandwidth_mbps:g} Mbit/s; "
        f"cgroups of {hosts.memory_mb} MB and its threads' CPUs); the {hosts.link.rtt_ms:g} ms round trip added in EdgeCache's cache-box sockets only"
    )


# -- the memory both get ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SharedMemory:
    """The memory each board or server may hold, and how an EdgeCache board is registered for it."""

    board_registered_mb: int  # a board's registered memory (0: not registered, default buffers)
    board_ram_tier_mb: int | None  # an explicit RAM tier (None: the board's planner sizes it)
    peer_idle_rss_mb: float | None = None  # one llama-server's RSS once loaded and warmed
    peer_cache_ram_mb: int | None = None  # its --cache-ram
    shared_mb: float | None = None  # the two added: what llama-server may hold, and a board's budget

    @classmethod
    def equal_to_peer(cls, peer_idle_rss_mb: float, cache_ram_mb: int) -> "SharedMemory":
        """A board registered so that its budget (``RSS_SHARE`` of it) is what llama-server may
        hold: its idle RSS plus its RAM cache (pure)."""
        shared = round(peer_idle_rss_mb + cache_ram_mb, 1)
        return cls(math.ceil(shared / RSS_SHARE), None, round(peer_idle_rss_mb, 1), cache_ram_mb, shared)

    @classmethod
    def registered(cls, board_memory_mb: int, ram_tier_mb: int) -> "SharedMemory":
        """Boards registered with ``board_memory_mb`` and a RAM tier of ``ram_tier_mb``, whatever the peer holds."""
        return cls(board_memory_mb, ram_tier_mb)

    def as_dict(self) -> dict:
        return {
            "rule": "the same total: llama-server's idle RSS + --cache-ram, a board's budget"
            if self.shared_mb
            else "boards registered by hand (--board-memory-mb)",
            "shared_mb": self.shared_mb,
            "peer_idle_rss_mb": self.peer_idle_rss_mb,
            "peer_cache_ram_mb": self.peer_cache_ram_mb,
            "board_registered_mb": self.board_registered_mb,
            "board_ram_tier_mb": self.board_ram_tier_mb,
        }


def peer_idle_rss_mb(settings: Settings, folder: Path) -> float:
    """One llama-server's peak RSS once it has loaded the model and answered one token: all it
    holds before its prompt cache holds anything."""
    with llama_servers(settings, 1, settings.threads, folder) as servers:
        url, process = servers[0]
        sample = ask(
            peer_target(sbs.PEER, url, url, settings.model.name), {"prompt": "Hello", "max_tokens": 1}, cold=True
        )
        if sample["error"]:
            raise BenchError(f"llama-server did not answer its warm-up request: {sample['error']}")
        return ProcessMemory.read(process.pid).peak_rss_mb


READY_PLAN = re.compile(r"RAM tier (\d+) MB, about (\d+) MB")


def board_plan(log_text: str) -> dict | None:
    """The RAM tier and estimate a board's ready line gives (pure)."""
    found = READY_PLAN.search(log_text)
    return {"ram_tier_mb": int(found.group(1)), "estimate_mb": int(found.group(2))} if found else None


# -- EdgeCache's stack ----------------------------------------------------------------------------
REGISTER = """
import json
from dashboard import actions
from dashboard.models import Namespace
Namespace.objects.get_or_create(name={namespace!r})
tokens = {{}}
for name in {names!r}:
    device, token = actions.register_device(None, name=name, kind="bench vs-server", cpu_threads={threads}, memory_mb={memory_mb},
        link_bandwidth_mbps={bandwidth}, link_rtt_ms={rtt}, namespace_id={namespace!r})
    tokens[name] = token
print(json.dumps(tokens))
"""


class EdgeCacheStack:
    """``manage.py run --no-boards`` in a folder of its own, and boards as ``manage.py edge``."""

    def __init__(
        self,
        folder: Path,
        settings: Settings,
        memory: "SharedMemory",
        write: Callable[[str], None],
        hosts: FleetHosts | None = None,
    ):
        self.folder, self.settings, self.board_memory_mb, self.write = (
            folder,
            settings,
            memory.board_registered_mb,
            write,
        )
        self.hosts = hosts
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("REDIS_URL", "DATABASE_URL", "EDGECACHE_CACHEBOX_URL")
        }
        env.update(
            {
                "EDGECACHE_HOME": str(folder / "home"),
                "EDGECACHE_SECRETS_DIR": str(folder / "secrets"),
                "EDGECACHE_ADMIN_PASSWORD": f"vs-{secrets.token_urlsafe(16)}",
                "EDGECACHE_N_CTX": str(settings.n_ctx),
                "EDGECACHE_MODEL": str(settings.model),
                "EDGECACHE_API_TIMEOUT": "300",
                "EDGECACHE_API_RATE": "0",
                "EDGECACHE_API_QUEUE_PER_KEY": "0",  # one key sends every request of a fleet
            }
        )
        if hosts is not None:  # boards as hosts reach the cache box and the broker on the hub's address
            env["EDGECACHE_EMBEDDED_BIND"] = f"127.0.0.1 {hosts.hub}"
        if memory.board_ram_tier_mb is not None:  # else the board's planner sizes it (inference.engine.memory_plan)
            env["EDGECACHE_RAM_TIER_MB"] = str(memory.board_ram_tier_mb)
        self.env = env
        self.server: subprocess.Popen | None = None
        self.boards: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        self._generation = 0
        self.last_plan: dict | None = None  # the RAM tier and estimate of the last boards' first board

    def manage(self, *args: str, timeout: float = 180) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode:
            raise BenchError(f"manage.py {' '.join(args[:2])} failed: {done.stderr[-1500:]}")
        return done.stdout

    def start(self) -> "EdgeCacheStack":
        log = open(self.folder / "run.log", "wb")
        self._logs.append(log)
        self.server = subprocess.Popen(
            [sys.executable, "manage.py", "run", "--no-boards", "--port", str(self.port)],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _wait(
            lambda: _http_ok(self.url + "/accounts/login/"),
            STARTUP_TIMEOUT_S,
            "EdgeCache's control plane (manage.py run)",
            self.server,
            self.folder / "run.log",
        )
        return self

    @contextmanager
    def boards_of(
        self, count: int, threads: int, link: str = "none", hosts: FleetHosts | None = None
    ) -> Iterator[tuple[Target, dict[str, subprocess.Popen]]]:
        """``count`` fresh boards in a fresh namespace and a target for its API key; stopped on exit.
        With ``hosts``, each board is a host of its own on the hub (its link shaped by the kernel)."""

        self._generation += 1
        namespace = f"vs-{self._generation}-{secrets.token_hex(3)}"
        names = [f"{namespace}-b{number}" for number in range(count)]
        profile = LINK_PRESETS[link]
        code = REGISTER.format(
            namespace=namespace,
            names=names,
            threads=threads,
            memory_mb=self.board_memory_mb,
            bandwidth=profile.bandwidth_mbps if profile else 0.0,
            rtt=profile.rtt_ms if profile else 0.0,
        )
        tokens = json.loads(self.manage("shell", "-c", code).strip().splitlines()[-1])
        key = (
            self.manage("apikey", "create", "--namespace", namespace, "--name", "bench vs-server", "--rate", "0")
            .strip()
            .splitlines()[-1]
        )
        boards: dict[str, subprocess.Popen] = {}
        try:
            for name in names:
                log_path = self.folder / f"{name}.log"
                log = open(log_path, "wb")
                self._logs.append(log)
                argv = [sys.executable, "manage.py", "edge", "--name", name, "--heartbeat", "1"]
                env = {**self.env, "EDGECACHE_DEVICE_TOKEN": tokens[name]}
                if hosts is not None:
                    env.update({"REDIS_URL": self.url_at(hosts.hub), "EDGECACHE_LINK_SHAPED_BY": "kernel"})
                    boards[name] = hosts.add(name.rpartition("-")[2], threads).spawn(argv, env, stdout=log, cwd=ROOT)
                else:
                    boards[name] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                # One at a time, as llama-servers are started: a board measures its prefill rate as
                # it starts, which the router weighs until its runs report; four measuring at once
                # on this machine's cores read 4.3 to 8.3 ms per token for the same board.
                _wait(
                    lambda: f"board {name} ready" in log_path.read_text(errors="replace"),
                    STARTUP_TIMEOUT_S,
                    f"EdgeCache board {name}",
                    boards[name],
                    log_path,
                )
            self.last_plan = board_plan((self.folder / f"{names[0]}.log").read_text(errors="replace"))
            client = openai_client(self.url, key)

            def online():
                try:
                    data = client.models.list().data
                except Exception:
                    return None
                devices = {d for m in data for d in (m.model_extra or {}).get("edgecache", {}).get("devices", [])}
                return data[0].id if data and len(devices) >= count else None

            model = _wait(online, 120, "EdgeCache's boards to come online")
            yield Target(sbs.EDGECACHE, client, model, client, {"edgecache": {"cache": False}}), boards
        finally:
            _stop(list(boards.values()))

    def url_at(self, address: str) -> str:
        """The embedded Valkey's URL at ``address`` (no credentials: a board logs in as itself)."""

        config = BoardConfig.from_env(self.env)
        return embedded.url_for(config.embedded_dir, config.embedded_port, host=address)

    def close(self) -> None:
        _stop([self.server] if self.server is not None else [])
        subprocess.run(
            [sys.executable, "manage.py", "cachebox", "stop"], cwd=ROOT, env=self.env, capture_output=True, timeout=60
        )
        for log in self._logs:
            log.close()


def peer_target(system: str, url: str, cold_url: str, model: str) -> Target:
    return Target(
        system, openai_client(url, "no-key"), model, openai_client(cold_url, "no-key"), {"cache_prompt": False}
    )


# -- the workloads ------------------------------------------------------------------------------
@dataclass
class Options:
    workloads: tuple[str, ...]
    repeats: int
    questions: int
    per_topic: int
    fleet_per_topic: int
    turns: int
    topics: tuple[str, ...]
    boards: int
    interval_s: float


def _describe(name: str, options: Options, kernel_shaped: bool = False) -> str:
    wifi4 = (
        "every board and server a host on Wi-Fi 4 (tc-shaped links)"
        if kernel_shaped
        else "EdgeCache boards on Wi-Fi 4 to the cache box (in-process socket pacing); the peer unpaced"
    )
    return {
        "one-board-warm": f"a 5-shot MMLU prompt x{options.repeats}, then a ~450-token system prompt with {options.questions} questions",
        "one-board-many": f"{options.per_topic * len(options.topics)} MMLU prompts of {len(options.topics)} topics, interleaved",
        "chat": f"{len(sbs.CHATS)} conversations of {options.turns} turns, interleaved",
        "fleet-loopback": f"{options.boards} boards or servers, {options.fleet_per_topic * len(options.topics)} prompts of {len(options.topics)} topics, arrivals every cold TTFT; loopback",
        "fleet-wifi4": f"{options.boards} boards or servers, {options.fleet_per_topic * len(options.topics)} prompts; {wifi4}",
    }[name]


def requests_of(name: str, options: Options) -> list[sbs.Request]:
    if name == "one-board-warm":
        prompt = prompts_of(WARM_TOPIC, 5, 1)[0].text
        return sbs.one_board_warm(prompt, options.repeats, sbs.QUESTIONS[: options.questions])
    by_topic = {
        topic: [
            p.text
            for p in prompts_of(topic, 5, options.per_topic if name == "one-board-many" else options.fleet_per_topic)
        ]
        for topic in options.topics
    }
    if name == "one-board-many":
        return sbs.many_prompts(by_topic)
    if name == "chat":
        return sbs.chat([turns[: options.turns] for turns in sbs.CHATS])
    return sbs.fleet(by_topic, name.removeprefix("fleet-"))


def run_vs_server(
    ctx, settings: Settings, options: Options, board_memory_mb: int | None
) -> tuple[dict, dict, SharedMemory, str]:
    write = ctx.write
    workloads: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    cold_cache: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory(prefix="edgecache-vs-server-") as folder:
        folder = Path(folder)
        if board_memory_mb is None:
            memory = SharedMemory.equal_to_peer(peer_idle_rss_mb(settings, folder), settings.ram_mb)
            write(
                f"the memory each board or server may hold: {memory.shared_mb:.0f} MB (llama-server's idle RSS {memory.peer_idle_rss_mb:.0f} MB "
                f"+ --cache-ram {settings.ram_mb}); EdgeCache's boards registered with {memory.board_registered_mb} MB"
            )
        else:
            memory = SharedMemory.registered(board_memory_mb, settings.ram_mb)
        hosts = None
        shaped = [name for name in options.workloads if name in KERNEL_SHAPED]
        if shaped:
            hosts = FleetHosts.create(FLEET_LINKS[shaped[0]], memory.board_registered_mb or DEFAULT_HOST_MB, write)
        write(f"starting EdgeCache's stack in {folder} ...")
        stack = None
        try:
            stack = EdgeCacheStack(folder, settings, memory, write, hosts).start()
            for name in options.workloads:
                requests = requests_of(name, options)
                write(
                    f"{name}: {len(requests)} requests per system ({_describe(name, options, hosts is not None and name in KERNEL_SHAPED)})"
                )
                try:
                    if name.startswith("fleet-"):
                        systems = run_fleet(
                            ctx,
                            stack,
                            settings,
                            options,
                            name,
                            requests,
                            folder,
                            cold_cache,
                            hosts if name in KERNEL_SHAPED else None,
                        )
                    else:
                        systems = run_one_board(ctx, stack, settings, requests, folder, cold_cache)
                except Exception as exc:  # noqa: BLE001 - the other workloads' figures are kept, and this one says why it has none
                    write(f"{name} failed: {type(exc).__name__}: {exc}")
                    skipped[name] = f"failed: {str(exc)[:500]}"
                    continue
                workloads[name] = {
                    "description": _describe(name, options, hosts is not None and name in KERNEL_SHAPED),
                    "requests": len(requests),
                    **systems,
                    "board_plan": stack.last_plan,
                }
        finally:
            if stack is not None:
                stack.close()
            if hosts is not None:
                hosts.close()
    return workloads, skipped, memory, link_shaping(hosts)


def _progress(ctx, total: int, desc: str):
    return ctx.progress(total=total, desc=desc, unit="request", leave=False)


def run_one_board(
    ctx, stack: EdgeCacheStack, settings: Settings, requests: list[sbs.Request], folder: Path, cold_cache: dict
) -> dict:
    """Both systems up at once, asked in turn request by request (each system's caches are its
    own; one request is in flight at a time), so a machine whose load changes (a shared one)
    weighs on both alike; then each one's cold answers."""
    systems, samples_out = {}, {}
    with _progress(ctx, len(requests) * 4, f"{requests[0].workload}") as bar:
        tick = lambda: bar.update(1)  # noqa: E731
        with (
            stack.boards_of(1, settings.threads) as (ours, boards),
            llama_servers(settings, 1, settings.threads, folder) as servers,
        ):
            url, process = servers[0]
            peer = peer_target(sbs.PEER, url, url, settings.model.name)
            runs = run_in_turn([ours, peer], requests, tick)
            for sample in runs[sbs.PEER][0]:
                sample["server"] = "llama-server 0"
            rss = {sbs.EDGECACHE: peak_rss(boards), sbs.PEER: peak_rss({"llama-server 0": process})}
            for target in (ours, peer):
                add_cold_answers(
                    target, runs[target.system][0], cold_cache.setdefault((target.system, settings.threads), {}), tick
                )
        for name, (samples, elapsed) in runs.items():
            systems[name] = sbs.summarize(samples, elapsed_s=elapsed, peak_rss_mb=rss[name])
            samples_out[name] = samples
    return {"systems": systems, "samples": _lean(samples_out), "order": "in turn, request by request"}


def run_in_turn(
    targets: Sequence[Target], requests: Sequence[sbs.Request], progress: Callable[[], None]
) -> dict[str, tuple[list[dict], float]]:
    """Each request to each target in turn (a chat's turns carry each system's own earlier
    answers); per system its samples and its own total time (the sum of its requests' times)."""
    history: dict[str, dict[int, list]] = {t.system: {} for t in targets}
    samples: dict[str, list[dict]] = {t.system: [] for t in targets}
    for request in requests:
        for target in targets:
            payload = _payload(request, history[target.system])
            sample = ask(target, payload)
            sbs.remember(history[target.system], request, sample["text"])
            samples[target.system].append({**_identity(target, request), **sample, "payload": payload})
            progress()
    return {name: (rows, sum(r["total_ms"] for r in rows) / 1000.0) for name, rows in samples.items()}


FLEET_LINKS = {
    "fleet-loopback": "none",
    "fleet-wifi4": "wifi4",
}  # a fleet workload's boards' link (cachebox.link.LINK_PRESETS)


def run_fleet(
    ctx,
    stack: EdgeCacheStack,
    settings: Settings,
    options: Options,
    name: str,
    requests: list[sbs.Request],
    folder: Path,
    cold_cache: dict,
    hosts: FleetHosts | None = None,
) -> dict:
    link = FLEET_LINKS[name]
    threads = max(1, settings.threads // 2) if options.boards > 1 else settings.threads
    systems, samples_out = {}, {}
    with _progress(ctx, len(requests) * 6, name) as bar:
        tick = lambda: bar.update(1)  # noqa: E731
        interval = options.interval_s
        if interval <= 0:
            interval = calibrate_interval(settings, threads, folder)
            options.interval_s = interval  # the same arrivals for every fleet run of this bench
            ctx.write(f"  arrivals every {interval:.3f} s (a cold TTFT of one {threads}-thread llama-server)")
        with stack.boards_of(options.boards, threads, link, hosts) as (target, boards):
            samples, elapsed = run_arrivals(target, requests, interval, tick)
            rss = peak_rss(boards)
            add_cold_answers(target, samples, cold_cache.setdefault((sbs.EDGECACHE, threads), {}), tick)
        systems[sbs.EDGECACHE] = sbs.summarize(samples, elapsed_s=elapsed, peak_rss_mb=rss)
        samples_out[sbs.EDGECACHE] = samples
        tokenize = _tokenizer(settings.model)
        for policy in (sbs.RoundRobin(options.boards), sbs.PrefixHash(options.boards, tokenize)):
            with llama_servers(settings, options.boards, threads, folder, hosts) as servers:
                urls = [url for url, _ in servers]
                with Balancer(urls, policy) as balancer:
                    target = peer_target(policy.name, balancer.url, urls[0], settings.model.name)
                    samples, elapsed = run_arrivals(target, requests, interval, tick)
                    rss = peak_rss({f"llama-server {i}": p for i, (_, p) in enumerate(servers)})
                    add_cold_answers(target, samples, cold_cache.setdefault((sbs.PEER, threads), {}), tick)
            for sample in samples:
                sample["server"] = f"llama-server {_picked(policy, sample)}"
            systems[policy.name] = sbs.summarize(samples, elapsed_s=elapsed, peak_rss_mb=rss)
            samples_out[policy.name] = samples
    return {
        "systems": systems,
        "interval_s": round(interval, 3),
        "threads_per_board": threads,
        "link": link,
        "link_shaping": link_shaping(hosts) if link != "none" else "none",
        "samples": _lean(samples_out),
    }


def _picked(policy, sample: dict) -> str:
    if isinstance(policy, sbs.PrefixHash):
        payload = sample["payload"]
        return str(policy.pick(payload.get("prompt") or "\n".join(m["content"] for m in payload.get("messages", []))))
    return "rr"


def calibrate_interval(settings: Settings, threads: int, folder: Path) -> float:
    """A cold TTFT (seconds) of one llama-server with ``threads`` on a prompt outside the stream."""
    prompt = prompts_of(CALIBRATION_TOPIC, 5, 1)[0].text
    with llama_servers(settings, 1, threads, folder) as servers:
        url = servers[0][0]
        target = peer_target(sbs.PEER, url, url, settings.model.name)
        ask(target, {"prompt": "Hello", "max_tokens": 1}, cold=True)  # the first request pays for warm-up
        sample = ask(target, {"prompt": prompt, "max_tokens": 1}, cold=True)
    if sample["error"]:
        raise BenchError(f"llama-server did not answer the calibration request: {sample['error']}")
    return sample["ttft_ms"] / 1000.0


def _tokenizer(model: Path) -> Callable[[str], list[int]]:
    """The model's tokenizer, vocabulary only (what the prefix-hash balancer hashes)."""
    from llama_cpp import Llama

    vocab = Llama(str(model), vocab_only=True, verbose=False)
    return lambda text: vocab.tokenize(text.encode("utf-8"), add_bos=True, special=False)


def _lean(samples: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Samples as saved: without the payloads and texts (the JSON stays small)."""
    keep = (
        "index",
        "group",
        "warm",
        "ttft_ms",
        "total_ms",
        "tokens",
        "http_bytes",
        "cache_bytes",
        "cached_tokens",
        "prompt_tokens",
        "server",
        "case",
        "board_ttft_ms",
        "prefill_ms",
        "api_ms",
        "queue_ms",
        "error",
    )
    return {
        system: [
            {k: s.get(k) for k in keep if k in s}
            | {"agrees": s.get("cold_text") is not None and s.get("text") == s.get("cold_text")}
            for s in rows
        ]
        for system, rows in samples.items()
    }


# -- the command ---------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="which workloads (default: all)"
    )
    parser.add_argument(
        "--repeats", type=int, default=6, help="one-board-warm: times the MMLU prompt is sent (default 6)"
    )
    parser.add_argument(
        "--questions",
        type=int,
        default=10,
        help="one-board-warm: questions under the system prompt (default 10, at most 10)",
    )
    parser.add_argument(
        "--per-topic", type=int, default=10, help="one-board-many: prompts per topic (default 10: 40 prompts)"
    )
    parser.add_argument(
        "--fleet-per-topic", type=int, default=6, help="fleet: prompts per topic (default 6: 24 arrivals)"
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=4,
        help=f"chat: turns of each of the {len(sbs.CHATS)} conversations (default 4, at most 4)",
    )
    parser.add_argument(
        "--topics", nargs="+", default=list(DEFAULT_TOPICS), help="MMLU topics of the many-prompts and fleet workloads"
    )
    parser.add_argument("--boards", type=int, default=4, help="fleet: boards and llama-servers (default 4)")
    parser.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="fleet: seconds between arrivals (default: a cold TTFT of one server, measured)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads of the one-board workloads (default: every core); the fleet's boards get half",
    )
    parser.add_argument("--n-ctx", type=int, default=4096, help="context size of both systems (default 4096)")
    parser.add_argument(
        "--ram-mb",
        type=int,
        default=256,
        help="llama-server's --cache-ram (default 256); its idle RSS plus this is the memory a board gets (with --board-memory-mb: the board's RAM tier)",
    )
    parser.add_argument(
        "--board-memory-mb",
        type=int,
        default=None,
        help="the boards' registered memory, which sizes their buffers, with a RAM tier of --ram-mb (default: registered so that a board's "
        "budget is what llama-server may hold, its idle RSS + --cache-ram, and the board's planner sizes its RAM tier; 0: not registered)",
    )


def run(
    ctx,
    *,
    workloads,
    repeats,
    questions,
    per_topic,
    fleet_per_topic,
    turns,
    topics,
    boards,
    interval,
    threads,
    n_ctx,
    ram_mb,
    board_memory_mb,
    **_,
) -> dict:
    if (
        repeats < 1
        or not 0 <= questions <= len(sbs.QUESTIONS)
        or per_topic < 1
        or fleet_per_topic < 1
        or boards < 1
        or not 1 <= turns <= len(sbs.CHATS[0])
    ):
        raise BenchError(
            f"--repeats, --per-topic, --fleet-per-topic and --boards must be at least 1; --questions between 0 and {len(sbs.QUESTIONS)}; --turns between 1 and {len(sbs.CHATS[0])}"
        )
    try:
        binary = llama_server.ensure(ctx.write)
    except llama_server.PeerUnavailable as exc:
        raise BenchError(f"{exc}; the peer is needed for a side-by-side run") from None
    version = llama_server.version_of(binary)
    settings = Settings(
        model=resolve_model(None).path, n_ctx=n_ctx, threads=threads or os.cpu_count() or 2, ram_mb=ram_mb, peer=binary
    )
    options = Options(
        tuple(dict.fromkeys(workloads)),
        repeats,
        questions,
        per_topic,
        fleet_per_topic,
        turns,
        tuple(topics_named(topics)),
        boards,
        interval,
    )
    if board_memory_mb is not None and board_memory_mb < 0:
        raise BenchError("--board-memory-mb must be 0 (not registered) or more")
    measured, skipped, memory, shaping = run_vs_server(ctx, settings, options, board_memory_mb)
    doc = {
        "machine": {**host_info(), "threads": settings.threads, "model": settings.model.name},
        "peer": {
            "binary": str(binary),
            "version": version,
            "sdist": f"llama-cpp-python {llama_server.VERSION}",
            "libraries": "the wheel's libllama, libggml and libmtmd (the boards' own)",
            "flags": " ".join(peer_flags(settings, settings.threads)),
        },
        "settings": {
            **settings.as_dict(),
            "board_memory_mb": memory.board_registered_mb,
            "fleet_link_shaping": shaping,
        },
        "memory": memory.as_dict(),
        "workloads": measured,
        "skipped": {**{w: "not asked for (--workloads)" for w in WORKLOADS if w not in options.workloads}, **skipped},
    }
    doc["targets"] = sbs.targets(measured, shared_mb=memory.shared_mb)
    doc["summary"] = sbs.headline(doc)
    return doc


BENCH = Benchmark(
    name=sbs.NAME,
    format=sbs.FORMAT,
    help="EdgeCache against llama.cpp's own llama-server (built once from the pinned sdist), side by side through both OpenAI APIs",
    add_arguments=add_arguments,
    run=run,
    lines=sbs.lines,
    report=sbs.report,
    headline=sbs.headline,
)

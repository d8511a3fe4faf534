"""python manage.py run: the whole system on one machine with embedded defaults.

Starts the embedded cache box, migrates, creates a first admin, starts the control-plane
worker and two demo boards ("zero": 1 thread paced to the paper's Raspberry Pi Zero 2W on
its Wi-Fi 4 link, both emulated; "pi5": 2 threads, unshaped) and serves the dashboard. Ctrl-C stops all of it.
With EDGECACHE_BOARD_HOSTS=1, as root, the demo boards run as hosts (``inference.hosts``): each in a
network namespace of its own behind a kernel-shaped link, in a cgroup capped at its registered
memory and threads; otherwise (or where the machine cannot) as plain processes.
``--web N --workers M``: N web processes sharing the one port (each a daphne on the listening
socket this command opens: the kernel hands each connection to one of them) and M control
workers, over the same broker and database.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from cachebox.errors import CacheBoxUnavailable
from cachebox.link import LINK_PRESETS
from dashboard import actions
from dashboard.models import Device
from inference.messages import Queue

ADMIN_USERNAME = "admin"
# EDGECACHE_BOARD_HOSTS=1: the demo boards as hosts (inference.hosts) on this hub.
HOSTS_PREFIX = "ecrun"
HOSTS_SUBNET = "10.78.0.0/24"
LISTEN_BACKLOG = 1024  # connections the web port holds before they are accepted


def checked_admin_password(password: str | None) -> str | None:
    """EDGECACHE_ADMIN_PASSWORD once Django's password validators accept it (None: unset, one is
    generated). A weak one is refused with the validators' own messages, before anything starts."""
    if not password:
        return None
    try:
        validate_password(password, get_user_model()(username=ADMIN_USERNAME))
    except ValidationError as exc:
        reasons = " ".join(exc.messages)
        raise CommandError(
            f"EDGECACHE_ADMIN_PASSWORD is refused: {reasons} Choose a stronger one, "
            "or unset it to have a random password generated and printed once."
        ) from None
    return password


DEMO_BOARDS = [
    # "zero" computes at the paper's Pi Zero 2W rate (inference.compute_profile) over the paper's
    # Wi-Fi 4: the regime the paper measured, labelled emulated on every run. "pi5" runs unpaced.
    {"name": "zero", "kind": "Raspberry Pi Zero 2W (emulated)", "cpu_threads": 1, "memory_mb": 512, "link": "wifi4", "compute_profile": "pi-zero-2w"},
    {"name": "pi5", "kind": "Raspberry Pi 5 (emulated)", "cpu_threads": 2, "memory_mb": 4096, "link": "none", "compute_profile": ""},
]


# The control plane's own variables, which a board is never given: its Django settings (whose
# import reads the control plane's secrets), its database, its admin password and metrics token.
CONTROL_PLANE_ONLY = frozenset({"DJANGO_SETTINGS_MODULE", "DATABASE_URL", "EDGECACHE_ADMIN_PASSWORD", "EDGECACHE_METRICS_TOKEN"})


def board_environment(environ) -> dict:
    """``environ`` as a board may see it: without ``CONTROL_PLANE_ONLY``."""
    return {name: value for name, value in environ.items() if name not in CONTROL_PLANE_ONLY}


BOARD_NICE = 10  # demo boards run as processes yield the CPU to the control plane (see board_command)


def board_command(argv: list[str]) -> list[str]:
    """A demo board's command line as ``make run`` starts it as a process: at a lower CPU priority.

    The demo boards stand in for other machines but share this one's cores with the web process
    and the control worker: a board prefilling or decoding on every core starved the API of its
    own few milliseconds per request (``bench api``, 8 clients on `make run`, one after the other:
    first chunk minus queue and board TTFT 42.8 -> 29.2 ms p50, the API's own part 19.0 -> 14.1 ms).
    A board alone on the machine computes as fast as before; boards as hosts (``EDGECACHE_BOARD_HOSTS``)
    get their CPU from their cgroups instead. The threads llama.cpp starts inherit the priority."""
    nice = shutil.which("nice")
    return [nice, "-n", str(BOARD_NICE), *argv] if nice else list(argv)


def board_url(url: str, host: str) -> str:
    """``url`` as a board on another host reaches it: at ``host`` for loopback, without credentials."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2].replace('127.0.0.1', host)}"


def _interrupted(*_):
    raise KeyboardInterrupt


class Command(BaseCommand):
    help = "Run EdgeCache on this machine: cache box, control-plane worker, two demo boards and the dashboard."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-boards", action="store_true", help="do not start the two demo boards")
        parser.add_argument("--web", type=int, default=1, metavar="N", help="web (ASGI) processes sharing the port (default 1)")
        parser.add_argument("--workers", type=int, default=1, metavar="N", help="control-plane workers (default 1)")

    def handle(self, *args, host, port, no_boards, web, workers, **options):
        if web < 1 or workers < 1:
            raise CommandError("--web and --workers need at least 1 process each")
        # First, before the cache box or anything else starts: a weak admin password stops here.
        admin_password = checked_admin_password(os.environ.get("EDGECACHE_ADMIN_PASSWORD"))
        with socket.socket() as probe:
            if probe.connect_ex((host, port)) == 0:
                raise CommandError(f"port {port} on {host} is already in use (another `make run`?); stop it or pass --port")
        network = None if no_boards else self._host_network()
        board_config = settings.EDGECACHE_BOARD
        if network is not None:  # the boards reach the cache box on the hub's address too
            board_config = board_config.with_(embedded_bind=(*board_config.embedded_bind, network.hub.address))
        try:
            actions.start_cachebox(bind=board_config.embedded_bind)  # the embedded Valkey starts here unless REDIS_URL is set
        except CacheBoxUnavailable as exc:
            if network is not None:
                network.destroy()
            raise CommandError(str(exc))
        self.stdout.write(f"cache box: {actions.cachebox().safe_url}")
        call_command("migrate", interactive=False, verbosity=0)
        self._first_admin(admin_password)
        actions.publish_all_devices()  # an embedded cache box starts empty: boards need their records

        children: list[subprocess.Popen] = []
        try:
            for number in range(1, workers + 1):
                name = "control" if workers == 1 else f"control{number}"
                children.append(self._spawn(f"control worker {name}", [sys.executable, "-m", "celery", "-A", "dashboard", "worker", "--queues", Queue.CONTROL.value, "--pool", "threads", "--concurrency", "2", "--hostname", f"{name}@%h", "--loglevel", "warning", "--without-gossip", "--without-mingle"]))
            if not no_boards:
                for spec in DEMO_BOARDS:
                    token = self._demo_token(spec)
                    label = f"board {spec['name']}" + (f" (compute paced to {spec['compute_profile']})" if spec["compute_profile"] else "")
                    argv = [sys.executable, "manage.py", "edge", "--name", spec["name"]]
                    if network is None:
                        children.append(self._spawn(label, board_command(argv), self._board_env(spec, token)))
                    else:
                        children.append(self._spawn_host(network, spec, label, argv, self._board_env(spec, token, network)))
            if web > 1:
                self._serve_many(host, port, web, children)
                return
            self.stdout.write(self.style.SUCCESS(f"dashboard: http://{host}:{port}/  (Ctrl-C stops everything; `make stop` also ends the cache box)"))
            from daphne.cli import CommandLineInterface

            # Ctrl-C must stop everything even when started from a shell that ignores SIGINT.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            # A backlog of LISTEN_BACKLOG, not Twisted's 50: a burst of connections waits to be
            # accepted (then answered or refused, dashboard.admission) instead of being reset.
            endpoint = f"tcp:port={port}:interface={host.replace(':', chr(92) + ':')}:backlog={LISTEN_BACKLOG}"
            CommandLineInterface().run(["-e", endpoint, "dashboard.asgi:application"])
        finally:
            self._stop(children)
            if network is not None:
                network.destroy()
                self.stdout.write("removed the boards' namespaces, links and cgroups")

    def _host_network(self):
        """With EDGECACHE_BOARD_HOSTS=1, as root: a hub for the demo boards to run as hosts."""
        if os.environ.get("EDGECACHE_BOARD_HOSTS", "").strip() not in ("1", "true", "yes", "on"):
            return None
        from inference.hosts import HostNetwork, HostsUnavailable, unavailable_reason

        reason = unavailable_reason()
        if not reason and not settings.REDIS_URL_IS_EMBEDDED and "127.0.0.1" in settings.REDIS_URL + settings.EDGECACHE_CACHEBOX_URL:
            reason = "REDIS_URL names 127.0.0.1, which a board in a namespace of its own cannot reach"
        if reason:
            self.stdout.write(self.style.WARNING(f"EDGECACHE_BOARD_HOSTS=1, but {reason}: the demo boards run as processes"))
            return None
        try:
            network = HostNetwork.create(HOSTS_PREFIX, HOSTS_SUBNET)
        except HostsUnavailable as exc:
            self.stdout.write(self.style.WARNING(f"the demo boards run as processes: {exc}"))
            return None
        self.stdout.write(f"boards as hosts: hub {network.hub.address} (bridge {network.hub.bridge}), one network namespace, link and cgroup per board")
        return network

    def _board_env(self, spec: dict, token: str, network=None) -> dict:
        """A demo board's whole environment: this one's without the control plane's own variables
        (``board_environment``), and what the board is told (its broker and cache box, from its own
        namespace when it is a host): addresses only, never the control plane's password (a board
        logs in as itself)."""
        env = {**board_environment(os.environ), "EDGECACHE_DEVICE_TOKEN": token, "EDGECACHE_COMPUTE_PROFILE": spec["compute_profile"]}
        if network is not None:
            hub = network.hub.address
            env.update({"REDIS_URL": board_url(settings.REDIS_URL, hub), "EDGECACHE_LINK_SHAPED_BY": "kernel"})
            if settings.EDGECACHE_CACHEBOX_URL:
                env["EDGECACHE_CACHEBOX_URL"] = board_url(settings.EDGECACHE_CACHEBOX_URL, hub)
        return env

    def _spawn_host(self, network, spec: dict, label: str, argv: list[str], env: dict) -> subprocess.Popen:
        link = LINK_PRESETS[spec["link"]]
        host = network.add(spec["name"], memory_mb=spec["memory_mb"], threads=spec["cpu_threads"], link=link)
        self.stdout.write(f"starting {label} as a host: {host.address}, {spec['memory_mb']} MB, {spec['cpu_threads']} CPU, link {link.label if link else 'unshaped'} (tc)")
        child = host.spawn(argv, env, cwd=settings.BASE_DIR)
        self._watch(label, child)
        return child

    def _serve_many(self, host: str, port: int, web: int, children: list[subprocess.Popen]) -> None:
        """``web`` daphne processes on one listening socket (opened here, inherited by each); returns
        when one of them ends (then everything stops: a half-served port is worse than none) or on Ctrl-C."""
        listener = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        listener.set_inheritable(True)
        fd = listener.fileno()
        served = [
            self._spawn(f"web process {number}", [sys.executable, "-m", "daphne", "--fd", str(fd), "dashboard.asgi:application"], pass_fds=(fd,))
            for number in range(1, web + 1)
        ]
        children.extend(served)
        listener.close()  # the web processes hold it now
        self.stdout.write(self.style.SUCCESS(f"dashboard: http://{host}:{port}/ served by {web} web processes  (Ctrl-C stops everything; `make stop` also ends the cache box)"))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _interrupted)  # stop as on Ctrl-C: the children too
        try:
            while all(child.poll() is None for child in served):
                time.sleep(0.5)
            ended = next(child for child in served if child.poll() is not None)
            self.stderr.write(f"a web process ended with {ended.returncode}: stopping everything")
        except KeyboardInterrupt:
            pass

    def _spawn(self, label: str, argv: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
        """``label``'s process with this environment (``env``: its whole environment instead)."""
        self.stdout.write(f"starting {label}")
        child = subprocess.Popen(argv, cwd=settings.BASE_DIR, env=os.environ.copy() if env is None else env, **popen)
        self._watch(label, child)
        return child

    def _watch(self, label: str, child: subprocess.Popen) -> threading.Thread:
        """Say so when ``child`` ends before Ctrl-C (a board that crashed at start was silent)."""
        if not hasattr(self, "_stopping"):
            self._stopping = threading.Event()

        def watch():
            code = child.wait()
            if self._stopping.is_set():
                return
            how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit status {code}"
            self.stderr.write(f"{label} ended ({how}); its log is above. Ctrl-C and `make run` again start it anew.")

        watcher = threading.Thread(target=watch, name=f"watch {label}", daemon=True)
        watcher.start()
        return watcher

    def _stop(self, children: list[subprocess.Popen]) -> None:
        if hasattr(self, "_stopping"):
            self._stopping.set()
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        self.stdout.write("stopped the workers and boards")

    def _demo_token(self, spec: dict) -> str:
        """A fresh token for a demo board at every start (only its hash is stored)."""
        device = Device.objects.filter(name=spec["name"]).first()
        if device is None:
            link = LINK_PRESETS[spec["link"]]
            device, token = actions.register_device(
                None,
                name=spec["name"],
                kind=spec["kind"],
                cpu_threads=spec["cpu_threads"],
                memory_mb=spec["memory_mb"],
                link_bandwidth_mbps=link.bandwidth_mbps if link else None,
                link_rtt_ms=link.rtt_ms if link else None,
            )
            return token
        return actions.rotate_token(None, device)

    def _first_admin(self, chosen: str | None) -> None:
        """A superuser (staff: sees every namespace) when there is none yet."""
        User = get_user_model()
        if User.objects.filter(is_superuser=True).exists():
            return
        password = chosen or secrets.token_urlsafe(12)
        User.objects.create_superuser(ADMIN_USERNAME, "", password)
        if chosen:
            self.stdout.write("first admin account: admin (password from EDGECACHE_ADMIN_PASSWORD)")
        else:
            self.stdout.write(self.style.WARNING(f"first admin account: admin / {password}  (shown once; change it in Admin)"))

"""python manage.py run: the whole system on one machine with embedded defaults.

Starts the embedded cache box, migrates, creates a first admin, starts the control-plane
worker and two demo boards ("zero": 1 thread paced to the paper's Raspberry Pi Zero 2W on
its Wi-Fi 4 link, both emulated; "pi5": 2 threads, unshaped) and serves the dashboard. Ctrl-C stops all of it.
With EDGECACHE_BOARD_HOSTS=1, as root, the demo boards run as hosts (``dashboard.hosts.network``): each in a
network namespace of its own behind a kernel-shaped link, in a cgroup capped at its registered
memory and threads; otherwise (or where the machine cannot) as plain processes.
``--web N --workers M``: N web processes sharing the one port (each a uvicorn on the listening
socket this command opens: the kernel hands each connection to one of them) and M control
workers, over the same broker and database.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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
from dashboard.outbox import control_worker_argv
from inference.board.config import edgecache_home

ADMIN_USERNAME = "admin"
# EDGECACHE_BOARD_HOSTS=1: the demo boards as hosts (dashboard.hosts.network) on this hub.
HOSTS_PREFIX = "ecrun"
HOSTS_SUBNET = "10.78.0.0/24"
LISTEN_BACKLOG = 1024  # connections the web port holds before they are accepted


def web_server_argv(fd: int) -> list[str]:
    """One web process of ``--web N``: the server of ``web_server_options`` on the listening socket ``fd``."""
    options = web_server_options()
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--fd",
        str(fd),
        *("--loop", options["loop"], "--http", options["http"], "--ws", options["ws"], "--lifespan", "off"),
        *("--backlog", str(options["backlog"]), "--no-proxy-headers", "--no-server-header"),
        *("--log-level", options["log_level"]),
        options["app"],
    ]


def web_server_options() -> dict:
    """How the dashboard is served: uvicorn on uvloop with httptools' HTTP parser and websockets
    (Channels' WebSockets), the ASGI app ``dashboard.asgi``. Against daphne (Twisted) it took 0.7-1
    ms off each API request's way in and its first chunk's way out (``bench api``, one client).
    A backlog of LISTEN_BACKLOG: a burst of connections waits to be accepted (then answered or
    refused, ``dashboard.admission``) instead of being reset. Forwarded headers are not trusted
    (the client's address is the connection's, as the lockout and the logs need) and no Server
    header names the software."""
    return {
        "app": "dashboard.asgi:application",
        "loop": "uvloop",
        "http": "httptools",
        "ws": "websockets",
        "lifespan": "off",
        "backlog": LISTEN_BACKLOG,
        "proxy_headers": False,
        "server_header": False,
        "log_level": "info",
    }


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
    # "zero" computes at the paper's Pi Zero 2W rate (inference.engine.compute_profile) over the paper's
    # Wi-Fi 4: the regime the paper measured, labelled emulated on every run. "pi5" runs unpaced.
    {
        "name": "zero",
        "kind": "Raspberry Pi Zero 2W (emulated)",
        "cpu_threads": 1,
        "memory_mb": 512,
        "link": "wifi4",
        "compute_profile": "pi-zero-2w",
    },
    {
        "name": "pi5",
        "kind": "Raspberry Pi 5 (emulated)",
        "cpu_threads": 2,
        "memory_mb": 4096,
        "link": "none",
        "compute_profile": "",
    },
]


# The control plane's own variables, which a board is never given: its Django settings (whose
# import reads the control plane's secrets), its database, its secrets, its admin password and metrics token.
CONTROL_PLANE_ONLY = frozenset(
    {
        "DJANGO_SETTINGS_MODULE",
        "DATABASE_URL",
        "DJANGO_SECRET_KEY",
        "EDGECACHE_SIGNING_SECRET",
        "EDGECACHE_ADMIN_PASSWORD",
        "EDGECACHE_METRICS_TOKEN",
    }
)
# Where a URL may carry the deployment's password: a board is given the address alone (it logs in as itself).
BOARD_URLS = ("REDIS_URL", "EDGECACHE_CACHEBOX_URL")


def board_environment(environ) -> dict:
    """``environ`` as a board may see it: without ``CONTROL_PLANE_ONLY``, its URLs without credentials."""
    env = {name: value for name, value in environ.items() if name not in CONTROL_PLANE_ONLY}
    own_users = env.get("EDGECACHE_BOARD_ACL", "1").strip().lower() not in ("0", "false", "no", "off")
    for name in (
        BOARD_URLS if own_users else ()
    ):  # without board users (EDGECACHE_BOARD_ACL=0) a board needs them as given
        if env.get(name, "").strip():
            env[name] = board_url(env[name], "127.0.0.1")
    return env


DEFAULT_BOARD_USER = "nobody"


def demo_board_account(environ=os.environ) -> tuple[int, int] | None:
    """The (uid, gid) the demo boards run as: when this command runs as root, the account
    ``EDGECACHE_BOARD_USER`` names (``nobody`` by default), which cannot enter the secrets folder
    (root's, 0700) or the state folder (root's, 0700); None when this process is not root (it cannot
    change user: the boards then run as this user, see docs/operations.md) or the setting is empty."""
    if os.geteuid() != 0:
        return None
    name = environ.get("EDGECACHE_BOARD_USER", DEFAULT_BOARD_USER).strip()
    if not name:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise CommandError(
            f"EDGECACHE_BOARD_USER names no account ({name!r}): create it, or name another (empty: boards run as root)"
        ) from None
    if entry.pw_uid == 0:
        return None
    return entry.pw_uid, entry.pw_gid


def demo_boards_home(environ=os.environ) -> Path:
    """Where the demo boards keep their keys and state: beside the state folder (``.edgecache-boards``),
    apart from the control plane's state and secrets."""
    home = edgecache_home(environ)
    return home.with_name(f"{home.name}-boards")


def board_home(name: str, account: tuple[int, int] | None, environ=os.environ) -> Path:
    """The demo board ``name``'s own folder (0700, owned by the account it runs as)."""
    root = demo_boards_home(environ)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # the boards' account may pass through to its own folder, and no further
    folder = root / name
    folder.mkdir(exist_ok=True, mode=0o700)
    folder.chmod(0o700)
    if account is not None:
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, *account, follow_symlinks=False)
    return folder


def board_folders(home: Path) -> dict:
    """A demo board's environment for its own folder: its keys, what it remembers, its flash tier, its HOME."""
    return {
        "HOME": str(home),
        "EDGECACHE_BOARD_KEYS_DIR": str(home / "keys"),
        "EDGECACHE_BOARD_STATE_DIR": str(home / "state"),
        "EDGECACHE_FLASH_DIR": str(home / "flash"),
    }


def traversable(folder: Path, account: tuple[int, int]) -> bool:
    """Whether ``account`` may pass through ``folder`` (its execute bit for that account)."""
    info = folder.stat()
    if info.st_uid == account[0]:
        return bool(info.st_mode & 0o100)
    if info.st_gid == account[1]:
        return bool(info.st_mode & 0o010)
    return bool(info.st_mode & 0o001)


def blocked_at(path: Path, account: tuple[int, int]) -> Path | None:
    """The outermost folder on the way to ``path`` that ``account`` may not pass through (None: none)."""
    path = Path(os.path.realpath(path))
    for folder in reversed(path.parents):  # "/" first
        if not traversable(folder, account):
            return folder
    return None


def dropped(argv: list[str], account: tuple[int, int] | None, needed: list[Path] = ()) -> list[str]:
    """``argv`` run as ``account``: root gives up its user, groups and capabilities (``setpriv``)
    just before it execs the board. When a folder the board must reach (``needed``: the interpreter,
    the checkout) lies below one the account may not enter (pyenv under /root, 0700), the board gets a
    mount namespace of its own in which that folder is an empty tmpfs (0755) holding only what it
    needs, bound in from the real one: nothing else of it (no secret there) is in the board's view."""
    if account is None:
        return list(argv)
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise CommandError(
            "as root the demo boards run as EDGECACHE_BOARD_USER through setpriv (util-linux), which is missing: install it"
        )
    drop = [
        setpriv,
        f"--reuid={account[0]}",
        f"--regid={account[1]}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]
    exposed = sorted(
        {
            (blocked, Path(os.path.realpath(path)))
            for path in needed
            if (blocked := blocked_at(path, account)) is not None
        }
    )
    if not exposed:
        return [*drop, *argv]
    unshare = shutil.which("unshare")
    if unshare is None:
        raise CommandError(
            f"{exposed[0][1]} lies below {exposed[0][0]}, which EDGECACHE_BOARD_USER may not enter, and unshare (util-linux) is missing"
        )
    stash = Path(tempfile.mkdtemp(prefix="edgecache-board-"))
    hidden = [
        folder
        for folder in sorted({blocked for blocked, _ in exposed})
        if not any(other in folder.parents for other, _ in exposed)
    ]
    steps = ["set -e"]
    for number, (_, path) in enumerate(exposed):
        steps += [
            f"mkdir {shlex.quote(str(stash / str(number)))}",
            f"mount --bind {shlex.quote(str(path))} {shlex.quote(str(stash / str(number)))}",
        ]
    steps += [f"mount -t tmpfs -o mode=0755,size=1m edgecache-board {shlex.quote(str(folder))}" for folder in hidden]
    for number, (_, path) in enumerate(exposed):
        steps += [
            f"mkdir -p {shlex.quote(str(path))}",
            f"mount --move {shlex.quote(str(stash / str(number)))} {shlex.quote(str(path))}",
        ]
    steps += [f"rm -rf {shlex.quote(str(stash))}", 'exec "$@"']
    return [
        unshare,
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        "; ".join(steps),
        "edgecache-board",
        *drop,
        *argv,
    ]


def board_needs() -> list[Path]:
    """What a demo board must reach: its interpreter and standard library, the virtualenv, the checkout, its own folder."""
    return [
        Path(sys.executable).resolve().parent,
        Path(sys.base_prefix),
        Path(sys.prefix),
        Path(settings.BASE_DIR),
        demo_boards_home(),
    ]


BOARD_NICE = 10  # demo boards run as processes yield the CPU to the control plane (see board_command)
# The control worker yields the CPU to the web process, and takes it before the demo boards: it
# records each run's report (about 20 ms of CPU a run on a 2-core machine, as much as the web
# process's part) just as its client's next request comes, which then waited for a core.
CONTROL_NICE = 5


def niced(nice: int, argv: list[str]) -> list[str]:
    """``argv`` at a lower CPU priority (as it is, where there is no ``nice``)."""
    program = shutil.which("nice")
    return [program, "-n", str(nice), *argv] if program else list(argv)


def control_worker_command(name: str) -> list[str]:
    """A control worker's command line as ``make run`` starts it: below the web process's CPU
    priority, above the demo boards'."""
    return niced(CONTROL_NICE, control_worker_argv(name, "warning"))


def board_command(argv: list[str]) -> list[str]:
    """A demo board's command line as ``make run`` starts it as a process: at a lower CPU priority.

    The demo boards stand in for other machines but share this one's cores with the web process
    and the control worker: a board prefilling or decoding on every core starved the API of its
    own few milliseconds per request (``bench api``, 8 clients on `make run`, one after the other:
    first chunk minus queue and board TTFT 42.8 -> 29.2 ms p50, the API's own part 19.0 -> 14.1 ms).
    A board alone on the machine computes as fast as before; boards as hosts (``EDGECACHE_BOARD_HOSTS``)
    get their CPU from their cgroups instead. The threads llama.cpp starts inherit the priority."""
    return niced(BOARD_NICE, argv)


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
        parser.add_argument(
            "--web", type=int, default=1, metavar="N", help="web (ASGI) processes sharing the port (default 1)"
        )
        parser.add_argument("--workers", type=int, default=1, metavar="N", help="control-plane workers (default 1)")

    def handle(self, *args, host, port, no_boards, web, workers, **options):
        if web < 1 or workers < 1:
            raise CommandError("--web and --workers need at least 1 process each")
        # First, before the cache box or anything else starts: a weak admin password stops here.
        admin_password = checked_admin_password(os.environ.get("EDGECACHE_ADMIN_PASSWORD"))
        with socket.socket() as probe:
            if probe.connect_ex((host, port)) == 0:
                raise CommandError(
                    f"port {port} on {host} is already in use (another `make run`?); stop it or pass --port"
                )
        network = None if no_boards else self._host_network()
        board_config = settings.EDGECACHE_BOARD
        if network is not None:  # the boards reach the cache box on the hub's address too
            board_config = board_config.with_(embedded_bind=(*board_config.embedded_bind, network.hub.address))
        try:
            actions.start_cachebox(
                bind=board_config.embedded_bind
            )  # the embedded Valkey starts here unless REDIS_URL is set
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
                children.append(
                    self._spawn(
                        f"control worker {name}",
                        control_worker_command(name),
                    )
                )
            if not no_boards:
                account = demo_board_account()
                if account is None:
                    self.stdout.write(
                        self.style.WARNING(
                            "the demo boards run as this user: they could read the control plane's secrets (start `make run` as root, "
                            "then they run as EDGECACHE_BOARD_USER)"
                        )
                    )
                for spec in DEMO_BOARDS:
                    children.append(self._start_board(spec, self._demo_token(spec), network, account))
            if web > 1:
                self._serve_many(host, port, web, children)
                return
            self.stdout.write(
                self.style.SUCCESS(
                    f"dashboard: http://{host}:{port}/  (Ctrl-C stops everything; `make stop` also ends the cache box)"
                )
            )
            # lazy: the web server only for the command that serves
            import uvicorn

            # Ctrl-C (SIGINT, also from a shell that ignores it) and SIGTERM end the server gracefully,
            # which then raises the signal again: here, a KeyboardInterrupt that stops everything.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, _interrupted)
            uvicorn.Server(uvicorn.Config(**web_server_options(), host=host, port=port)).run()
        finally:
            self._stop(children)
            if network is not None:
                network.destroy()
                self.stdout.write("removed the boards' namespaces, links and cgroups")

    def _host_network(self):
        """With EDGECACHE_BOARD_HOSTS=1, as root: a hub for the demo boards to run as hosts."""
        if os.environ.get("EDGECACHE_BOARD_HOSTS", "").strip() not in ("1", "true", "yes", "on"):
            return None
        # lazy: the boards-as-hosts harness only for hosts
        from dashboard.hosts.network import HostNetwork, HostsUnavailable, unavailable_reason

        reason = unavailable_reason()
        if (
            not reason
            and not settings.REDIS_URL_IS_EMBEDDED
            and "127.0.0.1" in settings.REDIS_URL + settings.EDGECACHE_CACHEBOX_URL
        ):
            reason = "REDIS_URL names 127.0.0.1, which a board in a namespace of its own cannot reach"
        if reason:
            self.stdout.write(
                self.style.WARNING(f"EDGECACHE_BOARD_HOSTS=1, but {reason}: the demo boards run as processes")
            )
            return None
        try:
            network = HostNetwork.create(HOSTS_PREFIX, HOSTS_SUBNET)
        except HostsUnavailable as exc:
            self.stdout.write(self.style.WARNING(f"the demo boards run as processes: {exc}"))
            return None
        self.stdout.write(
            f"boards as hosts: hub {network.hub.address} (bridge {network.hub.bridge}), one network namespace, link and cgroup per board"
        )
        return network

    def _start_board(
        self, spec: dict, token: str, network, account: tuple[int, int] | None, argv: list[str] | None = None
    ) -> subprocess.Popen:
        """The demo board ``spec`` as a process (or a host), as ``account`` with a folder of its own
        (``argv``: another command in its place, for tests)."""
        label = f"board {spec['name']}" + (
            f" (compute paced to {spec['compute_profile']})" if spec["compute_profile"] else ""
        )
        argv = argv or [sys.executable, "manage.py", "edge", "--name", spec["name"]]
        env = {**self._board_env(spec, token, network), **board_folders(board_home(spec["name"], account))}
        argv = dropped(argv, account, board_needs())
        if network is None:
            return self._spawn(label + (f" as uid {account[0]}" if account else ""), board_command(argv), env)
        return self._spawn_host(network, spec, label, argv, env)

    def _board_env(self, spec: dict, token: str, network=None) -> dict:
        """A demo board's whole environment: this one's without the control plane's own variables
        (``board_environment``), and what the board is told (its broker and cache box, from its own
        namespace when it is a host): addresses only, never the control plane's password (a board
        logs in as itself)."""
        env = {
            **board_environment(os.environ),
            "EDGECACHE_DEVICE_TOKEN": token,
            "EDGECACHE_COMPUTE_PROFILE": spec["compute_profile"],
        }
        if network is not None:
            hub = network.hub.address
            env.update({"REDIS_URL": board_url(settings.REDIS_URL, hub), "EDGECACHE_LINK_SHAPED_BY": "kernel"})
            if settings.EDGECACHE_CACHEBOX_URL:
                env["EDGECACHE_CACHEBOX_URL"] = board_url(settings.EDGECACHE_CACHEBOX_URL, hub)
        return env

    def _spawn_host(self, network, spec: dict, label: str, argv: list[str], env: dict) -> subprocess.Popen:
        link = LINK_PRESETS[spec["link"]]
        host = network.add(spec["name"], memory_mb=spec["memory_mb"], threads=spec["cpu_threads"], link=link)
        self.stdout.write(
            f"starting {label} as a host: {host.address}, {spec['memory_mb']} MB, {spec['cpu_threads']} CPU, link {link.label if link else 'unshaped'} (tc)"
        )
        child = host.spawn(argv, env, cwd=settings.BASE_DIR)
        self._watch(label, child)
        return child

    def _serve_many(self, host: str, port: int, web: int, children: list[subprocess.Popen]) -> None:
        """``web`` web server processes (``web_server_argv``) on one listening socket (opened here, inherited by each); returns
        when one of them ends (then everything stops: a half-served port is worse than none) or on Ctrl-C."""
        listener = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        listener.set_inheritable(True)
        fd = listener.fileno()
        served = [
            self._spawn(
                f"web process {number}",
                web_server_argv(fd),
                pass_fds=(fd,),
            )
            for number in range(1, web + 1)
        ]
        children.extend(served)
        listener.close()  # the web processes hold it now
        self.stdout.write(
            self.style.SUCCESS(
                f"dashboard: http://{host}:{port}/ served by {web} web processes  (Ctrl-C stops everything; `make stop` also ends the cache box)"
            )
        )
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
            how = (
                f"signal {signal.Signals(-code).name}"
                if code < 0 and -code in signal.valid_signals()
                else f"exit status {code}"
            )
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
            self.stdout.write(
                self.style.WARNING(f"first admin account: admin / {password}  (shown once; change it in Admin)")
            )

"""python manage.py run: the whole system on one machine with embedded defaults.

Starts the embedded cache box, migrates, creates a first admin, starts the control-plane
worker and two demo boards ("zero": 1 thread paced to the paper's Raspberry Pi Zero 2W on
its Wi-Fi 4 link, both emulated; "pi5": 2 threads, unshaped) and serves the dashboard. Ctrl-C stops all of it.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
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


class Command(BaseCommand):
    help = "Run EdgeCache on this machine: cache box, control-plane worker, two demo boards and the dashboard."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-boards", action="store_true", help="do not start the two demo boards")

    def handle(self, *args, host, port, no_boards, **options):
        # First, before the cache box or anything else starts: a weak admin password stops here.
        admin_password = checked_admin_password(os.environ.get("EDGECACHE_ADMIN_PASSWORD"))
        with socket.socket() as probe:
            if probe.connect_ex((host, port)) == 0:
                raise CommandError(f"port {port} on {host} is already in use (another `make run`?); stop it or pass --port")
        try:
            actions.start_cachebox()  # the embedded Valkey starts here unless REDIS_URL is set
        except CacheBoxUnavailable as exc:
            raise CommandError(str(exc))
        self.stdout.write(f"cache box: {actions.cachebox().safe_url}")
        call_command("migrate", interactive=False, verbosity=0)
        self._first_admin(admin_password)
        actions.publish_all_devices()  # an embedded cache box starts empty: boards need their records

        children: list[subprocess.Popen] = []
        try:
            children.append(self._spawn("control worker", [sys.executable, "-m", "celery", "-A", "dashboard", "worker", "--queues", Queue.CONTROL.value, "--pool", "threads", "--concurrency", "2", "--hostname", "control@%h", "--loglevel", "warning", "--without-gossip", "--without-mingle"]))
            if not no_boards:
                for spec in DEMO_BOARDS:
                    token = self._demo_token(spec)
                    children.append(
                        self._spawn(
                            f"board {spec['name']}" + (f" (compute paced to {spec['compute_profile']})" if spec["compute_profile"] else ""),
                            [sys.executable, "manage.py", "edge", "--name", spec["name"]],
                            {"EDGECACHE_DEVICE_TOKEN": token, "EDGECACHE_COMPUTE_PROFILE": spec["compute_profile"]},
                        )
                    )
            self.stdout.write(self.style.SUCCESS(f"dashboard: http://{host}:{port}/  (Ctrl-C stops everything; `make stop` also ends the cache box)"))
            from daphne.cli import CommandLineInterface

            # Ctrl-C must stop everything even when started from a shell that ignores SIGINT.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            CommandLineInterface().run(["-b", host, "-p", str(port), "dashboard.asgi:application"])
        finally:
            self._stop(children)

    def _spawn(self, label: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        self.stdout.write(f"starting {label}")
        return subprocess.Popen(argv, cwd=settings.BASE_DIR, env={**os.environ, **(env or {})})

    def _stop(self, children: list[subprocess.Popen]) -> None:
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

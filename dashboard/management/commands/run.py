"""python manage.py run: the whole system on one machine with embedded defaults."""

from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from cachebox.errors import CacheBoxUnavailable
from inference.board import cachebox_url


class Command(BaseCommand):
    help = "Start the cache box, migrate, create a first admin if none exists, and serve the dashboard."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--host", default="127.0.0.1")

    def handle(self, *args, host, port, **options):
        try:
            url = cachebox_url()
        except CacheBoxUnavailable as exc:
            raise CommandError(str(exc))
        self.stdout.write(f"cache box: {url.split('@')[-1]}")
        call_command("migrate", interactive=False, verbosity=0)
        self._first_admin()
        self.stdout.write(
            f"dashboard: http://{host}:{port}/  (Ctrl-C stops it; `make stop` ends the embedded cache box)\n"
            "try a prompt: python manage.py infer --prompt-file prompt.txt"
        )
        from daphne.cli import CommandLineInterface

        CommandLineInterface().run(["-b", host, "-p", str(port), "--access-log", "-", "dashboard.asgi:application"])

    def _first_admin(self) -> None:
        User = get_user_model()
        if User.objects.filter(is_superuser=True).exists():
            return
        password = secrets.token_urlsafe(12)
        User.objects.create_superuser("admin", "", password)
        self.stdout.write(self.style.WARNING(f"first admin account: admin / {password}  (shown once; change it in Admin)"))

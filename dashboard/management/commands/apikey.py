"""python manage.py apikey create --namespace NAME [--name LABEL] [--rate N] | list | revoke ID

Keys of the OpenAI-compatible API (/v1/). ``create`` prints the key once (only its SHA-256 is
kept: a lost key is revoked and replaced, never recovered).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from dashboard.actions.api_keys import create_key, revoke_key
from dashboard.models import ApiKey


class Command(BaseCommand):
    help = "Create, list and revoke API keys of the OpenAI-compatible API (/v1/); a key reaches one namespace's boards."

    def add_arguments(self, parser):
        verbs = parser.add_subparsers(dest="verb", required=True, metavar="create|list|revoke")
        create = verbs.add_parser("create", help="make a key (printed once)")
        create.add_argument("--namespace", required=True, help="the namespace (tenant) whose boards the key reaches")
        create.add_argument("--name", default="", help="what the key is for (shown in lists and in its runs' titles)")
        create.add_argument(
            "--rate",
            type=int,
            default=None,
            metavar="N",
            help="requests per minute (default EDGECACHE_API_RATE, 60; 0: no limit)",
        )
        verbs.add_parser("list", help="every key: id, first characters, name, namespace, rate, last use, revoked")
        revoke = verbs.add_parser("revoke", help="refuse a key from its next request on")
        revoke.add_argument("id", type=int, help="the key's id (from `apikey list`)")

    def handle(self, *args, verb, **options):
        return getattr(self, f"_{verb}")(**options)

    def _create(self, namespace, name, rate, **_):
        if rate is not None and rate < 0:
            raise CommandError("--rate must be 0 (no limit) or more requests per minute")
        try:
            row, key = create_key(None, namespace, name=name, rate_per_minute=rate)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(key)
        self.stderr.write(
            f"API key {row.pk} for namespace {row.namespace_id} (rate {row.rate() or 'unlimited'}/min). "
            "Copy it now: it is not shown again (only its SHA-256 is kept)."
        )

    def _list(self, **_):
        rows = ApiKey.objects.order_by("pk")
        if not rows:
            self.stdout.write("no API keys; make one with `python manage.py apikey create --namespace NAME`")
            return
        self.stdout.write(
            f"{'id':>4}  {'key':<12} {'namespace':<16} {'rate/min':>8}  {'last used':<20} {'state':<8} name"
        )
        for row in rows:
            last = row.last_used.strftime("%Y-%m-%d %H:%M:%S") if row.last_used else "never"
            state = "revoked" if row.revoked_at else "active"
            rate = row.rate() or "none"
            self.stdout.write(
                f"{row.pk:>4}  {row.key_prefix + '…':<12} {row.namespace_id:<16} {rate!s:>8}  {last:<20} {state:<8} {row.name}"
            )

    def _revoke(self, id, **_):
        row = ApiKey.objects.filter(pk=id).first()
        if row is None:
            raise CommandError(f"no API key {id}; `python manage.py apikey list` shows them")
        if row.revoked_at is not None:
            self.stdout.write(f"API key {id} was already revoked at {row.revoked_at:%Y-%m-%d %H:%M:%S}")
            return
        revoke_key(None, row)
        self.stdout.write(f"revoked API key {id} ({row.key_prefix}…, namespace {row.namespace_id})")

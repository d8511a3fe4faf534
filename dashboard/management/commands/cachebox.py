"""python manage.py cachebox {start,stop,status,flush,cluster-start,cluster-stop}: the cache box from the command line."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from cachebox import embedded
from cachebox.errors import CacheBoxUnavailable, InvalidNamespace
from cachebox.keys import check_namespace
from cachebox.store import CacheBox


class Command(BaseCommand):
    help = "Start, stop, inspect or flush the cache box (the embedded Valkey unless REDIS_URL is set)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("start", help="start this checkout's embedded cache box (no-op when running)")
        sub.add_parser("stop", help="stop this checkout's embedded cache box")
        sub.add_parser("status", help="where the cache box is, whether it answers, what it holds")
        flush = sub.add_parser("flush", help="delete entries (and the namespace's catalog)")
        flush.add_argument("--namespace", help="only this namespace (default: every namespace)")
        flush.add_argument("--model", help="only this model fingerprint")
        flush.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        sub.add_parser(
            "cluster-start",
            help="start a 3-master Valkey Cluster on loopback to try EDGECACHE_CACHEBOX_URL with (no-op when running)",
        )
        sub.add_parser("cluster-stop", help="stop that cluster")

    def handle(self, *args, action, **options):
        return getattr(self, f"do_{action.replace('-', '_')}")(**options)

    def _embedded_only(self, verb: str) -> bool:
        if not settings.REDIS_URL_IS_EMBEDDED:
            self.stdout.write(f"REDIS_URL is set ({settings.REDIS_URL.split('@')[-1]}): nothing to {verb} here.")
            return False
        return True

    def do_start(self, **options):
        if self._embedded_only("start"):
            try:
                embedded.ensure_running(
                    settings.EDGECACHE_EMBEDDED_DIR,
                    port=settings.EDGECACHE_EMBEDDED_PORT,
                    maxmemory=settings.EDGECACHE_EMBEDDED_MAXMEMORY,
                    max_value=settings.EDGECACHE_BOARD.max_entry_bytes,
                    password=settings.EDGECACHE_EMBEDDED_PASSWORD,
                    bind=settings.EDGECACHE_EMBEDDED_BIND,
                )
            except CacheBoxUnavailable as exc:
                raise CommandError(str(exc))
            self.stdout.write(
                f"embedded cache box running at {CacheBox(settings.REDIS_URL).safe_url} (data in {settings.EDGECACHE_EMBEDDED_DIR})"
            )

    def do_stop(self, **options):
        if self._embedded_only("stop"):
            stopped = embedded.stop(
                settings.EDGECACHE_EMBEDDED_DIR,
                settings.EDGECACHE_EMBEDDED_PORT,
                password=settings.EDGECACHE_EMBEDDED_PASSWORD,
            )
            self.stdout.write("embedded cache box stopped" if stopped else "embedded cache box was not running")

    def _cluster_dir(self):
        return settings.EDGECACHE_EMBEDDED_DIR.parent / "valkey-cluster"

    def do_cluster_start(self, **options):
        try:
            cluster = embedded.ensure_cluster(self._cluster_dir())
        except CacheBoxUnavailable as exc:
            raise CommandError(str(exc))
        self.stdout.write(
            f"Valkey Cluster running (data in {cluster.data_dir}); point the cache box at it with\n  EDGECACHE_CACHEBOX_URL={cluster.url}"
        )

    def do_cluster_stop(self, **options):
        stopped = embedded.stop_cluster(self._cluster_dir())
        self.stdout.write("Valkey Cluster stopped" if stopped else "no Valkey Cluster was started here")

    def do_status(self, **options):
        store = CacheBox(settings.EDGECACHE_CACHEBOX_URL or settings.REDIS_URL)
        if settings.EDGECACHE_CACHEBOX_URL:
            kind = "EDGECACHE_CACHEBOX_URL"
        else:
            kind = "embedded Valkey" if settings.REDIS_URL_IS_EMBEDDED else "REDIS_URL"
        if not store.ping():
            hint = "run `python manage.py cachebox start`" if kind == "embedded Valkey" else f"check {kind}"
            raise CommandError(f"cache box ({kind}, {store.safe_url}) does not answer; {hint}")
        try:
            entries = sum(1 for _ in store.scan_entries())
            memory = store.memory_used()
        except CacheBoxUnavailable as exc:  # went away, or refused, between PING and here
            raise CommandError(str(exc))
        self.stdout.write(f"cache box ({kind}) at {store.safe_url}: up, {entries} entries, {memory} used")

    def do_flush(self, namespace=None, model=None, yes=False, **options):
        try:
            if namespace:
                check_namespace(namespace)
        except InvalidNamespace as exc:
            raise CommandError(str(exc))
        scope = f"namespace {namespace}" if namespace else "every namespace"
        if model:
            scope += f", model {model}"
        if not yes:
            answer = input(f"Delete the cache entries of {scope}? [y/N] ")
            if answer.strip().lower() not in {"y", "yes"}:
                self.stdout.write("nothing deleted")
                return
        try:
            removed = CacheBox(settings.EDGECACHE_CACHEBOX_URL or settings.REDIS_URL).flush(namespace, model)
        except (CacheBoxUnavailable, ValueError) as exc:
            raise CommandError(str(exc))
        self.stdout.write(f"deleted {removed} entries of {scope}")

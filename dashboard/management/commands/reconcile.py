"""python manage.py reconcile: rebuild the CacheEntry mirror and the master catalogs from the store."""

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from cachebox.errors import CacheBoxUnavailable
from cachebox.store import CacheBox
from dashboard.store.mirror import reconcile


class Command(BaseCommand):
    help = "Scan the cache box and make the admin's entry list and every namespace's master catalog match it."

    def handle(self, *args, **options):
        store = CacheBox(settings.EDGECACHE_CACHEBOX_URL or settings.REDIS_URL, timeout=30)
        if not store.ping():
            raise CommandError(f"the cache box at {store.safe_url} does not answer")
        try:
            with tqdm(desc="reconcile", unit="entry") as bar:
                result = reconcile(store, progress=bar.update)
        except CacheBoxUnavailable as exc:
            raise CommandError(str(exc))
        self.stdout.write(
            f"{result['entries']} entries in the cache box; {result['removed_rows']} stale rows removed; "
            f"catalogs rebuilt for: {', '.join(result['namespaces']) or 'none'}"
        )

"""Keeping the CacheEntry mirror in step with the store (uploads, hits, reconcile)."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from cachebox.entry import decode_header
from cachebox.errors import EntryError
from cachebox.keys import parse_entry_key_name
from cachebox.store import CacheBox
from cachebox.sync import rebuild_master_catalog
from dashboard.models import CacheEntry


def record_uploads(uploads: list[dict], device: str) -> None:
    """Rows for entries a board just stored (an entry stored again is updated, not doubled)."""
    for item in uploads:
        CacheEntry.objects.update_or_create(
            key=item["name"],
            defaults={
                "model": item["model"],
                "namespace": item["namespace"],
                "start": item["start"],
                "end": item["end"],
                "bytes": item["bytes"],
                "creator_device": device,
            },
        )


def record_hits(names: list[str]) -> None:
    if names:
        CacheEntry.objects.filter(key__in=names).update(hits=F("hits") + 1, last_hit=timezone.now())


def reconcile(store: CacheBox, progress=None) -> dict:
    """Rebuild the mirror and every namespace's master catalog from what the store holds."""
    seen: dict[str, dict] = {}
    keys_by_namespace: dict[str, list[bytes]] = {}
    names = list(store.scan_entries())
    for start in range(0, len(names), 200):
        batch = names[start : start + 200]
        # Two round trips per batch (heads, then TTLs), not one per entry.
        for name, prefix, ttl in zip(batch, store.read_prefixes(batch, 4096), store.ttls(batch)):
            try:
                namespace, fingerprint, key = parse_entry_key_name(name)
                parsed = decode_header(prefix)
                if isinstance(parsed, int):
                    raise EntryError("header longer than expected")
                header, offset = parsed
            except (ValueError, EntryError):
                store.delete([name])  # unreadable: it could never be served
                continue
            seen[name] = {
                "model": fingerprint,
                "namespace": namespace,
                "start": header.start,
                "end": header.end,
                "bytes": offset + header.state_bytes,
                "creator_device": header.device,
                "pinned": ttl == -1,
            }
            keys_by_namespace.setdefault(namespace, []).append(key)
        if progress:
            progress(len(batch))
    with transaction.atomic():
        removed, _ = CacheEntry.objects.exclude(key__in=list(seen)).delete()
        for name, fields in seen.items():
            CacheEntry.objects.update_or_create(key=name, defaults=fields)
    for namespace, keys in keys_by_namespace.items():
        rebuild_master_catalog(store, namespace, keys)
    return {"entries": len(seen), "removed_rows": removed, "namespaces": sorted(keys_by_namespace)}

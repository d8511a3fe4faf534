"""Per-device figures for the pages (read-only queries), and who may see which devices.

Staff see every namespace (tenant); any other user only the namespaces they are a member of
(``Membership``). Every page, chart and live event that shows devices or runs goes through
``visible_devices`` or ``recent_runs``.
"""

from __future__ import annotations

import statistics
from datetime import datetime, timezone as dt_timezone

from django.db.models import QuerySet

from .models import Device, InferenceRun

RECENT = 500  # runs per device the summaries look at


def device_summary(device: Device) -> dict:
    recent = list(device.runs.filter(error="").order_by("-created").values_list("ttft_ms", "case")[:RECENT])
    hits = sum(1 for _, case in recent if case in ("partial", "full"))
    catalogs = {}
    for namespace, catalog in ((device.status or {}).get("catalogs") or {}).items():
        last_sync = catalog.get("last_sync")
        catalogs[namespace] = {**catalog, "last_sync": datetime.fromtimestamp(last_sync, dt_timezone.utc) if last_sync else None}
    return {
        "device": device,
        "runs": device.runs.count(),
        "hit_ratio": hits / len(recent) if recent else None,
        "median_ttft_ms": statistics.median(ttft for ttft, _ in recent) if recent else None,
        "catalog_items": sum(c.get("approx_items", 0) for c in catalogs.values()),
        "catalog_fp_rate": max((c.get("estimated_fp_rate", 0.0) for c in catalogs.values()), default=None),
        "catalogs": catalogs,
    }


def sees_every_namespace(user) -> bool:
    return bool(user is not None and user.is_authenticated and user.is_active and (user.is_staff or user.is_superuser))


def visible_devices(user) -> QuerySet[Device]:
    """The devices ``user`` may see: all for staff, else those of the user's namespaces."""
    devices = Device.objects.select_related("namespace")
    if sees_every_namespace(user):
        return devices
    if user is None or not user.is_authenticated or not user.is_active:
        return devices.none()
    return devices.filter(namespace__memberships__user=user)  # (user, namespace) is unique: no duplicates


def visible_device_names(user) -> frozenset[str] | None:
    """Names of the devices ``user`` may see; None for "every device" (staff). One query."""
    if sees_every_namespace(user):
        return None
    return frozenset(visible_devices(user).values_list("name", flat=True))


def recent_runs(viewer, limit: int = 200, device: Device | None = None) -> list[InferenceRun]:
    """The newest successful runs ``viewer`` may see (oldest first), of one device or all."""
    runs = InferenceRun.objects.select_related("device").filter(error="")
    if not sees_every_namespace(viewer):
        runs = runs.filter(device__in=visible_devices(viewer))
    if device is not None:
        runs = runs.filter(device=device)
    return list(reversed(runs.order_by("-created")[:limit]))

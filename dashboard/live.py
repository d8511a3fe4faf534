"""Broadcasting to every open dashboard page (Channels group ``live``).

Every event names the device it is about (``device``; a ``device`` event's own ``name``): each
page's consumer forwards only events of devices its user may see (dashboard.consumers).
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)

GROUP = "live"
DEVICE_EVENT = "device"  # a device changed (registered, heartbeat, revoked, moved): its data is device_json


def event_device(event: str, data: dict) -> str | None:
    """The name of the device an event is about; None if it names none (then only staff get it)."""
    name = data.get("name") if event == DEVICE_EVENT else data.get("device")
    return name if isinstance(name, str) else None


def broadcast(event: str, data: dict) -> None:
    """Send ``data`` to every open page; a channel layer that is down never fails the caller."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(GROUP, {"type": "live.event", "event": event, "data": data, "device": event_device(event, data)})
    except Exception as exc:  # the page misses one live update; the data is stored anyway
        log.warning("live update %s not broadcast: %s", event, exc)

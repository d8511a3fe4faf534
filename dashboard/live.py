"""Broadcasting to every open dashboard page (Channels group ``live``)."""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)

GROUP = "live"


def broadcast(event: str, data: dict) -> None:
    """Send ``data`` to every open page; a channel layer that is down never fails the caller."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(GROUP, {"type": "live.event", "event": event, "data": data})
    except Exception as exc:  # the page misses one live update; the data is stored anyway
        log.warning("live update %s not broadcast: %s", event, exc)

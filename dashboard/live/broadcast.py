"""Broadcasting to every open dashboard page (Channels group ``live``).

Every event names the device it is about (``device``; a ``device`` event's own ``name``): each
page's consumer forwards only events of devices its user may see (dashboard.live.consumers).
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from channels_redis.core import RedisChannelLayer
from cryptography.fernet import InvalidToken

from cachebox.events import security_event

log = logging.getLogger(__name__)

GROUP = "live"
DEVICE_EVENT = "device"  # a device changed (registered, heartbeat, revoked, moved): its data is device_json


def event_device(event: str, data: dict) -> str | None:
    """The name of the device an event is about; None if it names none (then only staff get it)."""
    name = data.get("name") if event == DEVICE_EVENT else data.get("device")
    return name if isinstance(name, str) else None


def broadcast(event: str, data: dict) -> None:
    """Send ``data`` to every open page; a channel layer that is down never fails the caller."""
    async_to_sync(abroadcast)(event, data)


async def abroadcast(event: str, data: dict) -> None:
    """``broadcast`` for async code (the API sends it beside its answer, not before)."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        await layer.group_send(
            GROUP, {"type": "live.event", "event": event, "data": data, "device": event_device(event, data)}
        )
    except Exception as exc:  # the page misses one live update; the data is stored anyway
        log.warning("live update %s not broadcast: %s", event, exc)


class AuthenticatedChannelLayer(RedisChannelLayer):
    """The Redis channel layer whose messages must decrypt under the server's key
    (``symmetric_encryption_keys``, Fernet: encrypted and authenticated). A message someone else
    wrote into the layer's keys is dropped and logged; the page keeps listening (the stock layer
    raises, which would close every open page's socket)."""

    async def receive_single(self, channel):
        while True:
            try:
                return await super().receive_single(channel)
            except InvalidToken:
                security_event(
                    "live_event_refused",
                    channel=channel[:100],
                    reason="not made by this server (does not decrypt under its key)",
                )

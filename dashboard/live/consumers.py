"""WebSocket: every open dashboard page joins the ``live`` group and receives runs and device
changes, of the devices its user may see only (staff: all; others: their namespaces' devices)."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from dashboard.actions.devices import device_json
from dashboard.live.broadcast import DEVICE_EVENT, GROUP, event_device
from dashboard.models import Device
from dashboard.ops import metrics
from dashboard.pages.stats import visible_device_names


@database_sync_to_async
def _allowed_devices(user_pk: int) -> frozenset[str] | None | bool:
    """The device names the user may see now (None: every device), False if the user is gone or
    inactive. Two small queries: the user's flags, then the names of their namespaces' devices."""
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.filter(pk=user_pk, is_active=True).first()
    if user is None:
        return False
    return visible_device_names(user)


SYNC_LIMIT = 500  # device names a page may ask the state of at once (a page shows 50 a table)


@database_sync_to_async
def _device_states(names: list[str]) -> list[dict]:
    """The current state of the named devices, as a ``device`` event carries it. One query."""

    return [device_json(device) for device in Device.objects.filter(name__in=names).select_related("namespace")]


class LiveConsumer(AsyncJsonWebsocketConsumer):
    allowed: frozenset[str] | None = frozenset()  # None: every device (staff)

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            metrics.refused("login_required")
            await self.close(code=4401)  # log in first: the session cookie is checked here
            return
        self.user_pk = user.pk
        allowed = await _allowed_devices(user.pk)
        if allowed is False:
            await self.close(code=4401)
            return
        self.allowed = allowed
        await self.channel_layer.group_add(GROUP, self.channel_name)
        await self.accept()

    async def receive_json(self, content, **kwargs):
        """``{"sync": [names]}``: a page that (re)connects asks the state of the devices it shows,
        so what changed while its socket was down (or not yet open) reaches it too."""
        names = content.get("sync") if isinstance(content, dict) else None
        if not isinstance(names, list):
            return
        names = sorted({name for name in names[:SYNC_LIMIT] if isinstance(name, str) and len(name) <= 100})
        if self.allowed is not None:
            names = [name for name in names if name in self.allowed]
        if not names:
            return
        for data in await _device_states(names):
            await self.send_json({"event": DEVICE_EVENT, "data": data})

    async def disconnect(self, code):
        await self.channel_layer.group_discard(GROUP, self.channel_name)

    async def live_event(self, message):
        event, data = message["event"], message["data"]
        device = message.get("device") or event_device(event, data)
        if event == DEVICE_EVENT:
            # Devices are registered, moved between namespaces, revoked; memberships change: a
            # device event (every heartbeat brings one) refreshes what this page may see.
            allowed = await _allowed_devices(self.user_pk)
            if allowed is False:
                await self.close(code=4401)
                return
            self.allowed = allowed
        if self.allowed is not None and device not in self.allowed:
            return  # another tenant's device (or an event naming none): not for this page
        await self.send_json({"event": event, "data": data})

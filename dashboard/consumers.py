"""WebSocket: every open dashboard page joins the ``live`` group and receives runs and device changes."""

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from . import metrics
from .live import GROUP


class LiveConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            metrics.refused("login_required")
            await self.close(code=4401)  # log in first: the session cookie is checked here
            return
        await self.channel_layer.group_add(GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        await self.channel_layer.group_discard(GROUP, self.channel_name)

    async def live_event(self, message):
        await self.send_json({"event": message["event"], "data": message["data"]})

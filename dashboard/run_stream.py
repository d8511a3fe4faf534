"""The Run page follows its runs as boards answer them: stages and tokens, over the same Redis
pub/sub channels the API streams from (``cachebox.streams``; the board's ``StreamEvent``s).

The page posts its form with ``Accept: application/x-ndjson``; once the form is valid and within
the rate limit, the response is one JSON object per line:

- ``{"event": "dispatched", "dispatched": [{"request_id", "device"}, ...]}`` once the runs are sent
  (each channel is subscribed first, so no token is missed);
- ``{"event": "stage" | "token" | "done" | "error", "request_id", "device", ...}`` as each board
  reports (``stage``: ``started`` when the board took the run off its queue);
- ``{"event": "refused", "errors": ..., "dispatched": [...]}`` if the broker failed while sending;
- ``{"event": "closed"}`` when every run has ended (or the runs' expiry has passed).

The signed report still makes the run's record (``actions.record_run``; the page's ``run`` live
event). Leaving the page does not cancel a run: the Cancel button does (``cancel_runs``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from asgiref.sync import sync_to_async
from django.conf import settings
from kombu.exceptions import OperationalError as BrokerUnavailable

from cachebox import streams
from cachebox.errors import CacheBoxError, CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.keys import cancel_key_name, stream_channel
from inference.messages import MessageRefused, RunRequest, StreamEvent

from . import actions
from .models import Device, Dispatch
from .signing import cancel_flag, control_plane_public_key
from .stats import visible_devices

log = logging.getLogger("dashboard.run_stream")

CONTENT_TYPE = "application/x-ndjson"
WAIT_MARGIN_S = 30  # past the runs' expiry a waiting page stops listening


def line(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False) + "\n"


async def follow(user, devices: list[Device], asked: RunRequest, routed=None, request_ids: list[str] | None = None):
    """Subscribe to each run's channel, dispatch the runs, then yield their events as lines
    (``routed``: the router's choice of a prompt sent to any board, as ``dispatch_run`` takes it;
    ``request_ids``: one per device, as counted in the bounded queues)."""
    asked = asked.model_copy(update={"stream": True})
    request_ids = request_ids or [str(uuid.uuid4()) for _ in devices]
    subscriptions = [
        streams.subscribe(actions.cachebox_url(), stream_channel(device.name, request_id), connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT, timeout=settings.EDGECACHE_IO_TIMEOUT)
        for device, request_id in zip(devices, request_ids)
    ]
    openers = [await sync_to_async(_opener)(device) for device in devices]
    try:
        try:
            for subscription in subscriptions:
                await subscription.open()
        except CacheBoxUnavailable as exc:
            yield line({"event": "refused", "errors": {"__all__": [{"message": f"The cache box does not answer: {exc}. Nothing was sent.", "code": "cachebox_unavailable"}]}, "dispatched": []})
            return
        sent: list[dict] = []
        for device, request_id in zip(devices, request_ids):
            try:
                sent += await sync_to_async(actions.dispatch_run)(user, [device], asked, [request_id], routed=routed)
            except BrokerUnavailable as exc:
                not_sent = [d.name for d in devices[len(sent):]]
                message = (
                    f"The message broker (the cache box's Redis) is not reachable: {exc}; "
                    + (f"sent to {', '.join(item['device'] for item in sent)} only; not sent to {', '.join(not_sent)}." if sent else "nothing was sent.")
                )
                yield line({"event": "refused", "errors": {"__all__": [{"message": message, "code": "broker_unavailable"}]}, "dispatched": sent})
                break
        if not sent:
            return
        yield line({"event": "dispatched", "dispatched": sent})
        async for event in _merged([subscriptions[i] for i in range(len(sent))], [item["request_id"] for item in sent], openers[: len(sent)]):
            yield line(event)
        yield line({"event": "closed"})
    finally:
        for subscription in subscriptions:
            await subscription.close()


def _opener(device: Device):
    """What reads ``device``'s events: its board's public key and its namespace's ring."""
    from .signing import stream_ring_for

    return device.name, device.signing_public_key, stream_ring_for(device)


async def _merged(subscriptions: list[streams.Subscription], request_ids: list[str], openers: list):
    """Every run's events, as they come, until each run ended (done or error) or expired: only
    events the board each run went to sealed and signed for it."""
    queue: asyncio.Queue = asyncio.Queue()
    deadline = settings.EDGECACHE_TASK_EXPIRES + WAIT_MARGIN_S

    async def read(subscription: streams.Subscription, request_id: str, opener) -> None:
        device, signer, ring_for = opener
        control_plane_key = await sync_to_async(control_plane_public_key)()
        loop = asyncio.get_running_loop()
        until = loop.time() + deadline
        try:
            while (remaining := until - loop.time()) > 0:
                data = await subscription.get(min(remaining, 30.0))
                if data is None:
                    continue
                try:
                    event = StreamEvent.open(data, request_id=request_id, signer_public_key=signer, ring_for=ring_for, control_plane_key=control_plane_key)
                except MessageRefused as exc:
                    security_event("stream_event_refused", device=device, request_id=request_id, reason=str(exc)[:300])
                    continue
                if event.type == "resent":  # its board died: follow the board it was sent to
                    moved = await Device.objects.filter(name=event.device).afirst()
                    if moved is not None and moved.signing_public_key:
                        device, signer = moved.name, moved.signing_public_key
                        await subscription.add(stream_channel(moved.name, request_id))
                    await queue.put({"event": "resent", "request_id": request_id, "device": event.device, "reason": event.error})
                    continue
                await queue.put(_as_line(event))
                if event.type in ("done", "error"):
                    return
        except CacheBoxError as exc:
            await queue.put({"event": "lost", "request_id": request_id, "error": f"lost the cache box while following the run: {exc}; its record still arrives"})
        finally:
            await queue.put(None)

    readers = [asyncio.create_task(read(subscription, request_id, opener)) for subscription, request_id, opener in zip(subscriptions, request_ids, openers)]
    try:
        running = len(readers)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


def _as_line(event: StreamEvent) -> dict:
    body = {"event": event.type, "request_id": event.request_id, "device": event.device}
    if event.type == "token":
        body.update(index=event.index, text=event.text)
    elif event.type == "stage":
        body["stage"] = event.stage
    elif event.type == "done":
        body.update(finish_reason=event.finish_reason, text=event.text, ttft_ms=event.breakdown.get("ttft_ms"), generated_tokens=event.breakdown.get("generated_tokens"))
    elif event.type == "error":
        body["error"] = event.error
    return body


def cancel_runs(user, request_ids: list[str]) -> list[str]:
    """Set the cancel flag of each run ``user`` may see (dispatched to a device visible to them);
    its board stops between two tokens, or never starts it. Returns the ids cancelled."""
    wanted = []
    for request_id in request_ids:
        try:
            wanted.append(uuid.UUID(str(request_id)))
        except ValueError:
            continue
    allowed = visible_devices(user).values_list("pk", flat=True)
    dispatches = Dispatch.objects.filter(request_id__in=wanted, kind="run", device_id__in=allowed).select_related("device")
    cancelled = []
    store = actions.cachebox()
    for dispatch in dispatches:
        request_id = str(dispatch.request_id)
        store.set_flag(cancel_key_name(dispatch.device.name, request_id), settings.EDGECACHE_TASK_EXPIRES + 60, cancel_flag(dispatch.device.name, request_id))
        cancelled.append(request_id)
    return cancelled

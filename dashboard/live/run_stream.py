"""The Run page follows its runs as boards answer them: stages and tokens, over the same Redis
pub/sub channels the API streams from (``dashboard.live.streams``; the board's ``StreamEvent``s).

The page posts its form with ``Accept: application/x-ndjson``; once the form is valid and within
the rate limit, the response is one JSON object per line:

- ``{"event": "dispatched", "dispatched": [{"request_id", "device"}, ...]}`` once the runs are sent
  (each channel is subscribed first, so no token is missed);
- ``{"event": "stage" | "token" | "done" | "error", "request_id", "device", ...}`` as each board
  reports (``stage``: ``started`` when the board took the run off its queue; ``waiting``, with
  ``error`` saying why: the control plane's word that its board went quiet and the run waits for it);
- ``{"event": "resent", "request_id", "device", "from", "reason", "tokens"}`` when its board went
  quiet and the run moved to ``device``, which goes on from the ``tokens`` already shown (the
  page listens to the new board before it is sent there);
- ``{"event": "refused", "errors": ..., "dispatched": [...]}`` if the broker failed while sending;
- ``{"event": "closed"}`` when every run has ended. A run of which nothing final came by the time
  its client stops waiting (the control plane's verdict included) ends with an ``error`` line first.

The signed report still makes the run's record (``actions.record_run``; the page's ``run`` live
event). Leaving the page does not cancel a run: the Cancel button does (``cancel_runs``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from asgiref.sync import sync_to_async
from django.conf import settings
from kombu.exceptions import OperationalError as BrokerUnavailable

from cachebox.errors import CacheBoxError, CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.keys import cancel_key_name, stream_channel
from dashboard import actions
from dashboard.actions.runs import continue_run, heard, keep_streamed
from dashboard.live import streams
from dashboard.models import Device, Dispatch
from dashboard.pages.stats import visible_devices
from dashboard.security.signing import cancel_flag, control_plane_public_key, stream_ring_for
from inference.contract.envelope import EnvelopeRefused, peek
from inference.contract.messages import MessageRefused, RunRequest, StreamEvent

log = logging.getLogger("dashboard.live.run_stream")

CONTENT_TYPE = "application/x-ndjson"
WAIT_MARGIN_S = 30  # past the runs' expiry a waiting page still listens (``actions.runs.PAGE_WAIT_MARGIN_S``: the sweeper's word comes first)
HEARD_EVERY_S = 1.0  # how often a follower notes that it heard its board (``actions.runs.heard``)


def listen_s() -> float:
    """How long the Run page follows a run: while its client waits (its expiry and the margin),
    then two sweeps more, so the sweeper's verdict on a run nobody answered reaches the page."""
    return settings.EDGECACHE_TASK_EXPIRES + WAIT_MARGIN_S + 2 * settings.EDGECACHE_SWEEP_SECONDS + 5


_BESIDE: set[asyncio.Task] = set()  # tasks run beside a followed answer, kept until done (the loop holds them weakly)


def beside(work) -> None:
    """Run the awaitable ``work`` beside the answer (its result and errors are not waited for)."""
    task = asyncio.ensure_future(work)
    _BESIDE.add(task)
    task.add_done_callback(_BESIDE.discard)


class Followed:
    """One run as its follower (the Run page's stream, the API's answer) has seen it: the board it
    listens to, the answer its client has (its text and token ids: where a re-sent run goes on
    from), the boards it left. Events are accepted from the board the run is with, or from the
    control plane; a board left behind (it went quiet, then woke) is dropped without a word.

    ``in_thread``: how the caller runs synchronous work (the database, the broker) off its loop."""

    def __init__(
        self, request_id: str, device: str, signer: str, ring_for, control_plane_key: str, in_thread=sync_to_async
    ):
        self.request_id = request_id
        self.device, self.signer, self.ring_for = device, signer, ring_for
        self.control_plane_key = control_plane_key
        self.in_thread = in_thread
        self.text = ""
        self.tokens: list[int] = []
        self.left: set[str] = set()
        self.moves: list[dict] = []
        self._noted = 0.0

    def open(self, data: bytes) -> StreamEvent | None:
        """The event in ``data``, if the run's board (or the control plane) sent it; None otherwise."""
        try:
            event = StreamEvent.open(
                data,
                request_id=self.request_id,
                signer_public_key=self.signer,
                ring_for=self.ring_for,
                control_plane_key=self.control_plane_key,
            )
        except MessageRefused as exc:
            if self._sender(data) in self.left:
                return None  # the board the run moved away from, woken: told to drop it
            security_event(
                "stream_event_refused", device=self.device, request_id=self.request_id, reason=str(exc)[:300]
            )
            return None
        if event.type == "token":
            self.text += event.text
            self.tokens += event.tokens
        if event.type in ("token", "done") or (event.type == "stage" and event.stage != "waiting"):
            now = time.monotonic()
            if now - self._noted >= HEARD_EVERY_S:  # the board is alive and has the run (the sweeper reads it)
                self._noted = now
                beside(self.in_thread(heard)(self.device, self.request_id))
        return event

    @staticmethod
    def _sender(data: bytes) -> str:
        try:
            return str(peek(json.loads(data))["from"])
        except (ValueError, UnicodeDecodeError, EnvelopeRefused):
            return ""

    async def move(self, subscription: streams.Subscription, event: StreamEvent) -> dict:
        """The run moved to board ``event.device`` (its board went quiet): listen there first, then
        send it there, going on from the answer the client has (``actions.runs.continue_run``)."""
        moved = await Device.objects.filter(name=event.device).afirst()
        move = {"from": self.device, "device": event.device, "reason": event.error, "tokens": len(self.tokens)}
        if moved is None or not moved.signing_public_key:
            return move
        await subscription.add(stream_channel(moved.name, self.request_id))
        self.left.add(self.device)
        self.device, self.signer = moved.name, moved.signing_public_key
        await self.in_thread(continue_run)(self.request_id, moved.name, list(self.tokens), self.text)
        self.moves.append(move)
        return move

    def gave_up(self) -> None:
        """Its client stops following without an answer: a run that ends unanswered keeps what it had."""
        if self.text:
            beside(self.in_thread(keep_streamed)(self.request_id, self.text))


def line(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False) + "\n"


async def follow(user, devices: list[Device], asked: RunRequest, routed=None, request_ids: list[str] | None = None):
    """Subscribe to each run's channel, dispatch the runs, then yield their events as lines
    (``routed``: the router's choice of a prompt sent to any board, as ``dispatch_run`` takes it;
    ``request_ids``: one per device, as counted in the bounded queues)."""
    asked = asked.model_copy(update={"stream": True})
    request_ids = request_ids or [str(uuid.uuid4()) for _ in devices]
    subscriptions = [
        streams.subscribe(
            actions.cachebox_url(),
            stream_channel(device.name, request_id),
            connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT,
            timeout=settings.EDGECACHE_IO_TIMEOUT,
        )
        for device, request_id in zip(devices, request_ids)
    ]
    openers = [await sync_to_async(_opener)(device) for device in devices]
    try:
        try:
            for subscription in subscriptions:
                await subscription.open()
        except CacheBoxUnavailable as exc:
            yield line(
                {
                    "event": "refused",
                    "errors": {
                        "__all__": [
                            {
                                "message": f"The cache box does not answer: {exc}. Nothing was sent.",
                                "code": "cachebox_unavailable",
                            }
                        ]
                    },
                    "dispatched": [],
                }
            )
            return
        sent: list[dict] = []
        for device, request_id in zip(devices, request_ids):
            try:
                sent += await sync_to_async(actions.dispatch_run)(user, [device], asked, [request_id], routed=routed)
            except BrokerUnavailable as exc:
                not_sent = [d.name for d in devices[len(sent) :]]
                message = f"The message broker (the cache box's Redis) is not reachable: {exc}; " + (
                    f"sent to {', '.join(item['device'] for item in sent)} only; not sent to {', '.join(not_sent)}."
                    if sent
                    else "nothing was sent."
                )
                yield line(
                    {
                        "event": "refused",
                        "errors": {"__all__": [{"message": message, "code": "broker_unavailable"}]},
                        "dispatched": sent,
                    }
                )
                break
        if not sent:
            return
        yield line({"event": "dispatched", "dispatched": sent})
        async for event in _merged(
            [subscriptions[i] for i in range(len(sent))], [item["request_id"] for item in sent], openers[: len(sent)]
        ):
            yield line(event)
        yield line({"event": "closed"})
    finally:
        for subscription in subscriptions:
            await subscription.close()


def _opener(device: Device):
    """What reads ``device``'s events: its board's public key and its namespace's ring."""

    return device.name, device.signing_public_key, stream_ring_for(device)


async def _merged(subscriptions: list[streams.Subscription], request_ids: list[str], openers: list):
    """Every run's events, as they come, until each run ended (done or error) or its client stopped
    waiting: only events the board each run is with sealed and signed for it, or the control plane."""
    queue: asyncio.Queue = asyncio.Queue()
    deadline = listen_s()

    async def read(subscription: streams.Subscription, request_id: str, opener) -> None:
        device, signer, ring_for = opener
        control_plane_key = await sync_to_async(control_plane_public_key)()
        followed = Followed(request_id, device, signer, ring_for, control_plane_key)
        loop = asyncio.get_running_loop()
        until = loop.time() + deadline
        try:
            while (remaining := until - loop.time()) > 0:
                data = await subscription.get(min(remaining, 30.0))
                if data is None:
                    continue
                event = followed.open(data)
                if event is None:
                    continue
                if event.type == "resent":  # its board went quiet: listen to the board it moved to, then send it there
                    move = await followed.move(subscription, event)
                    await queue.put({"event": "resent", "request_id": request_id, **move})
                    continue
                await queue.put(_as_line(event, followed.device))
                if event.type in ("done", "error"):
                    if event.type == "error":
                        followed.gave_up()
                    return
            followed.gave_up()
            await queue.put(
                {
                    "event": "error",
                    "request_id": request_id,
                    "device": followed.device,
                    "error": f"no answer within {deadline:g} s; the page stopped waiting",
                }
            )
        except CacheBoxError as exc:
            followed.gave_up()
            await queue.put(
                {
                    "event": "lost",
                    "request_id": request_id,
                    "error": f"lost the cache box while following the run: {exc}; its record still arrives",
                }
            )
        finally:
            await queue.put(None)

    readers = [
        asyncio.create_task(read(subscription, request_id, opener))
        for subscription, request_id, opener in zip(subscriptions, request_ids, openers)
    ]
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


def _as_line(event: StreamEvent, device: str) -> dict:
    body = {"event": event.type, "request_id": event.request_id, "device": device}
    if event.type == "token":
        body.update(index=event.index, text=event.text)
    elif event.type == "stage":
        body["stage"] = event.stage
        if event.error:
            body["reason"] = event.error
    elif event.type == "done":
        body.update(
            finish_reason=event.finish_reason,
            text=event.text,
            ttft_ms=event.breakdown.get("ttft_ms"),
            generated_tokens=event.breakdown.get("generated_tokens"),
        )
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
    dispatches = Dispatch.objects.filter(request_id__in=wanted, kind="run", device_id__in=allowed).select_related(
        "device"
    )
    cancelled = []
    store = actions.cachebox()
    for dispatch in dispatches:
        request_id = str(dispatch.request_id)
        store.set_flag(
            cancel_key_name(dispatch.device.name, request_id),
            settings.EDGECACHE_TASK_EXPIRES + 60,
            cancel_flag(dispatch.device.name, request_id),
        )
        cancelled.append(request_id)
    return cancelled

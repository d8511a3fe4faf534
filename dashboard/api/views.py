"""The OpenAI-compatible endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (async views, served by the dashboard's ASGI server, `manage.py run`).

One request: check the key (401) and its rate (429), the body (400), choose a board of the
key's namespace (``routing``: 400/404/503), count it against the bounded queues of the key (429)
and the namespace (503: the fleet is busy; ``dashboard.admission``), subscribe to the run's pub/sub channel, dispatch
the run (``actions.dispatch_api_run``: a ``Dispatch`` row and a task on ``device.NAME``), then
follow the board's ``StreamEvent``s: each token as an SSE chunk (``stream: true``) or the whole
answer from the last ``done`` event. The response never waits on the database: the board's
signed report reaches ``actions.record_run`` in parallel and becomes the run's record
(``source="api"``). A client that goes away, or a board silent for ``EDGECACHE_API_TIMEOUT``
seconds (504), sets the run's cancel flag: the board stops within ~100 ms and records the run
as cancelled. A routed run whose board goes quiet mid-answer moves to another board
(``actions.sweeper``): the follower listens there first, then sends it with the tokens the client
already has, which that board continues from; the client receives one answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from asgiref.sync import SyncToAsync, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import close_old_connections
from django.db.models import Q
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from kombu.exceptions import OperationalError as BrokerUnavailable
from pydantic import ValidationError

from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.keys import cancel_key_name, stream_channel
from dashboard import admission
from dashboard.api import board_choice, keys
from dashboard.live import streams
from dashboard.live.broadcast import abroadcast
from dashboard.live.run_stream import Followed, beside
from dashboard.models import Schema
from dashboard.ops import metrics
from dashboard.security.signing import cancel_flag, control_plane_public_key, stream_ring_for
from inference.contract.messages import ChatMessage, RunMeta, RunRequest, SamplingSpec, StreamEvent
from inference.serving.strategies import parse_strategy

from ..actions.cache import cachebox_url
from ..actions.runs import dispatch_api_run
from ..models import ApiKey, Device
from .errors import ApiError, bad_request, board_error
from .requests import ApiRequest, parse_body, parse_request

log = logging.getLogger("dashboard.api")

RETRY_AFTER_S = 30  # what a client is told to wait when the cache box or broker is down
# Breakdown fields every answer carries in its "edgecache" object (like llama.cpp's "timings").
EXTENSION_FIELDS = (
    "case",
    "tier",
    "decision",
    "cachebox",
    "ttft_ms",
    "ttlt_ms",
    "prefill_ms",
    "redis_ms",
    "local_ms",
    "prompt_tokens",
    "matched_tokens",
    "generated_tokens",
    "fetched_bytes",
    "uploaded_bytes",
    "link",
    "modules_hit",
    "strategy",
    "behind_ms",
    "kernel_class",
    "approximate",
    "approximate_from",  # "approximate": "cross-class" when a state of another kernel class was used
)


# -- endpoints -------------------------------------------------------------------------------------
@csrf_exempt
async def models(request):
    """The models the key's namespace's online boards serve."""
    if request.method != "GET":
        return _method_not_allowed("GET")
    try:
        entries = await _in_thread(_online_models)(request)
    except ApiError as exc:
        return exc.response()
    return JsonResponse({"object": "list", "data": [_model_json(entry) for entry in entries]})


@csrf_exempt
async def model_detail(request, model: str):
    if request.method != "GET":
        return _method_not_allowed("GET")
    try:
        entries = await _in_thread(_online_models)(request)
    except ApiError as exc:
        return exc.response()
    for entry in entries:
        if model in (entry["id"], entry["fingerprint"]):
            return JsonResponse(_model_json(entry))
    return ApiError(
        404,
        f"No online board of this key's namespace serves {model!r}; GET /v1/models lists the models.",
        param="model",
        code="model_not_found",
    ).response()


def _online_models(request) -> list[dict]:
    """The models the online boards of the request's key's namespace serve (401/429 as any request)."""
    return board_choice.online_models(_authorized(request).namespace_id)


@csrf_exempt
async def chat_completions(request):
    return await _complete(request, "chat")


@csrf_exempt
async def completions(request):
    return await _complete(request, "completion")


# -- one completion ----------------------------------------------------------------------------------
async def _complete(request, kind: str) -> HttpResponse:
    if request.method != "POST":
        return _method_not_allowed("POST")
    admitted = _Admitted(Phases())
    # The request's synchronous work (database, cache, routing, the bounded queues, the dispatch) in
    # one hop to the API's threads, not one per step: each hop is a thread switch, and under
    # concurrent requests a wait for the interpreter's lock each way. Its stream is subscribed
    # from there on this loop, beside the work, before the run is sent.
    work = asyncio.ensure_future(_in_thread(_admit_and_dispatch)(request, kind, admitted, asyncio.get_running_loop()))
    try:
        await asyncio.shield(work)
    except BaseException as exc:
        if isinstance(exc, asyncio.CancelledError):  # the client left: the work ends on its thread, then is undone
            await asyncio.wait({work})
        await _undo(admitted)
        if isinstance(exc, ApiError):
            return exc.response()
        raise
    _beside(abroadcast("run.dispatched", admitted.dispatched))  # open pages hear of it beside the answer, not before it
    return await _answer(admitted)


class _SyncWork(ThreadPoolExecutor):
    """Threads for the API's synchronous work, kept from request to request with their database
    connections: Django's ASGI handler gives each request a thread of its own, so each request's
    first query opened a new connection (about 1 ms on SQLite, more on PostgreSQL). A connection
    that failed or outlived CONN_MAX_AGE is closed before the next work on its thread, as Django
    does between requests."""

    def submit(self, fn, /, *args, **kwargs):
        def work():
            close_old_connections()
            return fn(*args, **kwargs)

        return super().submit(work)


_SYNC_WORK = _SyncWork(max_workers=4, thread_name_prefix="edgecache-api")


def _in_thread(work):
    """``work`` as an awaitable: on the API's own threads under the ASGI server (where each request
    would otherwise get a new thread, or wait its turn on the thread where Django runs the
    request's thread-sensitive work, shared with other requests), else where Django runs sync code (a sync caller's own
    thread: the WSGI test client's, whose transaction the work must see)."""
    if SyncToAsync.thread_sensitive_context.get(None) is not None:
        return sync_to_async(work, thread_sensitive=False, executor=_SYNC_WORK)
    return sync_to_async(work)


class _Admitted:
    """One request as its synchronous work (``_admit_and_dispatch``, on the API's threads) left it,
    step by step: what ``_answer`` follows, or what ``_undo`` takes back when the work stopped
    short (a refusal, a failure, a client that left meanwhile)."""

    def __init__(self, phases: Phases):
        self.phases = phases
        self.key: ApiKey | None = None
        self.api: ApiRequest | None = None
        self.run: RunRequest | None = None
        self.device: Device | None = None
        self.routed = None  # the router's record, for a run sent to any board
        self.admitting = None  # its count in the bounded queues, sent: the verdict is read once it is routed
        self.ticket: admission.Ticket | None = None  # its place in the bounded queues, released when the answer ends
        self.subscription: streams.Subscription | None = None
        self.subscribed: Future | None = None  # the subscription's opening, on the event loop
        self.ring_for = None
        self.dispatched_at: float | None = None  # perf_counter() when the run was handed to the broker
        self.sent = False  # the run is on its board's queue (to be cancelled if nobody follows it)
        self.dispatched: dict | None = None  # the live event that tells open pages


def _admit_and_dispatch(request, kind: str, admitted: _Admitted, loop: asyncio.AbstractEventLoop) -> None:
    """Key and rate (401/429), body (413/400), the board (routing: 400/404/503), the run's stream
    subscribed (on ``loop``, beside what follows), a place in the bounded queues (429/503), what
    opens the board's stream events, then the run sent to the board (503 when the cache box or the
    broker is down: nothing was sent); each step marked in ``admitted.phases``, each result kept
    in ``admitted`` as it comes (``_undo`` takes back what a step that failed left).

    A key this process remembers is not waited for: its rate's count and the bounded queues' count
    go out at once, and their answers are read after the body is parsed and the run routed (two
    round trips beside that work, not before it). The run is sent only once both allowed it; a
    refusal then takes back the place it had in the queues."""
    phases = admitted.phases
    remembered, checked = keys.check_unanswered(request.headers.get("Authorization", ""))
    if remembered is None:
        admitted.key = _authorized(request, checked())  # not remembered (or refused lately): before anything else
    key = admitted.key or remembered
    phases.mark("auth")
    try:
        _parse_and_route(request, kind, admitted, key, loop)
    except BaseException:
        if admitted.key is None:  # a refused key hears 401/429 first, not what its request lacked
            admitted.key = _authorized(request, checked())
        raise
    if admitted.key is None:  # the remembered key's verdict, before the run may count or be sent
        admitted.key = _authorized(request, checked())
        if admitted.key.namespace_id != key.namespace_id:  # moved meanwhile: it was routed among the wrong boards
            raise ApiError(
                409,
                "This API key was moved to another namespace while the request was admitted; send it again.",
                code="api_key_changed",
            )
    device, routed, api, run = admitted.device, admitted.routed, admitted.api, admitted.run
    admitted.ticket = _admitted(admitted, key, routed)
    phases.mark("route")
    admitted.ring_for = stream_ring_for(device)
    phases.mark("ring")

    def listening() -> None:  # the run is recorded and sealed meanwhile
        try:
            admitted.subscribed.result(settings.EDGECACHE_CONNECT_TIMEOUT + settings.EDGECACHE_IO_TIMEOUT + 1)
        except (CacheBoxUnavailable, TimeoutError) as exc:
            raise _unavailable(
                f"The cache box (the Redis server boards stream answers through) is not reachable: {exc}. Nothing was sent."
            ) from None

    admitted.dispatched_at = time.perf_counter()
    try:
        admitted.dispatched = dispatch_api_run(
            device, run, expires=settings.EDGECACHE_API_TIMEOUT, routed=routed, announce=False, listening=listening
        )
    except BrokerUnavailable as exc:
        raise _unavailable(
            f"The message broker (the cache box's Redis) is not reachable: {exc}. Nothing was sent."
        ) from None
    admitted.sent = True
    board_choice.remember(key.namespace_id, api.prompt_cache_key, device)  # the board that has its prompt cache key
    phases.mark("dispatch")


def _parse_and_route(request, kind: str, admitted: _Admitted, key: ApiKey, loop: asyncio.AbstractEventLoop) -> None:
    """Body (413/400), its count in the bounded queues sent (read once it is routed), the board
    (routing: 400/404/503), and the run's stream subscribed on ``loop``, beside what follows."""
    phases = admitted.phases
    try:
        raw = request.body
    except RequestDataTooBig:
        raise ApiError(413, "The request body is too large; send a shorter prompt.", code="request_too_large") from None
    api = admitted.api = parse_request(parse_body(raw), kind)
    run = admitted.run = _run_request(
        key, api, _schema_source(api, key.namespace_id), phases.received_at
    )  # the one prompt type, from here to the board
    phases.mark("parse")
    admitted.admitting = admission.admit_unanswered(
        key.namespace_id,
        run.request_id,
        online_boards=board_choice.online_boards(key.namespace_id),
        key_id=key.pk,
        hold_s=2 * settings.EDGECACHE_API_TIMEOUT,
    )
    device, routed, _ = board_choice.choose_route(key, api, run)
    admitted.device, admitted.routed = device, routed
    # Subscribed first (a message published while nobody listens is gone), on the loop's shared
    # connection, while this thread reads the verdicts, the ring, and records the run.
    admitted.subscription = streams.subscribe(
        cachebox_url(),
        stream_channel(device.name, run.request_id),
        connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT,
        timeout=settings.EDGECACHE_IO_TIMEOUT,
    )
    admitted.subscribed = asyncio.run_coroutine_threadsafe(admitted.subscription.open(), loop)


async def _undo(admitted: _Admitted) -> None:
    """Take back what a request's synchronous work did before it stopped short: the run's cancel
    flag when it was sent, its place in the bounded queues, its stream's subscription."""
    if admitted.sent:
        await _cancel(admitted.device.name, admitted.run.request_id)
    if admitted.admitting is not None:  # counted, but its verdict not read: read, then released if it was a place
        admitted.ticket = await _in_thread(_settled)(admitted.admitting)
    if admitted.ticket is not None:
        await _release(admitted.ticket)
    if admitted.subscribed is not None:
        await asyncio.wait({asyncio.wrap_future(admitted.subscribed)})  # settled (opened or failed) before it is closed
        await admitted.subscription.close()


def _settled(admitting) -> admission.Ticket | None:
    """The place in the bounded queues a request that stopped short was given, if any."""
    try:
        return admitting(admission.DEFAULT_RETRY_AFTER_S)
    except admission.FleetBusy:
        return None


async def _release(ticket: admission.Ticket | None) -> None:
    """The run no longer counts in the bounded queues: one round trip, on the API's threads (not on
    the event loop, where every other answer's chunks wait behind it)."""
    if ticket is not None and ticket.names:
        await _in_thread(admission.release)(ticket)


def _admitted(admitted: _Admitted, key: ApiKey, routed) -> admission.Ticket:
    """The run's place in the key's and its namespace's bounded queues, counted when its request
    was parsed (``admitted.admitting``): ApiError 429 / 503 with Retry-After when one is full."""
    settle, admitted.admitting = admitted.admitting, None
    expected_ms = routed.record.get("expected_ms") if routed is not None else None
    try:
        return settle(admission.retry_after_s(expected_ms))
    except admission.FleetBusy as busy:
        code = {"key": "queue_full", "cachebox": "cachebox_unavailable"}.get(busy.scope, "fleet_busy")
        metrics.refused(code)
        security_event(
            "api.queue_full",
            key=key.key_prefix,
            namespace=key.namespace_id,
            scope=busy.scope,
            limit=busy.limit,
            retry_after=busy.retry_after,
        )
        raise ApiError(
            429 if busy.scope == "key" else 503,
            str(busy),
            type="requests" if busy.scope == "key" else "server_error",
            code=code,
            headers={"Retry-After": str(busy.retry_after)},
        ) from None


def _authorized(request, checked: keys.Checked | None = None) -> ApiKey:
    """The request's API key (401 without a valid one), counted against its rate (429);
    ``checked``: its verdict, when the caller has it already (``keys.check_unanswered``)."""
    key, verdict = checked if checked is not None else keys.check(request.headers.get("Authorization", ""))
    if key is None:
        metrics.refused("bad_api_key")
        security_event(
            "api.refused",
            reason="missing or unknown API key",
            remote_addr=request.META.get("REMOTE_ADDR", ""),
            path=request.path,
        )
        raise ApiError(
            401,
            "Missing or invalid API key: send `Authorization: Bearer ec-...` with a key staff created "
            "(Admin > API keys, or `python manage.py apikey create --namespace NAME`).",
            code="invalid_api_key",
        )
    if not verdict.allowed:
        metrics.refused("rate_limited")
        security_event(
            "api.rate_limited",
            key=key.key_prefix,
            namespace=key.namespace_id,
            limit_per_minute=verdict.limit,
            retry_after=verdict.retry_after,
        )
        seconds = "1 second" if verdict.retry_after == 1 else f"{verdict.retry_after} seconds"
        raise ApiError(
            429,
            f"Rate limit reached for this API key: at most {verdict.limit} requests per minute. Try again in {seconds}.",
            type="requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(verdict.retry_after)},
        )
    return key


def _schema_source(api: ApiRequest, namespace: str) -> str:
    """A stored schema the key's namespace may use (its own, or one shared with every namespace)."""
    if not api.schema:
        return ""
    usable = Schema.objects.filter(name=api.schema).filter(Q(namespace="") | Q(namespace=namespace))
    source = usable.values_list("source", flat=True).first()
    if source is None:
        raise bad_request(
            f"No schema named {api.schema!r}; the Schemas page lists them (staff create them there).",
            param="edgecache.schema",
        )
    return source


def _run_request(key: ApiKey, api: ApiRequest, schema_source: str, received_at: float = 0.0) -> RunRequest:
    """The API request's prompt as the board's ``RunRequest`` (in the key's namespace, streamed)."""
    who = key.name or key.key_prefix
    title = f"API {api.kind} ({who}{', user ' + api.user if api.user else ''}): {api.snippet}"
    try:
        return RunRequest(
            request_id=str(uuid.uuid4()),
            segments=[api.prompt] if api.prompt else [],
            messages=[ChatMessage(**message) for message in api.messages],
            schema=schema_source,
            pml=api.pml,
            max_tokens=api.max_tokens,
            sampling=SamplingSpec(temperature=api.temperature, top_p=api.top_p, seed=api.seed),
            namespace=key.namespace_id,
            use_cache=api.use_cache,
            meta=RunMeta(source="api", title=title[:200], received_at=received_at),
            stream=True,
            stop=api.stop,
            strategy="" if api.strategy == "exact" else api.strategy,
        )
    except ValidationError as exc:
        problem = exc.errors()[0]
        if problem["loc"][:1] == ("strategy",) or (api.strategy and api.pml):
            try:
                parse_strategy(api.strategy)  # the grammar's own words for what to write
            except ValueError as unknown:
                reason = str(unknown)
            else:
                reason = f"strategy {api.strategy!r} is a lab strategy: a schema (PML) prompt takes none"
            raise bad_request(
                f"Unusable 'edgecache.strategy': {reason}; or leave it out (exact serving).", param="edgecache.strategy"
            ) from None
        raise bad_request(
            f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}", param=api.prompt_param
        ) from None


async def _answer(admitted: _Admitted) -> HttpResponse:
    """Answer from the run's stream (subscribed before the run was sent: nothing published is
    missed); its place in the bounded queues (``admitted.ticket``) is released when the answer ends."""
    api, run, device, phases, subscription = (
        admitted.api,
        admitted.run,
        admitted.device,
        admitted.phases,
        admitted.subscription,
    )
    follower = _Follower(subscription, run.request_id, device, settings.EDGECACHE_API_TIMEOUT, admitted.ring_for)
    follower.phases = phases
    follower.ticket = admitted.ticket
    follower.dispatched_at = admitted.dispatched_at
    handed_over = finished = False
    try:
        event = await follower.next()
        if event.type == "error":
            finished = True
            raise board_error(event.error, param=api.prompt_param, device=device.name)
        if api.stream:
            handed_over = True
            return _sse_response(follower, event, _Shape(api, run, device, follower))
        while event.type == "token":
            event = await follower.next()
        finished = True
        if event.type == "error":
            raise board_error(event.error, param=api.prompt_param, device=device.name)
        return JsonResponse(
            _Shape(api, run, device, follower).whole(event),
            headers={"X-Request-Id": run.request_id, "Server-Timing": phases.server_timing()},
        )
    except ApiError as exc:
        return exc.response()
    finally:
        if not handed_over:  # the stream's generator owns them otherwise
            if not finished:  # a timeout, or the client went away (this task cancelled)
                await _cancel(follower.device, run.request_id)
            await _release(admitted.ticket)
            await subscription.close()


_beside = beside  # tasks run beside answers, kept until done (the loop holds them weakly)


class Phases:
    """How long each of the API's steps took before the first token, in order (milliseconds):
    ``auth`` (the key; its rate's count sent), ``parse``, ``route`` (routing, then the verdicts of the
    rate and of the bounded queues, counted beside it), ``ring``, ``dispatch`` (record, seal, what
    was left to wait of the run's subscription, made beside them, send), ``board`` (until the board
    says it started). In the answer's
    ``edgecache.api_phases_ms`` and its ``Server-Timing`` header."""

    def __init__(self):
        self.started = self._last = time.perf_counter()
        self.received_at = time.time()  # the wall clock, for the board (how long it was busy since)
        self._spent: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self._spent[name] = self._spent.get(name, 0.0) + (now - self._last) * 1000.0
        self._last = now

    def as_dict(self) -> dict[str, float]:
        return {name: round(ms, 3) for name, ms in self._spent.items()}

    def server_timing(self) -> str:
        return ", ".join(f"{name};dur={ms:.3f}" for name, ms in self._spent.items())


class _Follower:
    """The run's events in order, each within the timeout (ApiError 504 / 503 otherwise): only
    events the board the run is with sealed and signed for this run (or the control plane: a run
    it moved or gave up on); any other is dropped and logged (``run_stream.Followed``)."""

    def __init__(self, subscription: streams.Subscription, request_id: str, device: Device, timeout: float, ring_for):
        self.subscription = subscription
        self.request_id = request_id
        self.followed = Followed(
            request_id,
            device.name,
            device.signing_public_key,
            ring_for,
            control_plane_public_key(),
            in_thread=_in_thread,
        )
        self.timeout = timeout
        self.phases = Phases()  # the API's own steps, from the request's arrival
        self.dispatched_at: float | None = None
        self.started_at: float | None = None  # when the board's "started" stage arrived: it took the run
        self.ticket = None  # its place in the bounded queues (dashboard.admission), released when it ends

    @property
    def device(self) -> str:
        """The board the run is with (a moved run: the board it went on on)."""
        return self.followed.device

    @property
    def queue_ms(self) -> float | None:
        """From dispatch to the board taking the run (the broker, the board's queue, the pub/sub hop)."""
        if self.dispatched_at is None or self.started_at is None:
            return None
        return round((self.started_at - self.dispatched_at) * 1000.0, 3)

    @property
    def api_ms(self) -> float | None:
        """From the request's arrival to its dispatch: key, rate, body, routing, subscription."""
        if self.dispatched_at is None:
            return None
        return round((self.dispatched_at - self.phases.started) * 1000.0, 3)

    async def next(self) -> StreamEvent:
        while True:
            try:
                data = await self.subscription.get(self.timeout)
            except CacheBoxUnavailable as exc:
                self.followed.gave_up()
                raise _unavailable(
                    f"Lost the cache box while following board {self.device!r}: {exc}; the run's record will still arrive."
                ) from None
            if data is None:
                self.followed.gave_up()
                raise ApiError(
                    504,
                    f"Board {self.device!r} said nothing for {self.timeout:g} s (EDGECACHE_API_TIMEOUT); the run was cancelled. "
                    "Is it busy with long runs, or stopped? The Devices page shows whether it is online.",
                    type="server_error",
                    code="board_timeout",
                )
            event = self.followed.open(data)
            if event is None:
                continue
            if event.type == "resent":  # its board went quiet: listen to the board it moved to, then send it there
                await self.followed.move(self.subscription, event)
                continue
            if event.type == "error":
                self.followed.gave_up()  # a run given up on keeps what its client had
            if event.type != "stage":  # stages are for the Run page; "started" times the queue
                return event
            if event.stage == "started" and self.started_at is None:
                self.started_at = time.perf_counter()
                self.phases.mark("board")  # the broker, the board's queue and the hop back


def _sse_response(follower: _Follower, first: StreamEvent, shape: "_Shape") -> StreamingHttpResponse:
    response = StreamingHttpResponse(_sse(follower, first, shape), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy must pass each token on at once
    response["X-Request-Id"] = shape.run.request_id
    response["Server-Timing"] = follower.phases.server_timing()
    return response


async def _sse(follower: _Follower, event: StreamEvent, shape: "_Shape"):
    """Server-Sent Events in OpenAI's chunk format, one chunk per token as the board chose it."""
    finished = False
    try:
        # A chat's first chunk (the role) goes out with the first token's, in one write.
        opening = shape.sse(shape.chunk(delta={"role": "assistant", "content": ""})) if shape.api.kind == "chat" else ""
        while event.type == "token":
            if event.text or opening:
                yield opening + (shape.sse(shape.chunk(text=event.text)) if event.text else "")
                opening = ""
            event = await follower.next()
        if opening:
            yield opening
        finished = True
        if event.type == "error":
            yield shape.sse(board_error(event.error, param=shape.api.prompt_param, device=shape.device.name).body())
            return
        yield shape.sse(shape.chunk(finish=event.finish_reason, extension=shape.extension(event)))
        if shape.api.include_usage:
            yield shape.sse(shape.usage_chunk(event))
        yield "data: [DONE]\n\n"
    except ApiError as exc:  # the board fell silent mid-answer
        yield shape.sse(exc.body())
    finally:
        if not finished:  # the client went away (this generator cancelled) or the board fell silent
            await _cancel(follower.device, follower.request_id)
        await _release(follower.ticket)
        await follower.subscription.close()


async def _cancel(device: str, request_id: str) -> None:
    """Tell the board to stop: its client is gone (the flag, signed by the control plane, outlives
    the run's queue expiry)."""
    try:
        await asyncio.shield(
            streams.set_flag(
                cachebox_url(),
                cancel_key_name(device, request_id),
                settings.EDGECACHE_API_TIMEOUT + 60,
                cancel_flag(device, request_id),
                connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT,
            )
        )
        log.info("run %s cancelled: its client went away or its board fell silent", request_id)
    except (CacheBoxUnavailable, asyncio.CancelledError) as exc:
        log.warning("run %s could not be cancelled: %s", request_id, exc)


# -- OpenAI's shapes -----------------------------------------------------------------------------------
class _Shape:
    """One answer in OpenAI's JSON: whole, or chunk by chunk."""

    def __init__(self, api: ApiRequest, run: RunRequest, device: Device, follower: _Follower | None = None):
        self.api = api
        self.run = run
        self.device = device
        self.follower = follower
        self.created = int(time.time())
        chat = api.kind == "chat"
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{run.request_id}"
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.fingerprint = (device.status or {}).get("fingerprint") or None

    def _head(self, object_name: str) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.api.model,
            "system_fingerprint": self.fingerprint,
        }

    def whole(self, done: StreamEvent) -> dict:
        finish = _finish(done)
        if self.api.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": done.text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": finish}
        return {**self._head(self.object), "choices": [choice], "usage": usage(done), "edgecache": self.extension(done)}

    def chunk(
        self,
        *,
        text: str | None = None,
        delta: dict | None = None,
        finish: str | None = None,
        extension: dict | None = None,
    ) -> dict:
        if self.api.kind == "chat":
            choice = {
                "index": 0,
                "delta": delta if delta is not None else ({"content": text} if text is not None else {}),
                "logprobs": None,
                "finish_reason": None,
            }
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": None}
        if finish is not None:
            choice["finish_reason"] = "stop" if finish in ("", "cancelled") else finish
        body = {**self._head(self.chunk_object), "choices": [choice]}
        if self.api.include_usage:
            body["usage"] = None  # as OpenAI: only the last chunk carries usage
        if extension is not None:
            body["edgecache"] = extension
        return body

    def usage_chunk(self, done: StreamEvent) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage(done), "edgecache": self.extension(done)}

    def extension(self, done: StreamEvent) -> dict:
        breakdown = done.breakdown
        follower = self.follower
        queued = (
            {
                name: value
                for name, value in (("api_ms", follower.api_ms), ("queue_ms", follower.queue_ms))
                if value is not None
            }
            if follower is not None
            else {}
        )
        if follower is not None:
            queued["api_phases_ms"] = follower.phases.as_dict()
        device = (
            follower.device if follower is not None else self.device.name
        )  # where it ran (a re-sent run: the second board)
        return {
            "request_id": self.run.request_id,
            "device": device,
            **queued,
            **{name: breakdown[name] for name in EXTENSION_FIELDS if name in breakdown},
        }

    @staticmethod
    def sse(body: dict) -> str:
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _finish(done: StreamEvent) -> str:
    return "stop" if done.finish_reason in ("", "cancelled") else done.finish_reason


def usage(done: StreamEvent) -> dict:
    """OpenAI's usage object from the run's breakdown: cached tokens are those the cache served."""
    breakdown = done.breakdown
    prompt, completion = int(breakdown.get("prompt_tokens", 0)), int(breakdown.get("generated_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(breakdown.get("matched_tokens", 0))},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _model_json(entry: dict) -> dict:
    return {
        "id": entry["id"],
        "object": "model",
        "created": int(entry["created"].timestamp()),
        "owned_by": "edgecache",
        "edgecache": {"fingerprint": entry["fingerprint"], "devices": entry["devices"]},
    }


def _unavailable(message: str) -> ApiError:
    where = "start it (`make run` starts the embedded one) or check REDIS_URL"
    return ApiError(
        503,
        f"{message} {where[0].upper()}{where[1:]}; try again in {RETRY_AFTER_S} seconds.",
        type="server_error",
        code="service_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _method_not_allowed(allowed: str) -> HttpResponse:
    response = ApiError(405, f"Use {allowed} here.", code="method_not_allowed").response()
    response["Allow"] = allowed
    return response

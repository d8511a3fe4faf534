"""An edge board as a Celery worker: its identity, the messages it serves, its heartbeat.

Pure-ish functions here are what the Celery tasks call and what the tests call; a board holds
no database credentials: it needs the broker/cache-box URL, its token once (to enroll) and then
its own keys (``inference.identity``). It opens only requests the control plane it pinned signed
and sealed for it, and signs (and seals) everything it sends (``inference.envelope``).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from celery import current_app
from pydantic import ValidationError

from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.keys import cancel_key_name, stream_channel
from cachebox.signing import Keychain, KeyRing
from cachebox.store import CacheBox

from . import envelope
from .chat import chat_prompt
from .devices import DeviceRecord, DeviceRefused, DeviceUnknown, RecordRefused, authenticate, enroll
from .engine import EngineError
from .envelope import CONTROL, EnvelopeRefused, Kind
from .identity import BoardKeys
from .lab.anchors import parse_strategy as parse_anchors
from .lab.exit_policy import parse_strategy as parse_early_exit
from .lab.kv_prediction import parse_strategy
from .messages import (
    BoardMessage,
    BoardStatus,
    EncodeProgress,
    EncodeReport,
    EncodeRequest,
    EnrollRequest,
    Heartbeat,
    Queue,
    RunReport,
    RunRequest,
    StreamEvent,
    Task,
)
from .sampling import SamplingParams
from .serving import PromptError, RunResult

log = logging.getLogger(__name__)

@dataclass
class EdgeIdentity:
    name: str
    keys: BoardKeys  # this board's private keys (they sign its messages and open its ring) and the pinned control plane
    record: DeviceRecord
    store: CacheBox
    ring: KeyRing | None = None  # the namespace's keys, as last received

    def recheck(self) -> None:
        """Raise DeviceRefused if the device was revoked or its token rotated since the board
        enrolled, or its record is not one the pinned control plane signed (or older than the last
        one); otherwise take the namespace's current keys (a rotation arrives this way)."""
        previous = self.record.cache_namespace
        try:
            self.record = authenticate(self.store, self.name, self.keys, newer_than=self.record.serial)
        except RecordRefused:
            # Not the control plane's word (logged): neither a revocation nor new keys. This board
            # serves on with the last record it trusted.
            return
        except DeviceUnknown:
            # This board enrolled, so its record existed: a registry without it is a cache box that
            # restarted empty. Revoking or rotating writes a record; only its absence is "cannot
            # tell" (as an unreachable cache box), and the control plane publishes it again when
            # it accepts this board's next heartbeat.
            log.warning("the registry has no record of %s (the cache box restarted empty?): serving on with its last one", self.name)
            return
        if self.record.cache_namespace != previous:
            raise DeviceRefused(f"device {self.name!r} was moved to namespace {self.record.cache_namespace!r}; restart the board to serve it")
        self._open_ring()

    def _open_ring(self) -> None:
        try:
            ring = self.record.open_keyring(self.keys)
        except ValueError as exc:
            security_event("keyring_refused", device=self.name, reason=str(exc), outcome="cache off until a good ring arrives")
            ring = None
        if ring is None and self.ring is None:
            log.warning("no signing keys for this board yet: it answers by local prefill and shares nothing until the control plane seals its namespace's ring for it")
        self.ring = ring

    def keychain(self) -> Keychain:
        """Keys for the pipeline: always this identity's current ring; refreshing re-reads the registry."""

        def source(namespace: str) -> KeyRing | None:
            ring = self.ring
            return ring if ring is not None and ring.covers(namespace) else None

        def reread() -> None:
            try:
                self.recheck()
            except (DeviceRefused, CacheBoxUnavailable) as exc:
                log.warning("could not refresh signing keys: %s", exc)

        return Keychain(source, remember=False, on_refresh=reread)

    def ring_for(self, namespace: str) -> KeyRing | None:
        """The ring that opens what was sealed for ``namespace`` (this board's own only)."""
        ring = self.ring
        return ring if ring is not None and ring.covers(namespace) else None

    def open_request(self, message, kind: Kind, *, expired_ok: bool = False) -> dict:
        """A request the pinned control plane sealed and signed for this board; EnvelopeRefused
        (logged) for anything else: unsigned, signed by anyone else, for another board, expired."""
        try:
            body, _ = envelope.open_envelope(
                message, kind=kind, to=self.name, signer_public_key=self.keys.control_plane_key, ring_for=self.ring_for, expired_ok=expired_ok
            )
        except EnvelopeRefused as exc:
            security_event("request_refused", device=self.name, kind=str(kind), reason=str(exc)[:500])
            raise
        return body

    def seal_event(self, event: StreamEvent) -> bytes:
        """A stream event as it is published: sealed under the namespace's key, signed by this board,
        addressed to its run."""
        sealed = envelope.seal(event.compact(), kind=Kind.STREAM, sender=self.name, to=event.request_id, signer=self.keys.signing, ring=self.ring)
        return json.dumps(sealed, separators=(",", ":")).encode()

    def seal(self, message: "BoardMessage", kind: Kind) -> dict:
        """``message`` as it travels to the control plane: signed with this board's key, sealed
        under the namespace's data key (heartbeats, which carry nothing of a tenant, in the clear)."""
        ring = None if kind == Kind.HEARTBEAT else self.ring
        if ring is None and kind != Kind.HEARTBEAT:
            raise DeviceRefused(f"board {self.name!r} holds no key of its namespace: nothing can be sent sealed")
        return envelope.seal(message.dump(), kind=kind, sender=self.name, to=CONTROL, signer=self.keys.signing, ring=ring, message_id=str(getattr(message, "request_id", "") or ""))

    def check_namespace(self, requested: str | None) -> str:
        """The namespace a request may use: this board's own, whatever was asked."""
        own = self.record.cache_namespace
        if requested and requested not in (self.record.namespace, own):
            security_event("request_refused", device=self.name, reason="foreign namespace", namespace=requested)
            raise PromptError(f"device {self.name!r} belongs to namespace {self.record.namespace!r}; it does not serve {requested!r}")
        return own


_identity: EdgeIdentity | None = None


def send_enrollment(fields: dict) -> None:
    """An enrollment request to the control plane's queue (public keys, signed with the token's key)."""
    current_app.send_task(
        Task.ENROLL.value, args=[EnrollRequest(**fields).dump()], queue=Queue.CONTROL.value, exchange="", routing_key=Queue.CONTROL.value, declare=[], expires=120
    )


def become(name: str, keys: BoardKeys, store: CacheBox, *, token: str | None = None, send=send_enrollment, timeout: float = 30.0, save=None, then_as=None) -> EdgeIdentity:
    """Make this process the board ``name``, pinning the control plane and enrolling its keys with
    ``token`` when the registry does not name them yet (``save`` keeps the pinned keys; ``then_as()``
    gives the store as the board's own Redis user once enrolled; raises DeviceRefused with what to do)."""
    global _identity
    record, keys = enroll(store, name, keys, token, send, timeout=timeout, save=save, then_as=then_as)
    _identity = EdgeIdentity(name, keys, record, store)
    _identity._open_ring()
    return _identity


def identity() -> EdgeIdentity:
    if _identity is None:
        raise RuntimeError("this process is not an edge board; start it with `python manage.py edge`")
    return _identity


def _sender() -> dict:
    """The field that names this board in every message it sends (``report`` signs them)."""
    return {"device": _identity.name if _identity is not None else "local"}


CANCELLED = "cancelled by the client"


def serve(board, request: RunRequest, work_waiting: Callable[[], bool] | None = None) -> RunReport:
    """Run one dispatched prompt; returns the report for the control plane (an error is a report too).

    A streamed run (``request.stream``) publishes each answer piece on its channel as it is
    chosen and a last ``done`` (or ``error``) event, sealed and signed by this board, and stops
    when the control plane's signed cancel flag appears; ``request.stop`` ends the answer at the
    first stop string, streamed or not. After a chat turn's answer, the next turn's prefix is
    prepared unless ``work_waiting()`` says another run waits for this board: a waiting answer
    goes before a turn that may never come. Only a board process (an identity) streams.
    """
    streaming = request.stream and board.store is not None and _identity is not None
    stream = _Publisher(board.store, request.request_id, _identity) if streaming else None
    if stream is not None and stream.cancel_requested():
        stream.close()
        return RunReport.for_request(request, **_sender(), error=CANCELLED)  # its client left while it waited
    if stream is None and _identity is not None and board.store is not None and signed_cancel_set(board.store, _identity, request.request_id):
        return RunReport.for_request(request, **_sender(), error=CANCELLED)  # revoked while queued, or re-sent elsewhere
    if stream is not None:
        stream.send(StreamEvent(type="stage", request_id=request.request_id, device=stream.device, stage="started"))
    answer = _Answer(request.stop)
    cancelled = False

    def on_token(token: int, piece: str) -> bool:
        nonlocal cancelled
        released = answer.add(piece)
        if released and stream is not None:
            stream.send(StreamEvent(type="token", request_id=request.request_id, device=stream.device, index=stream.count(), text=released))
        if answer.stopped:
            return False
        if stream is not None and stream.cancelled.is_set():
            cancelled = True
            return False
        return True

    prompt = request.prompt_text
    conversation = [(message.role, message.content) for message in request.messages]
    try:
        sampling = SamplingParams(**request.sampling.model_dump())
        options = dict(max_tokens=request.max_tokens, sampling=sampling, use_cache=request.use_cache, namespace=_namespace(request.namespace))
        if stream is not None or request.stop:
            options["on_token"] = on_token
        if stream is not None and not request.is_schema_run:
            options["on_stage"] = lambda stage: stream.send(StreamEvent(type="stage", request_id=request.request_id, device=stream.device, stage=stage))
        anchors = parse_anchors(request.strategy)
        early_exit = parse_early_exit(request.strategy) if anchors is None else None
        kv_prediction_k = parse_strategy(request.strategy) if anchors is None and early_exit is None else None
        if anchors:
            lab = board.anchors(anchors)
        elif early_exit is not None:
            lab = board.early_exit(early_exit)
        else:
            lab = board.kv_prediction(kv_prediction_k) if kv_prediction_k is not None else None
        if lab is not None:  # lab strategy: approximate, never reads or writes the cache box
            lab_options = {name: options[name] for name in ("max_tokens", "sampling", "on_token") if name in options}
            if request.is_chat_run:
                chat = chat_prompt(board.engine, conversation)
                prompt = chat.text
                result = lab.run(chat.text, tokens=chat.tokens, **lab_options)
            else:
                result = lab.run(request.segments, **lab_options)
        elif request.is_schema_run:
            result: RunResult = board.run_pml(request.schema_source, request.pml, **options)
        elif request.is_chat_run:
            chat, result = board.run_chat(conversation, **options)
            prompt = chat.text
        else:
            result = board.run(request.segments, **options)
    except (PromptError, ValueError, EngineError) as exc:  # PMLError is a ValueError
        if stream is not None:
            stream.close(StreamEvent(type="error", request_id=request.request_id, device=stream.device, error=str(exc)[:10_000]))
        return RunReport.for_request(request, **_sender(), error=str(exc))
    except BaseException as exc:  # a bug or a broken engine: the waiting client hears it now (tasks.py reports it)
        if stream is not None:
            stream.close(StreamEvent(type="error", request_id=request.request_id, device=stream.device, error=f"the board failed: {type(exc).__name__}: {exc}"[:10_000]))
        raise
    tail = answer.finish(result.text)
    breakdown = result.breakdown
    if cancelled:
        finish = "cancelled"
    elif answer.stopped or breakdown.generated_tokens < request.max_tokens:
        finish = "stop"
    else:
        finish = "length"
    if stream is not None:
        if tail and not cancelled:
            stream.send(StreamEvent(type="token", request_id=request.request_id, device=stream.device, index=stream.count(), text=tail))
        extra = {"modules_hit": result.modules_hit} if result.modules_hit is not None else {}
        done = StreamEvent(type="done", request_id=request.request_id, device=stream.device, text=answer.text, finish_reason=finish, breakdown={**breakdown.as_dict(), **extra})
        stream.close(done)
    uploaded = list(result.uploaded)
    if request.is_chat_run and lab is None and request.use_cache and not cancelled and not _waiting(work_waiting, request.request_id):
        # The answer is out: prepare the next turn (its shared prefix, computed and shared now).
        # Whatever goes wrong there, this answer's report still goes to the control plane.
        try:
            turn = board.follow_up(conversation, answer.text, namespace=options["namespace"])
        except (PromptError, ValueError, EngineError) as exc:
            log.warning("run %s: the next turn's prefix was not prepared: %s", request.request_id, exc)
        else:
            breakdown.next_turn_tokens, breakdown.next_turn_ms = turn.tokens, turn.total_ms
            uploaded += turn.uploaded
    return RunReport(
        **_sender(),
        request_id=request.request_id,
        meta=request.meta,
        prompt=prompt,
        text=answer.text,
        error=CANCELLED if cancelled else "",
        tokens=result.tokens,
        breakdown=breakdown,
        fetched=result.fetched,
        uploaded=uploaded,
        modules_hit=result.modules_hit,
    )


def signed_cancel_set(store: CacheBox, me: EdgeIdentity, request_id: str) -> bool:
    """Whether the pinned control plane signed a cancel for this run on this board (one GET; a
    flag anyone else set is refused and logged; a cache box that does not answer: no)."""
    try:
        raw = store.read_flag(cancel_key_name(me.name, request_id))
    except CacheBoxUnavailable as exc:
        log.warning("cannot check whether run %s was cancelled: %s", request_id, exc)
        return False
    if raw is None:
        return False
    try:
        body, _ = envelope.open_envelope(json.loads(raw), kind=Kind.CANCEL, to=me.name, signer_public_key=me.keys.control_plane_key)
        if body.get("request_id") == request_id:
            return True
        raise EnvelopeRefused("it names another run")
    except (ValueError, UnicodeDecodeError) as exc:  # EnvelopeRefused is a ValueError
        security_event("cancel_refused", device=me.name, request_id=request_id, reason=str(exc)[:300])
        return False


def messages_waiting(app, queues: Sequence[str]) -> int:
    """How many messages wait in ``queues`` of ``app``'s broker (a queue never used counts 0)."""
    from kombu.exceptions import ChannelError

    waiting = 0
    with app.pool.acquire(block=True, timeout=5) as connection:
        channel = connection.default_channel
        for name in queues:
            try:
                waiting += channel.queue_declare(queue=name, passive=True).message_count
            except ChannelError:  # no such queue yet: nothing waits in it
                continue
    return waiting


def board_work_waiting() -> bool:
    """Whether a run or an encode waits for this board, in its own queue or its namespace's shared one."""
    me = identity()
    return messages_waiting(current_app, [Queue.device(me.name), Queue.shared(me.record.cache_namespace)]) > 0


def _waiting(work_waiting: Callable[[], bool] | None, request_id: str) -> bool:
    """Whether another run waits for this board (never raises: unknown counts as no)."""
    if work_waiting is None:
        return False
    try:
        waiting = bool(work_waiting())
    except Exception as exc:  # the broker unreachable: the next turn is prepared as usual
        log.warning("run %s: could not see whether work waits: %s", request_id, exc)
        return False
    if waiting:
        log.info("run %s: another run waits; the next turn's prefix is not prepared", request_id)
    return waiting


class _Answer:
    """The answer as its client sees it: cut before the first stop string, and released piece by
    piece only once a piece can no longer turn out to be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = [stop for stop in stops if stop]
        self.text = ""
        self.sent = 0  # characters of ``text`` released
        self.stopped = False

    def add(self, piece: str) -> str:
        """Take the next piece; returns the text that may be released now."""
        if self.stopped or not piece:
            return ""
        self.text += piece
        if not self.stops:
            return self._release(len(self.text))
        # A stop string can only begin in the unreleased part (whatever could begin one is held).
        found = [index for index in (self.text.find(stop, self.sent) for stop in self.stops) if index >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True
            return self._release(len(self.text))
        held = max((k for stop in self.stops for k in range(1, min(len(stop), len(self.text) - self.sent) + 1) if self.text.endswith(stop[:k])), default=0)
        return self._release(len(self.text) - held)

    def finish(self, full_text: str) -> str:
        """The run is over: the text still held back (none after a stop). Without a stop the
        answer is the run's own text (its last character may have been incomplete as a piece)."""
        if not self.stopped:
            self.text = full_text if full_text.startswith(self.text[: self.sent]) else self.text
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        released, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return released


class _Publisher(threading.Thread):
    """A streamed run's events to its pub/sub channel, sealed and signed by this board, from a
    thread of its own so that a publish (one round trip, over an emulated link too) never delays
    the next token; it also checks the run's cancel flag, at most every ``CHECK_EVERY_S``, with one
    cheap GET, and obeys only a cancel the pinned control plane signed for this run and board."""

    CHECK_EVERY_S = 0.1

    def __init__(self, store: CacheBox, request_id: str, me: EdgeIdentity):
        super().__init__(name=f"edgecache-stream-{request_id[:8]}", daemon=True)
        self.store = store
        self.me = me
        self.device = me.name
        self.request_id = request_id
        self.channel = stream_channel(me.name, request_id)
        self.cancel_key = cancel_key_name(me.name, request_id)
        self.cancelled = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sent = 0
        self._failed = False
        self.start()

    def count(self) -> int:
        """The index of the next token event."""
        self._sent += 1
        return self._sent - 1

    def send(self, event: StreamEvent) -> None:
        self._queue.put(event)

    def close(self, last: StreamEvent | None = None, timeout: float = 5.0) -> None:
        """Publish ``last`` after everything sent before it, then stop the thread."""
        if last is not None:
            self.send(last)
        self._queue.put(None)
        self.join(timeout)

    def cancel_requested(self) -> bool:
        if not self.cancelled.is_set() and signed_cancel_set(self.store, self.me, self.request_id):
            self.cancelled.set()
        return self.cancelled.is_set()

    def run(self) -> None:
        next_check = time.monotonic() + self.CHECK_EVERY_S
        while True:
            try:
                event = self._queue.get(timeout=self.CHECK_EVERY_S)
            except queue.Empty:
                event = False
            if event is None:
                return
            if event:
                self._publish(self.me.seal_event(event))
            if time.monotonic() >= next_check and not self.cancelled.is_set():
                self.cancel_requested()
                next_check = time.monotonic() + self.CHECK_EVERY_S

    def _publish(self, data: bytes) -> None:
        try:
            self.store.publish(self.channel, data)
        except CacheBoxUnavailable as exc:  # the run goes on; its signed report still reaches the control plane
            if not self._failed:
                log.warning("stream %s: an event was not published: %s", self.channel, exc)
            self._failed = True


def encode(board, request: EncodeRequest, on_progress=None) -> EncodeReport:
    """Encode a schema's modules into the cache box; returns the report for the control plane."""
    base = dict(**_sender(), request_id=request.request_id, schema_id=request.schema_id)
    try:
        result = board.schemas.encode_schema(request.schema_source, namespace=_namespace(request.namespace), progress=on_progress)
    except (ValueError, EngineError) as exc:
        return EncodeReport(**base, error=str(exc))
    except CacheBoxUnavailable as exc:
        return EncodeReport(**base, error=f"the cache box is unavailable: {exc}")
    return EncodeReport(**base, stored=result["stored"], skipped=result["skipped"], bytes=result["bytes"])


def refused_request(raw, reason: str, task: Task) -> None:
    """A malformed request that still names its request id is answered with an error, so it is not lost."""
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    try:
        if task == Task.RUN_PROMPT:
            report(RunReport(**_sender(), request_id=request_id, error=f"refused by the board: {reason}"))
        else:
            report(EncodeReport(**_sender(), request_id=request_id, error=f"refused by the board: {reason}"), Task.ENCODED)
    except (ValidationError, TypeError):
        log.warning("dropped a malformed %s message without a usable request id: %s", task.value, reason)


def _namespace(requested: str) -> str | None:
    """The namespace a message may use: on a board, its own (a foreign one is refused)."""
    if _identity is None:  # not a board process (tests, commands): as asked
        return requested or None
    return _identity.check_namespace(requested)


_KINDS = {Task.RECORD_RUN: Kind.REPORT, Task.ENCODED: Kind.ENCODED, Task.ENCODE_PROGRESS: Kind.PROGRESS, Task.HEARTBEAT: Kind.HEARTBEAT}


def send_to_control(task: Task, message: BoardMessage, **options) -> None:
    """One message to the control plane's queue, signed (and sealed) by this board. Published on the
    default exchange straight into the queue: a board declares and binds nothing on the broker."""
    sealed = identity().seal(message, _KINDS[task])
    current_app.send_task(task.value, args=[sealed], queue=Queue.CONTROL.value, exchange="", routing_key=Queue.CONTROL.value, declare=[], **options)


def send_progress(progress: EncodeProgress) -> None:
    """Encoding progress to the control plane (best effort: progress may be lost, the result is not)."""
    send_to_control(Task.ENCODE_PROGRESS, progress, expires=60)


def report(message: BoardMessage, task: Task = Task.RECORD_RUN) -> None:
    """Send a signed, sealed report to the control plane's queue."""
    send_to_control(task, message)


class HeartbeatThread(threading.Thread):
    """Tells the control plane every few seconds that this board lives, and how its catalogs look.

    Each beat also re-checks the token: a board whose token was revoked or rotated calls
    ``on_refused`` (the edge command stops the worker) instead of serving on.
    """

    def __init__(self, board_status, interval: float = 5.0, on_refused=None):
        super().__init__(name="edgecache-heartbeat", daemon=True)
        self.board_status = board_status
        self.interval = interval
        self.on_refused = on_refused
        self._stop_event = threading.Event()

    def beat(self) -> None:
        me = identity()
        try:
            me.recheck()
        except DeviceRefused as exc:
            log.error("stopping: %s", exc)
            if self.on_refused:
                self.on_refused(exc)
            self.stop()
            return
        except CacheBoxUnavailable:
            pass  # cannot tell now; the control plane checks every message anyway
        status = BoardStatus(pid=os.getpid(), sent=time.time(), heartbeat_s=self.interval, **self.board_status())
        send_to_control(Task.HEARTBEAT, Heartbeat(device=me.name, status=status), expires=self.interval * 3)

    def run(self) -> None:
        while True:
            try:
                self.beat()
            except Exception as exc:  # the broker may be down for a while: keep trying
                log.warning("heartbeat not sent: %s", exc)
            if self._stop_event.is_set() or self._stop_event.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop_event.set()

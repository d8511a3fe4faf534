"""A streamed run's side of the board: its answer released piece by piece (cut at stop strings),
its events published sealed and signed on the run's channel (from the board's stream thread, the
first ones inline), and the control plane's signed cancel flag, obeyed only when the pinned control
plane signed it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.keys import cancel_key_name, stream_channel
from cachebox.store import CacheBox
from inference.board.devices import UNREAD
from inference.board.enrollment import EdgeIdentity
from inference.contract import envelope
from inference.contract.envelope import EnvelopeRefused, Kind
from inference.contract.messages import StreamEvent

log = logging.getLogger("inference.board")


def signed_cancel_set(store: CacheBox, me: EdgeIdentity, request_id: str) -> bool:
    """Whether the pinned control plane signed a cancel for this run on this board (one GET; a
    flag anyone else set is refused and logged; a cache box that does not answer: no)."""
    try:
        raw = store.read_flag(cancel_key_name(me.name, request_id))
    except CacheBoxUnavailable as exc:
        log.warning("cannot check whether run %s was cancelled: %s", request_id, exc)
        return False
    return signed_cancel(me, request_id, raw)


def signed_cancel(me: EdgeIdentity, request_id: str, raw: bytes | None) -> bool:
    """Whether ``raw`` (the run's cancel flag as read, None when unset) is a cancel the pinned
    control plane signed for this run on this board; anything else is refused and logged."""
    if raw is None:
        return False
    try:
        body, _ = envelope.open_envelope(
            json.loads(raw), kind=Kind.CANCEL, to=me.name, signer_public_key=me.keys.control_plane_key
        )
        if body.get("request_id") == request_id:
            return True
        raise EnvelopeRefused("it names another run")
    except (ValueError, UnicodeDecodeError) as exc:  # EnvelopeRefused is a ValueError
        security_event("cancel_refused", device=me.name, request_id=request_id, reason=str(exc)[:300])
        return False


class AnswerText:
    """The answer as its client sees it: cut before the first stop string, and released piece by
    piece only once a piece can no longer turn out to be the start of one."""

    def __init__(self, stops: list[str], already: int = 0):
        self.stops = [stop for stop in stops if stop]
        self.text = ""
        self.sent = already  # characters of ``text`` released (``already``: its client has them from another board)
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
        held = max(
            (
                k
                for stop in self.stops
                for k in range(1, min(len(stop), len(self.text) - self.sent) + 1)
                if self.text.endswith(stop[:k])
            ),
            default=0,
        )
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


class _StreamThread(threading.Thread):
    """The board's one thread for streamed runs: it publishes the events handed to it, in order,
    and looks at each streamed run's cancel flag every ``CHECK_EVERY_S``. One per process, started
    once: a thread per run cost its start (``Thread.start`` waits until the thread runs, which on a
    board whose compute threads fill its cores is a wait for a core) on the way to the first token."""

    CHECK_EVERY_S = 0.1

    def __init__(self):
        super().__init__(name="edgecache-streams", daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._watched: dict["StreamPublisher", float] = {}  # a streamed run -> when to look at its cancel flag
        self._lock = threading.Lock()

    def watch(self, stream: "StreamPublisher") -> None:
        with self._lock:
            self._watched[stream] = time.monotonic() + self.CHECK_EVERY_S

    def forget(self, stream: "StreamPublisher") -> None:
        with self._lock:
            self._watched.pop(stream, None)

    def run(self) -> None:
        while True:
            try:
                self._step()
            except Exception:  # one run's broken event or flag is not every later run's stream
                log.exception("the stream thread met an error; it goes on with the next event")

    def _step(self) -> None:
        try:
            stream, event = self.jobs.get(timeout=self.CHECK_EVERY_S)
            stream._publish_queued(event)
        except queue.Empty:
            pass
        now = time.monotonic()
        with self._lock:
            due = [stream for stream, at in self._watched.items() if at <= now]
        for stream in due:
            with self._lock:
                if stream in self._watched:
                    self._watched[stream] = time.monotonic() + self.CHECK_EVERY_S
            if not stream.cancel_requested():
                stream.pulse()


_THREAD: _StreamThread | None = None
_THREAD_LOCK = threading.Lock()


def _stream_thread() -> _StreamThread:
    global _THREAD
    with _THREAD_LOCK:
        if _THREAD is None or not _THREAD.is_alive():
            _THREAD = _StreamThread()
            _THREAD.start()
        return _THREAD


class StreamPublisher:
    """A streamed run's events to its pub/sub channel, sealed and signed by this board, handed to the
    board's stream thread so that a publish (one round trip, over an emulated link too) never delays
    the next token; that thread also looks at the run's cancel flag every ``CHECK_EVERY_S`` (one
    cheap GET) and this run obeys only a cancel the pinned control plane signed for it and this board.

    The events a waiting client's first chunk depends on ("started", the first token) go out from
    the caller's thread instead (``send(..., now=True)``) when none waits before them: handing them
    over cost 2-5 ms on a board whose compute threads fill its cores (the other thread waits for a
    core), against one round trip inline. ``cancel_flag``: the run's flag as read already (one round
    trip with the registry record, ``inference.board.tasks``), looked at before anything is published."""

    CHECK_EVERY_S = _StreamThread.CHECK_EVERY_S
    # Before its first token (a long prefill, a fetch over a slow link) a run says its stage again
    # this often: its followers hear the board is alive and has the run, whatever its heartbeats' delay.
    PULSE_S = 2.0

    def __init__(
        self, store: CacheBox, request_id: str, me: EdgeIdentity, *, cancel_flag: bytes | None | object = UNREAD
    ):
        self.store = store
        self.me = me
        self.device = me.name
        self.request_id = request_id
        self.channel = stream_channel(me.name, request_id)
        self.cancel_key = cancel_key_name(me.name, request_id)
        self.cancelled = threading.Event()
        if cancel_flag is not UNREAD and signed_cancel(me, request_id, cancel_flag):
            self.cancelled.set()
        self._pending = 0  # events handed to the stream thread and not yet published
        self._drained = threading.Condition()
        self._sent = 0
        self._failed = False
        self._unanswered = None  # reads the cache box's answer to the event published without waiting for it
        self._stage: StreamEvent | None = None  # the last stage said, until the first token
        self._said_at = time.monotonic()
        self._thread = _stream_thread()
        self._thread.watch(self)

    def count(self) -> int:
        """The index of the next token event."""
        self._sent += 1
        return self._sent - 1

    def send(self, event: StreamEvent, *, now: bool = False, unanswered: bool = False) -> None:
        """Publish ``event`` after every event sent before it: from this thread at once when ``now``
        and none waits, else from the stream thread. ``unanswered`` (with ``now``): this thread does
        not wait for the cache box's answer to it; the next publish reads it first (the "started"
        stage, whose round trip ran before the engine started, 0.8-1.3 ms of a full hit's way
        to its first token on a loaded 2-core machine)."""
        self._stage = event if event.type == "stage" and self._sent == 0 else None
        self._said_at = time.monotonic()
        with self._drained:
            if now and not self._pending:
                self._publish(self.me.seal_event(event), unanswered=unanswered)
                return
            self._pending += 1
        self._thread.jobs.put((self, event))

    def _publish_queued(self, event: StreamEvent) -> None:
        try:
            self._publish(self.me.seal_event(event))
        finally:
            with self._drained:
                self._pending -= 1
                if not self._pending:
                    self._drained.notify_all()

    def close(self, last: StreamEvent | None = None, timeout: float = 5.0) -> None:
        """Publish ``last`` after everything sent before it (waiting up to ``timeout`` for them to
        go out), and stop looking at the run's cancel flag."""
        if last is not None:
            self.send(last)
        with self._drained:
            self._drained.wait_for(lambda: not self._pending, timeout)
            self._answered()
        self._thread.forget(self)

    def pulse(self) -> None:
        """Say the run's stage again when nothing was said for ``PULSE_S`` before its first token
        (from the stream thread)."""
        stage = self._stage
        if stage is not None and time.monotonic() - self._said_at >= self.PULSE_S:
            self.send(stage)

    def cancel_requested(self) -> bool:
        if not self.cancelled.is_set() and signed_cancel_set(self.store, self.me, self.request_id):
            self.cancelled.set()
        return self.cancelled.is_set()

    def _publish(self, data: bytes, unanswered: bool = False) -> None:
        """One event published (its answer read later when ``unanswered``), after the answer to the
        one before it was read: no later event overtakes it on another connection."""
        try:
            self._answered()
            if unanswered:
                self._unanswered = self.store.publish_unanswered(self.channel, data)
            else:
                self.store.publish(self.channel, data)
        except CacheBoxUnavailable as exc:  # the run goes on; its signed report still reaches the control plane
            self._not_published(exc)

    def _answered(self) -> None:
        """Read the answer to the event published unanswered, if one is due (its connection goes
        back to the pool)."""
        answer, self._unanswered = self._unanswered, None
        if answer is not None:
            try:
                answer()
            except CacheBoxUnavailable as exc:
                self._not_published(exc)

    def _not_published(self, exc: CacheBoxUnavailable) -> None:
        if not self._failed:
            log.warning("stream %s: an event was not published: %s", self.channel, exc)
        self._failed = True

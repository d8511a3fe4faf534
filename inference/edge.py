"""An edge board as a Celery worker: its identity, the messages it serves, its heartbeat.

Pure-ish functions here are what the Celery tasks call and what the tests call; a
board holds no database credentials: it needs the broker/cache-box URL, its token once
(to enroll) and then its own key pair (``inference.identity``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from celery import current_app
from pydantic import ValidationError

from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.signing import Keychain, KeyRing
from cachebox.store import CacheBox

from .devices import DeviceRecord, DeviceRefused, authenticate, enroll
from .engine import EngineError
from .identity import BoardKeys
from .messages import BoardMessage, BoardStatus, EncodeProgress, EnrollRequest, EncodeReport, EncodeRequest, Heartbeat, Queue, RunReport, RunRequest, Task
from .sampling import SamplingParams
from .serving import PromptError, RunResult

log = logging.getLogger(__name__)

@dataclass
class EdgeIdentity:
    name: str
    keys: BoardKeys  # this board's private keys: they sign its messages and open its ring
    record: DeviceRecord
    store: CacheBox
    ring: KeyRing | None = None  # the namespace's signing keys, as last received

    def recheck(self) -> None:
        """Raise DeviceRefused if the device was revoked or its token rotated since the board
        enrolled; otherwise take the namespace's current signing keys (a rotation arrives this way)."""
        previous = self.record.cache_namespace
        self.record = authenticate(self.store, self.name, self.keys)
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

    def check_namespace(self, requested: str | None) -> str:
        """The namespace a request may use: this board's own, whatever was asked."""
        own = self.record.cache_namespace
        if requested and requested not in (self.record.namespace, own):
            security_event("request_refused", device=self.name, reason="foreign namespace", namespace=requested)
            raise PromptError(f"device {self.name!r} belongs to namespace {self.record.namespace!r}; it does not serve {requested!r}")
        return own


_identity: EdgeIdentity | None = None


def send_enrollment(fields: dict) -> None:
    """An enrollment request to the control plane's queue (public keys and a token proof only)."""
    current_app.send_task(Task.ENROLL.value, args=[EnrollRequest(**fields).dump()], queue=Queue.CONTROL.value, expires=120)


def become(name: str, keys: BoardKeys, store: CacheBox, *, token: str | None = None, send=send_enrollment, timeout: float = 30.0) -> EdgeIdentity:
    """Make this process the board ``name``, enrolling its keys with ``token`` when the registry does
    not name them yet (raises DeviceRefused with what to do)."""
    global _identity
    _identity = EdgeIdentity(name, keys, enroll(store, name, keys, token, send, timeout=timeout), store)
    _identity._open_ring()
    return _identity


def identity() -> EdgeIdentity:
    if _identity is None:
        raise RuntimeError("this process is not an edge board; start it with `python manage.py edge`")
    return _identity


def _sender() -> dict:
    """The field that names this board in every message it sends (``report`` signs them)."""
    return {"device": _identity.name if _identity is not None else "local"}


def serve(board, request: RunRequest) -> RunReport:
    """Run one dispatched prompt; returns the report for the control plane (an error is a report too)."""
    try:
        sampling = SamplingParams(**request.sampling.model_dump())
        options = dict(max_tokens=request.max_tokens, sampling=sampling, use_cache=request.use_cache, namespace=_namespace(request.namespace))
        if request.is_schema_run:
            result: RunResult = board.run_pml(request.schema_source, request.pml, **options)
        else:
            result = board.run(request.segments, **options)
    except (PromptError, ValueError, EngineError) as exc:  # PMLError is a ValueError
        return RunReport.for_request(request, **_sender(), error=str(exc))
    return RunReport(
        **_sender(),
        request_id=request.request_id,
        meta=request.meta,
        prompt=request.prompt_text,
        text=result.text,
        tokens=result.tokens,
        breakdown=result.breakdown,
        fetched=result.fetched,
        uploaded=result.uploaded,
        modules_hit=result.modules_hit,
    )


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


def signed(message: BoardMessage) -> dict:
    """The message as it travels: stamped and signed with this board's key."""
    return identity().keys.sign(message.dump())


def send_progress(progress: EncodeProgress) -> None:
    """Encoding progress to the control plane (best effort: progress may be lost, the result is not)."""
    current_app.send_task(Task.ENCODE_PROGRESS.value, args=[signed(progress)], queue=Queue.CONTROL.value, expires=60)


def report(message: BoardMessage, task: Task = Task.RECORD_RUN) -> None:
    """Send a signed report to the control plane's queue."""
    current_app.send_task(task.value, args=[signed(message)], queue=Queue.CONTROL.value)


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
        status = BoardStatus(pid=os.getpid(), sent=time.time(), **self.board_status())
        beat = Heartbeat(device=me.name, status=status)
        current_app.send_task(Task.HEARTBEAT.value, args=[signed(beat)], queue=Queue.CONTROL.value, expires=self.interval * 3)

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

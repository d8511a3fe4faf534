"""An edge board as a Celery worker: its identity, the messages it serves, its heartbeat.

Pure-ish functions here are what the Celery tasks call and what the tests call; a
board holds no database credentials: it needs the broker/cache-box URL and its token.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from celery import current_app

from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.signing import Keychain, KeyRing
from cachebox.store import CacheBox

from .devices import DeviceRecord, DeviceRefused, authenticate
from .pipeline import PromptError, RunResult
from .sampling import SamplingParams

log = logging.getLogger(__name__)

CONTROL_QUEUE = "control"
SHARED_QUEUE = "boards"
RECORD_RUN_TASK = "edgecache.record_run"
HEARTBEAT_TASK = "edgecache.heartbeat"
ENCODE_PROGRESS_TASK = "edgecache.encode_progress"


@dataclass
class EdgeIdentity:
    name: str
    token: str
    record: DeviceRecord
    store: CacheBox
    ring: KeyRing | None = None  # the namespace's signing keys, as last received

    def recheck(self) -> None:
        """Raise DeviceRefused if the token was rotated or revoked since the board started;
        otherwise take the namespace's current signing keys (a rotation arrives this way)."""
        previous = self.record.cache_namespace
        self.record = authenticate(self.store, self.name, self.token)
        if self.record.cache_namespace != previous:
            raise DeviceRefused(f"device {self.name!r} was moved to namespace {self.record.cache_namespace!r}; restart the board to serve it")
        self._open_ring()

    def _open_ring(self) -> None:
        try:
            ring = self.record.open_keyring(self.token)
        except ValueError as exc:
            security_event("keyring_refused", device=self.name, reason=str(exc), outcome="cache off until a good ring arrives")
            ring = None
        if ring is None and self.ring is None:
            log.warning("no signing keys for this board yet: it answers by local prefill and shares nothing (rotate its token on the dashboard to enroll it)")
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


def become(name: str, token: str, store: CacheBox) -> EdgeIdentity:
    """Make this process the board ``name`` (raises DeviceRefused on a bad token)."""
    global _identity
    _identity = EdgeIdentity(name, token, authenticate(store, name, token), store)
    _identity._open_ring()
    return _identity


def identity() -> EdgeIdentity:
    if _identity is None:
        raise RuntimeError("this process is not an edge board; start it with `python manage.py edge`")
    return _identity


def run_payload(message: dict, error: str = "") -> dict:
    """The control plane's record of one dispatched prompt, before (or instead of) its result."""
    return {
        "request_id": message["request_id"],
        "meta": message.get("meta", {}),
        "prompt": message.get("pml", "") if message.get("schema") else "".join(message.get("segments") or []),
        "text": "",
        "error": error,
    }


def encode_payload(message: dict, error: str = "") -> dict:
    return {"request_id": message["request_id"], "schema_id": message.get("schema_id"), "error": error, "stored": [], "skipped": []}


def serve(board, message: dict) -> dict:
    """Run one dispatched prompt; returns the result payload for the control plane."""
    payload = run_payload(message)
    try:
        sampling = SamplingParams(**message.get("sampling", {}))
        options = dict(
            max_tokens=int(message.get("max_tokens", 16)),
            sampling=sampling,
            use_cache=bool(message.get("use_cache", True)),
            namespace=_namespace(message),
        )
        if message.get("schema"):
            result: RunResult = board.run_pml(message["schema"], message.get("pml", ""), **options)
            payload["modules_hit"] = result.modules_hit
        else:
            result = board.run(message["segments"], **options)
    except (PromptError, ValueError, TypeError, KeyError) as exc:  # PMLError is a ValueError
        payload["error"] = str(exc)
        return payload
    payload.update(
        text=result.text,
        tokens=result.tokens,
        breakdown=result.breakdown.as_dict(),
        fetched=result.fetched,
        uploaded=result.uploaded,
    )
    return payload


def encode(board, message: dict, on_progress=None) -> dict:
    """Encode a schema's modules into the cache box; returns the payload for the control plane."""
    payload = encode_payload(message)
    try:
        result = board.modular.encode_schema(message["schema"], namespace=_namespace(message), progress=on_progress)
    except (ValueError, KeyError) as exc:
        payload["error"] = str(exc)
        return payload
    except CacheBoxUnavailable as exc:
        payload["error"] = f"the cache box is unavailable: {exc}"
        return payload
    payload.update(stored=result["stored"], skipped=result["skipped"], bytes=result["bytes"])
    return payload


def _namespace(message: dict) -> str | None:
    """The namespace a message may use: on a board, its own (a foreign one is refused)."""
    if _identity is None:  # not a board process (tests, commands): as asked
        return message.get("namespace") or None
    return _identity.check_namespace(message.get("namespace"))


def send_progress(payload: dict) -> None:
    """Encoding progress to the control plane (best effort: progress may be lost, the result is not)."""
    me = identity()
    current_app.send_task(ENCODE_PROGRESS_TASK, args=[{**payload, "device": me.name, "token": me.token}], queue=CONTROL_QUEUE, expires=60)


def report(payload: dict, task: str = RECORD_RUN_TASK) -> None:
    """Send a result to the control plane's queue, signed with this board's token."""
    me = identity()
    current_app.send_task(task, args=[{**payload, "device": me.name, "token": me.token}], queue=CONTROL_QUEUE)


class Heartbeat(threading.Thread):
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
        status = {"pid": os.getpid(), "sent": time.time(), **self.board_status()}
        current_app.send_task(
            HEARTBEAT_TASK,
            args=[{"device": me.name, "token": me.token, "status": status}],
            queue=CONTROL_QUEUE,
            expires=self.interval * 3,
        )

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

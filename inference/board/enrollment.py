"""A board's identity in this process: enrollment (its keys pinned to the control plane it
trusts), the registry record and namespace ring it last trusted, and what it may open or sign.

``become`` makes this process the board; every other room of ``inference.board`` asks
``current()`` (None outside a board process: tests and commands run as "local").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from cachebox.errors import CacheBoxError, CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.keys import enroll_inbox_key
from cachebox.signing import Keychain, KeyRing, Producer, ProducerTable
from cachebox.store import CacheBox
from inference.board.devices import (
    UNREAD,
    DeviceRecord,
    DeviceRefused,
    DeviceUnknown,
    RecordRefused,
    authenticate,
    enroll,
)
from inference.board.identity import BoardKeys
from inference.board.wire import write_to_broker
from inference.contract import envelope
from inference.contract.envelope import CONTROL, EnvelopeRefused, Kind
from inference.contract.messages import BoardMessage, EnrollRequest, InboxMessage, StreamEvent, Task
from inference.serving.run import PromptError

log = logging.getLogger("inference.board")


@dataclass
class EdgeIdentity:
    name: str
    keys: BoardKeys  # this board's private keys (they sign its messages and open its ring) and the pinned control plane
    record: DeviceRecord
    store: CacheBox
    ring: KeyRing | None = None  # the namespace's keys, as last received
    producers: ProducerTable | None = None  # whose entries this board accepts, as last received (its serial only grows)

    def recheck(self, raw: bytes | None | object = UNREAD) -> None:
        """Raise DeviceRefused if the device was revoked or its token rotated since the board
        enrolled, or its record is not one the pinned control plane signed (or older than the last
        one); otherwise take the namespace's current keys (a rotation arrives this way). ``raw``:
        the registry record as read already (else it is read here)."""
        previous = self.record.cache_namespace
        try:
            self.record = authenticate(self.store, self.name, self.keys, newer_than=self.record.serial, raw=raw)
        except RecordRefused:
            # Not the control plane's word (logged): neither a revocation nor new keys. This board
            # serves on with the last record it trusted.
            return
        except DeviceUnknown:
            # This board enrolled, so its record existed: a registry without it is a cache box that
            # restarted empty. Revoking or rotating writes a record; only its absence is "cannot
            # tell" (as an unreachable cache box), and the control plane publishes it again when
            # it accepts this board's next heartbeat.
            log.warning(
                "the registry has no record of %s (the cache box restarted empty?): serving on with its last one",
                self.name,
            )
            return
        if self.record.cache_namespace != previous:
            raise DeviceRefused(
                f"device {self.name!r} was moved to namespace {self.record.cache_namespace!r}; restart the board to serve it"
            )
        self._open_ring()
        if raw is UNREAD:  # a heartbeat's or a refresh's check (not the one before every task): the producer table too
            self.read_producers()

    def read_producers(self) -> None:
        """Take the tenant's producer table if the pinned control plane signed it and it is not older
        than the one held (a replay would lift a quarantine); keep the last good one otherwise."""
        tenant = self.record.namespace
        try:
            raw = self.store.get_producer_table(tenant)
        except CacheBoxError as exc:  # down, or still the enrollment user (its own user reads it next)
            log.warning("cannot read the producer table of %s now: %s", tenant, exc)
            return
        if raw is None:
            return
        held = self.producers.serial if self.producers is not None else 0
        try:
            self.producers = ProducerTable.verified(
                json.loads(raw), self.keys.control_plane_key, tenant, newer_than=held
            )
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            security_event(
                "producers_refused", device=self.name, reason=str(exc)[:500], outcome="the last good table stays"
            )

    def _open_ring(self) -> None:
        try:
            ring = self.record.open_keyring(self.keys)
        except ValueError as exc:
            security_event(
                "keyring_refused", device=self.name, reason=str(exc), outcome="cache off until a good ring arrives"
            )
            ring = None
        if ring is None and self.ring is None:
            log.warning(
                "no signing keys for this board yet: it answers by local prefill and shares nothing until the control plane seals its namespace's ring for it"
            )
        self.ring = ring

    def keychain(self) -> Keychain:
        """Keys for the pipeline: always this identity's current ring; refreshing re-reads the registry."""

        def source(namespace: str) -> KeyRing | None:
            ring = self.ring
            if ring is None or not ring.covers(namespace):
                return None
            return ring.with_producers(Producer(self.name, self.keys.signing), self.producers)

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
                message,
                kind=kind,
                to=self.name,
                signer_public_key=self.keys.control_plane_key,
                ring_for=self.ring_for,
                expired_ok=expired_ok,
            )
        except EnvelopeRefused as exc:
            security_event("request_refused", device=self.name, kind=str(kind), reason=str(exc)[:500])
            raise
        return body

    def seal_event(self, event: StreamEvent) -> bytes:
        """A stream event as it is published: sealed under the namespace's key, signed by this board,
        addressed to its run."""
        sealed = envelope.seal(
            event.compact(),
            kind=Kind.STREAM,
            sender=self.name,
            to=event.request_id,
            signer=self.keys.signing,
            ring=self.ring,
        )
        return json.dumps(sealed, separators=(",", ":")).encode()

    def seal(self, message: BoardMessage, kind: Kind) -> dict:
        """``message`` as it travels to the control plane: signed with this board's key, sealed
        under the namespace's data key (heartbeats, which carry nothing of a tenant, in the clear)."""
        ring = None if kind == Kind.HEARTBEAT else self.ring
        if ring is None and kind != Kind.HEARTBEAT:
            raise DeviceRefused(f"board {self.name!r} holds no key of its namespace: nothing can be sent sealed")
        return envelope.seal(
            message.dump(),
            kind=kind,
            sender=self.name,
            to=CONTROL,
            signer=self.keys.signing,
            ring=ring,
            message_id=str(getattr(message, "request_id", "") or ""),
        )

    def check_namespace(self, requested: str | None) -> str:
        """The namespace a request may use: this board's own, whatever was asked."""
        own = self.record.cache_namespace
        if requested and requested not in (self.record.namespace, own):
            security_event("request_refused", device=self.name, reason="foreign namespace", namespace=requested)
            raise PromptError(
                f"device {self.name!r} belongs to namespace {self.record.namespace!r}; it does not serve {requested!r}"
            )
        return own


_identity: EdgeIdentity | None = None


def send_enrollment(fields: dict) -> None:
    """An enrollment request (public keys, signed with the token's key) onto this device's own
    enrollment inbox (``ec:enroll:NAME``), the one key its enrollment user may write."""
    request = EnrollRequest(**fields)
    raw = json.dumps(InboxMessage(task=Task.ENROLL, body=request.dump()).dump(), separators=(",", ":"))
    write_to_broker(
        lambda client: client.lpush(enroll_inbox_key(request.device), raw), retry=False, what="the enrollment"
    )


def become(
    name: str,
    keys: BoardKeys,
    store: CacheBox,
    *,
    token: str | None = None,
    send=send_enrollment,
    timeout: float = 30.0,
    save=None,
    then_as=None,
) -> EdgeIdentity:
    """Make this process the board ``name``, pinning the control plane and enrolling its keys with
    ``token`` when the registry does not name them yet (``save`` keeps the pinned keys; ``then_as()``
    gives the store as the board's own Redis user once enrolled; raises DeviceRefused with what to do)."""
    global _identity
    record, keys = enroll(store, name, keys, token, send, timeout=timeout, save=save, then_as=then_as)
    if then_as is not None:  # enrolled through the enrollment user, which is gone now: its own user from here on
        store = then_as()
    _identity = EdgeIdentity(name, keys, record, store)
    _identity._open_ring()
    _identity.read_producers()
    return _identity


def identity() -> EdgeIdentity:
    if _identity is None:
        raise RuntimeError(
            "this process is not an edge board; start it with `edgecache-board --name NAME` (or `python manage.py edge`)"
        )
    return _identity


def current() -> EdgeIdentity | None:
    """This process's board identity, or None (not a board process)."""
    return _identity


def sender() -> dict:
    """The field that names this board in every message it sends (the outbox signs them)."""
    return {"device": _identity.name if _identity is not None else "local"}

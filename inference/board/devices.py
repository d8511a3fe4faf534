"""Devices as boards see them: a registry in the cache box, signed by the control plane, no database.

The control plane publishes one JSON record per device (its board's public keys, the token's
hash while it may enroll, threads, memory, link profile, revoked flag, the namespace and its key
ring sealed to the board) whenever a device is registered, enrolled, rotated or revoked. Every
record carries the control plane's Ed25519 signature and a serial; a board accepts a record only
when the control plane it pinned signed it, and never one older than the last it accepted. Nothing
in a record lets its reader act as a board or open a ring: keys are public, rings are sealed to a
private key only the board holds, and a token's SHA-256 does not give the token.

A board enrolls once with its token (``enroll``): the record then carries the control plane's
public key with a proof only the token checks (``cachebox.signing.pin_proof``), which the board
pins. From then on it proves itself with its keys: it checks that the record still names its
public key when it starts, before every task and at every heartbeat, so a revoked device or a
rotated token stops it at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cachebox.errors import CacheBoxRefused
from cachebox.events import security_event
from cachebox.keys import enrollment_refusal_key_name
from cachebox.signing import KeyRing, pin_proof, private_namespace, public_hex, sign_document, unseal, verify_document
from inference.board.identity import BoardKeys


class DeviceRefused(Exception):
    """A board presented an unknown name, a wrong token, or a revoked one; or its record is not
    one the control plane it trusts signed."""


class RecordRefused(DeviceRefused):
    """A registry record the pinned control plane did not sign for this device (forged, altered,
    replayed): not an order to stop. A board keeps its last good record."""


class DeviceUnknown(DeviceRefused):
    """The registry holds no record of this device (never registered, or a cache box that restarted empty)."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class DeviceRecord:
    name: str
    token_sha256: str = ""  # lets a board check its token before enrolling (the hash gives no token)
    signing_key: str = ""  # the enrolled board's Ed25519 public key (hex); "" until it enrolls
    box_key: str = ""  # its X25519 public key, which the ring is sealed to
    threads: int = 1
    memory_mb: int = 0  # the board's registered memory: its buffers are sized to it (0: unknown)
    link_bandwidth_mbps: float | None = None
    link_rtt_ms: float | None = None
    revoked: bool = False
    namespace: str = "default"  # the tenant: the board reads and writes this namespace only
    share: bool = True  # False: the board caches in a namespace of its own (no cross-device timing leaks)
    keyring: str = ""  # the namespace's keys, signed by the control plane and sealed to ``box_key``
    control_plane_key: str = ""  # the control plane's Ed25519 public key (hex), which signs this record
    pin: str = ""  # while the token may enroll: the token's proof of ``control_plane_key`` (a board pins it)
    serial: int = 0  # when it was published (ns); a board refuses a record older than the last it accepted

    @property
    def cache_namespace(self) -> str:
        """Where this board's entries live."""
        return self.namespace if self.share else private_namespace(self.namespace, self.name)

    def open_keyring(self, keys: BoardKeys) -> KeyRing | None:
        """The namespace's keys, opened with the board's private key and checked against the control
        plane's signature (None when none were sealed for it; ValueError when refused)."""
        if not self.keyring:
            return None
        return unseal(self.keyring, keys.box, self.name, keys.control_plane_key)

    def check(self, keys: BoardKeys) -> None:
        """Raise DeviceRefused unless this record names this board (enrolled, not revoked)."""
        if self.revoked:
            raise DeviceRefused(f"device {self.name!r} has been revoked; register it again or rotate its token")
        if not hmac.compare_digest(self.signing_key, keys.signing_public_key):
            raise DeviceRefused(
                f"this board is not enrolled as {self.name!r} (its token was rotated, or another board enrolled with it); "
                "start it with the current token (--token or EDGECACHE_DEVICE_TOKEN)"
            )

    def check_token(self, token: str) -> None:
        if not self.token_sha256 or not hmac.compare_digest(self.token_sha256, hash_token(token)):
            raise DeviceRefused(
                f"wrong or expired token for device {self.name!r}; use the token shown when it was registered or rotated"
            )


def publish(store, record: DeviceRecord, signer: Ed25519PrivateKey) -> None:
    """Sign the record with the control plane's key and store it for boards to read
    (CacheBoxUnavailable when the cache box cannot take it)."""
    record.control_plane_key = public_hex(signer)
    record.serial = time.time_ns()
    doc = {key: value for key, value in asdict(record).items()}
    store.put_device_record(record.name, json.dumps(sign_document(signer, doc)))


class _Unread:
    """What a value not read yet is (a read may give None: nothing there)."""

    def __repr__(self) -> str:
        return "UNREAD"


UNREAD = _Unread()


def lookup(store, name: str, raw: bytes | None | _Unread = UNREAD) -> DeviceRecord | None:
    """The device's record (with the signed document it came from), None when unknown
    (CacheBoxUnavailable when the cache box cannot tell). Not checked yet: see ``verified``.
    ``raw``: the record as read already (with other keys, in one round trip)."""
    try:
        raw = store.get_device_record(name) if raw is UNREAD else raw
    except ValueError:
        return None  # a name no device can have (':', '*', ...): unknown, refused by the caller
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        known = set(DeviceRecord.__dataclass_fields__)
        record = DeviceRecord(**{key: value for key, value in doc.items() if key in known})
    except (ValueError, TypeError) as exc:
        raise DeviceRefused(
            f"the registry record of device {name!r} is unreadable ({exc}); re-save the device on the dashboard"
        ) from exc
    record.signed_document = doc  # what its signature covers, as stored
    return record


def verified(record: DeviceRecord, keys: BoardKeys, *, newer_than: int = 0) -> DeviceRecord:
    """The record if the control plane this board pinned signed it for this device, and it is not
    older than ``newer_than`` (a serial); else DeviceRefused (logged)."""
    doc = getattr(record, "signed_document", {})
    reason = ""
    if not keys.control_plane_key:
        reason = "this board has not pinned a control plane yet"
    elif not verify_document(doc, keys.control_plane_key):
        reason = "not signed by the control plane this board pinned"
    elif doc.get("name") != record.name:
        reason = "signed for another device"
    elif record.serial < newer_than:
        reason = f"older than the record accepted before (serial {record.serial} < {newer_than}): a replay"
    if reason:
        security_event("record_refused", device=record.name, reason=reason)
        raise RecordRefused(f"the registry record of device {record.name!r} was refused: {reason}")
    return record


def _known(store, name: str, raw: bytes | None | _Unread = UNREAD) -> DeviceRecord:
    found = lookup(store, name, raw)
    if found is None:
        raise DeviceUnknown(f"unknown device {name!r}: register it on the dashboard (Devices > Register) first")
    return found


def authenticate(
    store, name: str, keys: BoardKeys, *, newer_than: int = 0, raw: bytes | None | _Unread = UNREAD
) -> DeviceRecord:
    """The device's record if the pinned control plane signed it and it names this board's keys,
    else DeviceRefused (``raw``: the record as read already)."""
    record = verified(_known(store, name, raw), keys, newer_than=newer_than)
    record.check(keys)
    return record


def pin(store, name: str, keys: BoardKeys, token: str) -> BoardKeys:
    """Trust the control plane the token vouches for: the record's public key, when its pin proof
    checks under the token. Returns the keys with it pinned (the caller saves them)."""
    record = _known(store, name)
    record.check_token(token)
    if (
        not record.control_plane_key
        or not record.pin
        or not hmac.compare_digest(record.pin, pin_proof(token, record.control_plane_key))
    ):
        security_event("record_refused", device=name, reason="the control plane's key is not vouched for by this token")
        raise DeviceRefused(
            f"the registry record of {name!r} does not prove the control plane's key with this token: rotate the token and try again"
        )
    return keys.pinned(record.control_plane_key)


ENROLLMENT_REFUSAL_TTL_S = 300  # how long the control plane's word on a refused enrollment is kept for its board


def enrollment_refusal(name: str, signing_public_key: str, reason: str, signer: Ed25519PrivateKey) -> bytes:
    """The control plane's signed word that the enrollment of ``name`` by the board holding
    ``signing_public_key`` was refused, and why. It is kept apart from the device's record (under
    ``cachebox.keys.enrollment_refusal_key_name``, for ``ENROLLMENT_REFUSAL_TTL_S``): a forged
    enrollment changes no record a board reads."""
    doc = {"name": name, "signing_key": signing_public_key, "reason": reason[:300], "ts": time.time()}
    return json.dumps(sign_document(signer, doc), separators=(",", ":")).encode()


def enrollment_refused(store, name: str, keys: BoardKeys) -> str | None:
    """Why the control plane refused this board's enrollment as ``name`` (None: it has not said): only
    its own word, signed by the control plane this board pinned, for this device and these keys."""
    raw = store.read_flag(enrollment_refusal_key_name(name, keys.signing_public_key))
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not keys.control_plane_key or not verify_document(doc, keys.control_plane_key):
        security_event(
            "record_refused",
            device=name,
            reason="an enrollment refusal not signed by the control plane this board pinned",
        )
        return None
    if doc.get("name") != name or doc.get("signing_key") != keys.signing_public_key:
        return None
    return str(doc.get("reason") or "no reason given")


def enroll(
    store,
    name: str,
    keys: BoardKeys,
    token: str | None,
    send: Callable[[dict], None],
    *,
    timeout: float = 30.0,
    poll: float = 0.2,
    save: Callable[[BoardKeys], None] | None = None,
    then_as: Callable[[], object] | None = None,
) -> tuple[DeviceRecord, BoardKeys]:
    """This board's record (and its keys, the control plane pinned), enrolling it first when the
    registry does not name its keys yet.

    Without a pinned control plane the token pins one first (``pin``; ``save`` keeps it). The token
    is checked locally against its hash, then an enrollment request (public keys + the token key's
    signature, see ``inference.board.identity``) goes to the control plane through ``send``; the board
    waits for its record to name its keys. ``then_as()``: the store as the board's own Redis user,
    used once the enrollment user is gone (the control plane deletes it as it enrolls the board).
    Raises DeviceRefused with what to do.
    """
    if not keys.control_plane_key:
        if not token:
            raise DeviceRefused(
                f"this board is not enrolled as {name!r}: start it once with the device's token (--token or EDGECACHE_DEVICE_TOKEN)"
            )
        keys = pin(store, name, keys, token)
        if save is not None:
            save(keys)
    record = verified(_known(store, name), keys)
    if record.revoked:
        record.check(keys)  # raises "revoked"
    if record.signing_key == keys.signing_public_key:
        return record, keys
    if not token:
        raise DeviceRefused(
            f"this board is not enrolled as {name!r}: start it once with the device's token (--token or EDGECACHE_DEVICE_TOKEN)"
        )
    record.check_token(token)
    send(keys.enrollment(name, token))
    enrolling = True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            record = verified(_known(store, name), keys)
            if record.signing_key == keys.signing_public_key:
                record.check(keys)
                return record, keys
            # Only the enrollment user reads refusals: once it is gone (the control plane enrolled this
            # board and makes its own user before it publishes the record) there is none to read.
            reason = enrollment_refused(store, name, keys) if enrolling else None
        except CacheBoxRefused:
            if then_as is None:
                raise
            store, then_as, enrolling = then_as(), None, False  # enrolled meanwhile: the enrollment user is gone
            continue
        if reason is not None:
            raise DeviceRefused(f"the control plane refused this board's enrollment: {reason}")
        time.sleep(poll)
    raise DeviceRefused(
        f"the control plane did not confirm the enrollment of {name!r} within {timeout:g} s: "
        "is its worker running (`make run` starts it) and the token current?"
    )

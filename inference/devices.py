"""Devices as boards see them: a registry in the cache box, no database.

The control plane publishes one JSON record per device (its board's public keys, the token's
hash until it enrolls, threads, link profile, revoked flag, the namespace and its key ring
sealed to the board) whenever a device is registered, enrolled, rotated or revoked. Nothing
in a record lets its reader act as a board or open a ring: keys are public, rings are sealed
to a private key only the board holds, and a token's SHA-256 does not give the token.

A board enrolls once with its token (``enroll``), then proves itself with its keys: it checks
that the record still names its public key when it starts, before every task and at every
heartbeat, so a revoked device or a rotated token stops it at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from cachebox.signing import KeyRing, private_namespace, unseal

from .identity import BoardKeys


class DeviceRefused(Exception):
    """A board presented an unknown name, a wrong token, or a revoked one."""


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
    keyring: str = ""  # the namespace's signing keys, sealed to ``box_key`` (see cachebox.signing)
    enrollment: dict = field(default_factory=dict)  # the last refused enrollment: {"signing_key", "reason"}

    @property
    def cache_namespace(self) -> str:
        """Where this board's entries live."""
        return self.namespace if self.share else private_namespace(self.namespace, self.name)

    def open_keyring(self, keys: BoardKeys) -> KeyRing | None:
        """The signing keys, opened with the board's private key (None when none were sealed for it)."""
        if not self.keyring:
            return None
        return unseal(self.keyring, keys.box, self.name)

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
            raise DeviceRefused(f"wrong token for device {self.name!r}; use the token shown when it was registered or rotated")


def publish(store, record: DeviceRecord) -> None:
    """Store the record for boards to read (CacheBoxUnavailable when the cache box cannot take it)."""
    store.put_device_record(record.name, json.dumps(asdict(record)))


def lookup(store, name: str) -> DeviceRecord | None:
    """The device's record, None when unknown (CacheBoxUnavailable when the cache box cannot tell)."""
    try:
        raw = store.get_device_record(name)
    except ValueError:
        return None  # a name no device can have (':', '*', ...): unknown, refused by the caller
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        known = set(DeviceRecord.__dataclass_fields__)
        return DeviceRecord(**{key: value for key, value in doc.items() if key in known})
    except (ValueError, TypeError) as exc:
        raise DeviceRefused(f"the registry record of device {name!r} is unreadable ({exc}); re-save the device on the dashboard") from exc


def _known(store, name: str) -> DeviceRecord:
    record = lookup(store, name)
    if record is None:
        raise DeviceUnknown(f"unknown device {name!r}: register it on the dashboard (Devices > Register) first")
    return record


def authenticate(store, name: str, keys: BoardKeys) -> DeviceRecord:
    """The device's record if it names this board's keys, else DeviceRefused."""
    record = _known(store, name)
    record.check(keys)
    return record


def enroll(store, name: str, keys: BoardKeys, token: str | None, send: Callable[[dict], None], *, timeout: float = 30.0, poll: float = 0.2) -> DeviceRecord:
    """This board's record, enrolling it first when the registry does not name its keys yet.

    The token is checked locally against its hash, then an enrollment request (public keys +
    token proof, see ``inference.identity``) goes to the control plane through ``send``; the
    board waits for its record to name its keys. Raises DeviceRefused with what to do.
    """
    record = _known(store, name)
    if record.revoked:
        record.check(keys)  # raises "revoked"
    if record.signing_key == keys.signing_public_key:
        return record
    if not token:
        raise DeviceRefused(f"this board is not enrolled as {name!r}: start it once with the device's token (--token or EDGECACHE_DEVICE_TOKEN)")
    record.check_token(token)
    send(keys.enrollment(name, token))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = _known(store, name)
        if record.signing_key == keys.signing_public_key:
            record.check(keys)
            return record
        refused = record.enrollment or {}
        if refused.get("signing_key") == keys.signing_public_key:
            raise DeviceRefused(f"the control plane refused this board's enrollment: {refused.get('reason', 'no reason given')}")
        time.sleep(poll)
    raise DeviceRefused(
        f"the control plane did not confirm the enrollment of {name!r} within {timeout:g} s: "
        "is its worker running (`make run` starts it) and the token current?"
    )

"""Device credentials as boards see them: a registry in the cache box, no database.

The control plane publishes one JSON record per device (token hash, threads, link
profile, revoked flag) whenever a device is registered, rotated or revoked. A board
checks its token against that record when it starts and before every task, so a
revoked board is refused at once. Only SHA-256 hashes of tokens are ever stored.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import asdict, dataclass

from cachebox.signing import KeyRing, private_namespace, unseal
from cachebox.store import CacheBox


class DeviceRefused(Exception):
    """A board presented an unknown name, a wrong token, or a revoked one."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class DeviceRecord:
    name: str
    token_sha256: str
    threads: int = 1
    link_bandwidth_mbps: float | None = None
    link_rtt_ms: float | None = None
    revoked: bool = False
    namespace: str = "default"  # the tenant: the board reads and writes this namespace only
    share: bool = True  # False: the board caches in a namespace of its own (no cross-device timing leaks)
    keyring: str = ""  # the namespace's signing keys, sealed for this device (see cachebox.signing)

    @property
    def cache_namespace(self) -> str:
        """Where this board's entries live."""
        return self.namespace if self.share else private_namespace(self.namespace, self.name)

    def open_keyring(self, token: str) -> KeyRing | None:
        """The signing keys, opened with the board's token (None when none were sealed for it)."""
        if not self.keyring:
            return None
        return unseal(self.keyring, token, self.name)

    def check(self, token: str) -> None:
        """Raise DeviceRefused unless ``token`` is this device's current token."""
        if self.revoked:
            raise DeviceRefused(f"device {self.name!r} has been revoked; register it again or rotate its token")
        if not hmac.compare_digest(self.token_sha256, hash_token(token)):
            raise DeviceRefused(f"wrong token for device {self.name!r}; use the token shown when it was registered or rotated")


def publish(store: CacheBox, record: DeviceRecord) -> None:
    """Store the record for boards to read (CacheBoxUnavailable when the cache box cannot take it)."""
    store.put_device_record(record.name, json.dumps(asdict(record)))


def lookup(store: CacheBox, name: str) -> DeviceRecord | None:
    """The device's record, None when unknown (CacheBoxUnavailable when the cache box cannot tell)."""
    try:
        raw = store.get_device_record(name)
    except ValueError:
        return None  # a name no device can have (':', '*', ...): unknown, refused by the caller
    if raw is None:
        return None
    known = set(DeviceRecord.__dataclass_fields__)
    return DeviceRecord(**{key: value for key, value in json.loads(raw).items() if key in known})


def authenticate(store: CacheBox, name: str, token: str) -> DeviceRecord:
    """The device's record if ``token`` is valid, else DeviceRefused."""
    record = lookup(store, name)
    if record is None:
        raise DeviceRefused(f"unknown device {name!r}: register it on the dashboard (Devices > Register) first")
    record.check(token)
    return record

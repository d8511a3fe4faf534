"""Entry signing keys: one key ring per namespace (tenant), rotated by generation.

Every entry header is authenticated with HMAC-SHA256 under its namespace's current
key, and the header commits to the state through a SHA-256 digest, so a board checks
an entry before any of its bytes reach llama.cpp. Keys are derived on the control
plane from one master secret (``derive_keyring``); boards receive their namespace's
ring sealed to their own X25519 public key (``seal`` / ``unseal``), through the device
registry, and never see other tenants' keys.

Pure logic and standard crypto primitives (hashlib, hmac; X25519, HKDF and AES-GCM from
``cryptography``): no I/O, tested in milliseconds.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import threading
import time
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import EntryError

MAC_BYTES = 32
# Generations kept after a rotation: entries signed just before it stay usable.
KEEP_GENERATIONS = 2


class UnknownKey(EntryError):
    """Signed with a generation newer than this ring: the board should refresh its keys.

    Not a forgery by itself, so the entry is skipped (a miss) but not evicted.
    """


@dataclass(frozen=True)
class KeyRing:
    """The signing keys of one namespace: generation -> 32-byte key."""

    namespace: str
    keys: dict[int, bytes]
    current: int
    # Namespaces whose entries this ring signs (a tenant's own and its boards' private ones).
    extra_namespaces: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if self.current not in self.keys:
            raise ValueError(f"key ring for {self.namespace!r} lacks its current generation {self.current}")
        if any(len(key) < 16 for key in self.keys.values()):
            raise ValueError("signing keys must be at least 16 bytes")

    def covers(self, namespace: str) -> bool:
        return namespace == self.namespace or namespace in self.extra_namespaces

    def sign(self, message: bytes) -> tuple[int, bytes]:
        """(generation, MAC) of ``message`` under the current key."""
        return self.current, hmac.new(self.keys[self.current], message, hashlib.sha256).digest()

    def verify(self, generation: int, mac: bytes, message: bytes) -> None:
        """Raise EntryError unless ``mac`` authenticates ``message`` under ``generation``."""
        key = self.keys.get(generation)
        if key is None:
            if generation > self.current:
                raise UnknownKey(f"entry is signed with key generation {generation}, newer than this board's {self.current}")
            raise EntryError(f"entry is signed with key generation {generation}, which was retired")
        expected = hmac.new(key, message, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, mac):
            raise EntryError("entry signature does not match: forged or altered")

    def to_dict(self) -> dict:
        return {
            "ns": self.namespace,
            "current": self.current,
            "keys": {str(gen): key.hex() for gen, key in self.keys.items()},
            "extra": list(self.extra_namespaces),
        }

    @classmethod
    def from_dict(cls, doc: dict) -> "KeyRing":
        try:
            return cls(
                namespace=str(doc["ns"]),
                keys={int(gen): bytes.fromhex(key) for gen, key in doc["keys"].items()},
                current=int(doc["current"]),
                extra_namespaces=tuple(str(ns) for ns in doc.get("extra", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed key ring: {exc}") from exc


def derive_key(master: bytes, namespace: str, generation: int) -> bytes:
    """The signing key of ``namespace`` at ``generation`` (HMAC-SHA256 as a KDF)."""
    if generation < 1:
        raise ValueError("key generations start at 1")
    return hmac.new(master, f"edgecache/entry-key/v1/{namespace}/{generation}".encode(), hashlib.sha256).digest()


def derive_keyring(master: bytes, namespace: str, generation: int, extra_namespaces=()) -> KeyRing:
    """The ring a board of ``namespace`` holds: the current key and the one before it."""
    if len(master) < 16:
        raise ValueError("the signing master secret must be at least 16 bytes")
    first = max(1, generation - KEEP_GENERATIONS + 1)
    keys = {gen: derive_key(master, namespace, gen) for gen in range(first, generation + 1)}
    return KeyRing(namespace, keys, generation, tuple(extra_namespaces))


def private_namespace(namespace: str, device: str) -> str:
    """Where a board of a namespace that does not share across devices keeps its entries.

    ``<namespace>.dev-<device>`` while that fits in 64 characters; otherwise a digest of the
    full pair, ``<namespace>.dev.<24 hex>`` (a device name has no '.', so the two forms never
    meet). Nothing is cut: two boards' private namespaces never collide.
    """
    readable = f"{namespace}.dev-{device}"
    if len(readable) <= 64:
        return readable
    digest = hashlib.blake2b(f"{namespace}\x00{device}".encode(), digest_size=12).hexdigest()
    return f"{namespace}.dev.{digest}"


def tenant_of(namespace: str) -> str:
    """The tenant a (possibly private) cache namespace belongs to."""
    return namespace.split(".dev", 1)[0]


# -- delivery to boards ---------------------------------------------------------------------
# A ring reaches a board sealed to the board's own X25519 public key (an ephemeral-static
# Diffie-Hellman, HKDF-SHA256, AES-256-GCM bound to the device name). Only the board, which
# keeps the private key and never sends it, can open it: a Redis dump (sealed rings, public
# keys) or a database dump (public keys) alone opens no ring.

_SEAL_INFO = b"edgecache/keyring-seal/v2"


def _seal_key(shared: bytes, device: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SEAL_INFO + b"/" + device.encode()).derive(shared)


def seal(ring: KeyRing, box_public_key: bytes, device: str) -> str:
    """The ring encrypted for one board's X25519 public key (32 bytes), bound to its name."""
    ephemeral = X25519PrivateKey.generate()
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(box_public_key))
    nonce = os.urandom(12)
    sealed = AESGCM(_seal_key(shared, device)).encrypt(nonce, json.dumps(ring.to_dict()).encode(), device.encode())
    return base64.b64encode(ephemeral.public_key().public_bytes_raw() + nonce + sealed).decode()


def unseal(sealed: str, box_private_key: X25519PrivateKey, device: str) -> KeyRing:
    """Open a ring sealed for ``device``; ValueError when the key or the blob is wrong."""
    try:
        raw = base64.b64decode(sealed, validate=True)
        if len(raw) < 32 + 12 + 16:
            raise ValueError("too short")
        shared = box_private_key.exchange(X25519PublicKey.from_public_bytes(raw[:32]))
        plain = AESGCM(_seal_key(shared, device)).decrypt(raw[32:44], raw[44:], device.encode())
        return KeyRing.from_dict(json.loads(plain))
    except (InvalidTag, ValueError, TypeError) as exc:
        raise ValueError(f"cannot open the key ring for device {device!r}: {exc or 'not sealed for this board'}") from exc


class Keychain:
    """Where a pipeline finds the ring of a namespace.

    ``source(namespace)`` gives the ring (or None when this holder has no key for it);
    answers are remembered until ``refresh()``, which a board calls when it meets a newer
    key generation than its own (at most once per ``min_refresh_s``).
    """

    def __init__(self, source, *, min_refresh_s: float = 1.0, remember: bool = True, on_refresh=None):
        self._source = source
        self._remember = remember
        self._on_refresh = on_refresh
        self._rings: dict[str, KeyRing | None] = {}
        self._lock = threading.Lock()
        self._clock = time.monotonic
        self._last_refresh = float("-inf")
        self.min_refresh_s = min_refresh_s

    def ring(self, namespace: str) -> KeyRing | None:
        if not self._remember:
            return self._source(namespace)
        with self._lock:
            if namespace not in self._rings:
                self._rings[namespace] = self._source(namespace)
            return self._rings[namespace]

    def refresh(self) -> bool:
        """Forget remembered rings so the next lookup asks the source; False when asked too recently."""
        with self._lock:
            now = self._clock()
            if now - self._last_refresh < self.min_refresh_s:
                return False
            self._last_refresh = now
            self._rings.clear()
        if self._on_refresh is not None:
            self._on_refresh()
        return True

"""A board's own identity: its key pairs, how it enrolls once, and how it signs what it sends.

A device token is a one-time enrollment secret. On its first start a board makes two key
pairs (Ed25519 to sign its messages, X25519 to receive its namespace's key ring), keeps the
private halves in a file of its own (mode 0600), and sends only the public halves with a
proof that it knows the token: an HMAC under a key derived from the token (the token never
travels). From then on every message it sends is signed, and the control plane seals key
rings to its X25519 key. Nothing a broker or cache-box reader sees lets it act as a board.

Pure crypto over ``cryptography`` and the standard library; the only I/O is the key file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

_ENROLL_INFO = b"edgecache/enroll/v1"
SIGNATURE_FIELD = "signature"
TIMESTAMP_FIELD = "ts"


def canonical(payload: dict) -> bytes:
    """The bytes a signature covers: the message without its signature, keys sorted, compact."""
    body = {key: value for key, value in payload.items() if key != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def enroll_key(token: str) -> bytes:
    """The key that proves knowledge of ``token`` at enrollment (the control plane keeps it until then)."""
    return hmac.new(token.encode(), _ENROLL_INFO, hashlib.sha256).digest()


def enroll_proof(key: bytes, device: str, signing_public_key: str, box_public_key: str, ts: float) -> str:
    message = json.dumps([device, signing_public_key, box_public_key, ts], separators=(",", ":")).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify_signature(payload: dict, signing_public_key: str) -> bool:
    """True when ``payload`` (as received) carries a valid signature of the board with this public key (hex)."""
    try:
        signature = base64.b64decode(str(payload.get(SIGNATURE_FIELD, "")), validate=True)
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(signing_public_key)).verify(signature, canonical(payload))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


@dataclass(frozen=True)
class BoardKeys:
    """The private keys of one board (they never leave it)."""

    signing: Ed25519PrivateKey
    box: X25519PrivateKey

    @classmethod
    def generate(cls) -> "BoardKeys":
        return cls(Ed25519PrivateKey.generate(), X25519PrivateKey.generate())

    @property
    def signing_public_key(self) -> str:
        return self.signing.public_key().public_bytes_raw().hex()

    @property
    def box_public_key(self) -> str:
        return self.box.public_key().public_bytes_raw().hex()

    def sign(self, payload: dict) -> dict:
        """``payload`` with its send time and signature (the receiver checks both)."""
        stamped = {**payload, TIMESTAMP_FIELD: time.time()}
        stamped[SIGNATURE_FIELD] = base64.b64encode(self.signing.sign(canonical(stamped))).decode()
        return stamped

    def enrollment(self, device: str, token: str) -> dict:
        """The fields of an enrollment request: public keys, a time and the token proof."""
        ts = time.time()
        return {
            "device": device,
            "signing_public_key": self.signing_public_key,
            "box_public_key": self.box_public_key,
            "ts": ts,
            "proof": enroll_proof(enroll_key(token), device, self.signing_public_key, self.box_public_key, ts),
        }

    # -- the key file ------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return json.dumps({"signing": self.signing.private_bytes_raw().hex(), "box": self.box.private_bytes_raw().hex()}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "BoardKeys":
        try:
            doc = json.loads(raw)
            return cls(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(doc["signing"])), X25519PrivateKey.from_private_bytes(bytes.fromhex(doc["box"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"unreadable board key file: {exc}") from exc

    @classmethod
    def load_or_create(cls, path: Path) -> "BoardKeys":
        """This board's keys from ``path``; made (mode 0600, written whole or not at all) on first use."""
        path = Path(path)
        if path.exists():
            return cls.from_bytes(path.read_bytes())
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        keys = cls.generate()
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".board-key-")  # created 0600
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(keys.to_bytes())
            try:
                os.link(temp, path)  # fails when another process made it first: use theirs
            except FileExistsError:
                return cls.from_bytes(path.read_bytes())
        finally:
            os.unlink(temp)
        return keys

"""A board's own identity: its key pairs, how it enrolls once, and how it signs what it sends.

A device token is a one-time enrollment secret (it expires, and is spent by the first
enrollment). On its first start a board makes two key pairs (Ed25519 to sign its messages,
X25519 to receive its namespace's key ring) and a password for its own Redis user, keeps them in
a file of its own (mode 0600), and sends only the public halves and the password's SHA-256, signed
with a key the token gives (``enrollment_key``): the token never travels, and what the control
plane keeps to check it (the public half) lets a copy of its database enroll nobody.

From then on every message the board sends is signed with its own key, and the board trusts only
what the control plane signed: it pins the control plane's public key at enrollment (the token
vouches for it, ``cachebox.signing.pin_proof``) in its key file.

Pure crypto over ``cryptography`` and the standard library; the only I/O is the key file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from cachebox.signing import SIGNATURE_FIELD, canonical, sign_document, verify_document

TIMESTAMP_FIELD = "ts"

__all__ = [
    "SIGNATURE_FIELD",
    "BoardKeys",
    "canonical",
    "check_enrollment_signature",
    "enrollment_key",
    "enrollment_public_key",
    "verify_signature",
]


def enrollment_key(token: str) -> Ed25519PrivateKey:
    """The key that signs an enrollment request: only the token gives it."""
    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"edgecache/enroll/v2").derive(token.encode())
    return Ed25519PrivateKey.from_private_bytes(seed)


def enrollment_public_key(token: str) -> str:
    """What the control plane keeps to check an enrollment (hex): it enrolls nobody by itself."""
    return enrollment_key(token).public_key().public_bytes_raw().hex()


def enrollment_redis_password(token: str) -> str:
    """The password of a device's enrollment Redis user (it may only read its own record and send
    its enrollment): derived from the token, so neither side stores it."""
    return (
        HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"edgecache/enroll-redis/v1")
        .derive(token.encode())
        .hex()
    )


def verify_signature(payload: dict, signing_public_key: str) -> bool:
    """True when ``payload`` (as received) carries a valid signature of the board with this public key (hex)."""
    return verify_document(payload, signing_public_key)


def password_sha256(password: str) -> str:
    """How a Redis ACL names a password without holding it (``#<sha256>``)."""
    return hashlib.sha256(password.encode()).hexdigest()


@dataclass(frozen=True)
class BoardKeys:
    """The private keys of one board (they never leave it), its Redis password, and the control
    plane's public key once pinned."""

    signing: Ed25519PrivateKey
    box: X25519PrivateKey
    redis_password: str = ""
    control_plane_key: str = ""  # hex Ed25519 public key, pinned at enrollment

    @classmethod
    def generate(cls) -> "BoardKeys":
        return cls(Ed25519PrivateKey.generate(), X25519PrivateKey.generate(), secrets.token_urlsafe(32))

    @property
    def signing_public_key(self) -> str:
        return self.signing.public_key().public_bytes_raw().hex()

    @property
    def box_public_key(self) -> str:
        return self.box.public_key().public_bytes_raw().hex()

    def sign(self, payload: dict) -> dict:
        """``payload`` with its send time and signature (the receiver checks both)."""
        return sign_document(self.signing, {**payload, TIMESTAMP_FIELD: time.time()})

    def trusts(self, doc: dict) -> bool:
        """True when ``doc`` carries the signature of the control plane this board pinned."""
        return bool(self.control_plane_key) and verify_document(doc, self.control_plane_key)

    def enrollment(self, device: str, token: str) -> dict:
        """An enrollment request: public keys, the Redis password's hash, a time, signed by the token's key."""
        fields = {
            "device": device,
            "signing_public_key": self.signing_public_key,
            "box_public_key": self.box_public_key,
            "redis_password_sha256": password_sha256(self.redis_password),
            "ts": time.time(),
        }
        signed = sign_document(enrollment_key(token), fields)
        return {**fields, "proof": signed[SIGNATURE_FIELD]}

    def pinned(self, control_plane_key: str) -> "BoardKeys":
        return replace(self, control_plane_key=control_plane_key)

    # -- the key file ------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "signing": self.signing.private_bytes_raw().hex(),
                "box": self.box.private_bytes_raw().hex(),
                "redis_password": self.redis_password,
                "control_plane_key": self.control_plane_key,
            }
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "BoardKeys":
        try:
            doc = json.loads(raw)
            return cls(
                Ed25519PrivateKey.from_private_bytes(bytes.fromhex(doc["signing"])),
                X25519PrivateKey.from_private_bytes(bytes.fromhex(doc["box"])),
                str(doc.get("redis_password") or "")
                or secrets.token_urlsafe(32),  # key files of older versions had none
                str(doc.get("control_plane_key") or ""),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"unreadable board key file: {exc}") from exc

    def save(self, path: Path) -> None:
        """Replace the key file with these keys, whole or not at all (mode 0600)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".board-key-")  # created 0600
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(self.to_bytes())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        except BaseException:
            os.unlink(temp)
            raise

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


def check_enrollment_signature(fields: dict, enroll_public_key: str) -> bool:
    """The enrollment's ``proof`` is the token key's signature over the other fields."""
    body = {key: value for key, value in fields.items() if key != "proof"}
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(enroll_public_key)).verify(
            base64.b64decode(str(fields.get("proof", "")), validate=True), canonical(body)
        )
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False

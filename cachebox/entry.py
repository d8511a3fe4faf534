"""One cache entry: the raw llama.cpp state bytes of one token range plus a small header.

Layout (no pickle): ``b"ECE2" | u32 header length | 32-byte MAC | header JSON | state bytes``.
The state bytes are stored raw or under a lossless codec named in the header
(``cachebox.codec``); the size and digest describe the stored bytes, so they are checked
before anything is decoded.
The header names the range ``[start, end)``, the digest of its tokens, the
state's byte count and SHA-256 digest, the creator and time, the signing key's
generation, and the top logits of the range's last position (so a full hit samples
its first token with no decode). The MAC (HMAC-SHA256 under the namespace's key,
see ``signing``) authenticates the header, and through its digest the state.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from blake3 import blake3

from . import codec as codecs
from .errors import EntryError
from .keys import STATE_FORMAT_VERSION
from .signing import MAC_BYTES, KeyRing

MAGIC = b"ECE2"
_PREFIX = struct.Struct("<4sI")
# Bytes fetched first to read a header without its state; headers are ~1 KB.
HEADER_PEEK_BYTES = 4096
MAX_HEADER_BYTES = 64 * 1024


# The state digest is BLAKE3 (a cryptographic hash, 256 bits): 8.5 MB in ~2.8 ms on one core
# of the development machine, against ~5.4 ms for SHA-256. Entries of one fetch are hashed
# on a small pool (the binding releases the GIL), each still checked before it is restored.
_hash_pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="edgecache-digest")


def state_checksum(state: bytes | memoryview) -> str:
    """BLAKE3 of the state bytes, hex (signed through the header's MAC)."""
    return blake3(state).hexdigest()


@dataclass
class EntryHeader:
    fingerprint: str
    namespace: str
    start: int
    end: int
    tokens_digest: str
    state_bytes: int
    checksum: str
    device: str = ""
    created: float = field(default_factory=time.time)
    top_ids: np.ndarray | None = None  # int32, best first
    top_logits: np.ndarray | None = None  # float32, same order
    version: int = STATE_FORMAT_VERSION
    key_generation: int = 0  # the signing key's generation (set by encode_entry)
    codec: str = codecs.RAW  # how the state is stored (``cachebox.codec``); state_bytes/checksum describe the stored bytes
    raw_bytes: int = 0  # the state's size once decoded (what llama.cpp reads); 0 for raw: state_bytes
    # As read: the MAC and the exact header bytes it covers.
    mac: bytes = b""
    signed_bytes: bytes = b""

    @property
    def token_count(self) -> int:
        return self.end - self.start

    @property
    def decoded_bytes(self) -> int:
        """The size of the llama.cpp state this entry holds, once decoded."""
        return self.raw_bytes if self.codec != codecs.RAW else self.state_bytes

    def to_json(self) -> bytes:
        doc = {
            "v": self.version,
            "fp": self.fingerprint,
            "ns": self.namespace,
            "start": self.start,
            "end": self.end,
            "tok": self.tokens_digest,
            "n": self.state_bytes,
            "sum": self.checksum,
            "dev": self.device,
            "t": round(self.created, 3),
            "kid": self.key_generation,
        }
        if self.codec != codecs.RAW:
            doc["codec"] = self.codec
            doc["raw"] = self.raw_bytes
        if self.top_ids is not None and self.top_logits is not None:
            doc["top_ids"] = base64.b64encode(np.asarray(self.top_ids, "<i4").tobytes()).decode()
            doc["top_logits"] = base64.b64encode(np.asarray(self.top_logits, "<f4").tobytes()).decode()
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "EntryHeader":
        try:
            doc = json.loads(raw)
            top_ids = top_logits = None
            if "top_ids" in doc:
                top_ids = np.frombuffer(base64.b64decode(doc["top_ids"], validate=True), "<i4")
                top_logits = np.frombuffer(base64.b64decode(doc["top_logits"], validate=True), "<f4")
                if top_ids.shape != top_logits.shape:
                    raise ValueError("top ids and logits differ in length")
            header = cls(
                fingerprint=str(doc["fp"]),
                namespace=str(doc["ns"]),
                start=int(doc["start"]),
                end=int(doc["end"]),
                tokens_digest=str(doc["tok"]),
                state_bytes=int(doc["n"]),
                checksum=str(doc["sum"]),
                device=str(doc.get("dev", "")),
                created=float(doc.get("t", 0.0)),
                top_ids=top_ids,
                top_logits=top_logits,
                version=int(doc["v"]),
                key_generation=int(doc.get("kid", 0)),
                codec=str(doc.get("codec", codecs.RAW)),
                raw_bytes=int(doc.get("raw", 0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise EntryError(f"entry header is malformed: {exc}") from exc
        if not 0 <= header.start < header.end or header.state_bytes < 0:
            raise EntryError(f"entry header has an impossible range [{header.start}, {header.end})")
        if header.codec != codecs.RAW and header.raw_bytes <= 0:
            raise EntryError(f"entry header stores its state as {header.codec!r} without its decoded size")
        return header


def encode_entry(header: EntryHeader, state: bytes, keyring: KeyRing) -> bytes:
    """Serialize and sign one entry. ``header.state_bytes``/``checksum`` must describe ``state``."""
    if header.state_bytes != len(state):
        raise ValueError("header.state_bytes does not match the state")
    if not keyring.covers(header.namespace):
        raise ValueError(f"key ring of {keyring.namespace!r} cannot sign entries of namespace {header.namespace!r}")
    header.key_generation = keyring.current
    raw = header.to_json()
    prefix = _PREFIX.pack(MAGIC, len(raw))
    _, mac = keyring.sign(prefix + raw)
    return prefix + mac + raw + state


def decode_header(prefix: bytes) -> tuple[EntryHeader, int] | int:
    """Parse the header from the first bytes of an entry (not yet authenticated: see verify_header).

    Returns ``(header, offset_of_state)``, or the number of bytes needed when
    ``prefix`` is too short to hold the whole header. Raises EntryError when the
    bytes are not an entry.
    """
    if len(prefix) < _PREFIX.size:
        raise EntryError("entry is truncated before its header")
    magic, header_len = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise EntryError("entry does not start with the EdgeCache magic bytes")
    if header_len > MAX_HEADER_BYTES:
        raise EntryError(f"entry header claims {header_len} bytes (limit {MAX_HEADER_BYTES})")
    offset = _PREFIX.size + MAC_BYTES + header_len
    if len(prefix) < offset:
        return offset
    raw = bytes(prefix[_PREFIX.size + MAC_BYTES : offset])
    header = EntryHeader.from_json(raw)
    header.mac = bytes(prefix[_PREFIX.size : _PREFIX.size + MAC_BYTES])
    header.signed_bytes = bytes(prefix[: _PREFIX.size]) + raw
    return header, offset


def verify_header(header: EntryHeader, keyring: KeyRing) -> None:
    """Raise EntryError unless the header was signed by a key of ``keyring`` (UnknownKey: newer key)."""
    if not keyring.covers(header.namespace):
        raise EntryError(f"entry of namespace {header.namespace!r} is outside this board's key ring")
    keyring.verify(header.key_generation, header.mac, header.signed_bytes)


def entry_size(header: EntryHeader, offset: int) -> int:
    """The whole entry's length in bytes, as its header describes it."""
    return offset + header.state_bytes


def open_entry(blob: bytes, keyring: KeyRing, max_state_bytes: int) -> tuple[EntryHeader, int]:
    """Parse and authenticate a whole entry: signature, size limit, then the state's digest.

    Returns ``(header, offset_of_state)``; the caller still checks that the header is
    the one it asked for (model, namespace, range, tokens). Raises EntryError.
    """
    parsed = decode_header(blob)
    if isinstance(parsed, int):
        raise EntryError("entry is truncated inside its header")
    header, offset = parsed
    verify_header(header, keyring)
    if max(header.state_bytes, header.decoded_bytes) > max_state_bytes:
        raise EntryError(f"entry holds {header.decoded_bytes} bytes, over the {max_state_bytes}-byte limit")
    verify_state(header, memoryview(blob)[offset:])  # a view: no copy of the megabytes
    return header, offset


def open_entries(blobs, keyring: KeyRing, max_state_bytes: int) -> list[tuple[EntryHeader, int] | EntryError]:
    """``open_entry`` for the entries of one fetch, their states hashed concurrently.

    One result per blob, in order: ``(header, offset)`` or the EntryError that refused it.
    """

    def one(blob):
        try:
            return open_entry(blob, keyring, max_state_bytes)
        except EntryError as exc:
            return exc

    blobs = list(blobs)
    return list(_hash_pool.map(one, blobs)) if len(blobs) > 1 else [one(blob) for blob in blobs]


def verify_state(header: EntryHeader, state: bytes) -> None:
    """Raise EntryError unless ``state`` has the length and digest the (verified) header promises."""
    if len(state) != header.state_bytes:
        raise EntryError(f"entry state is {len(state)} bytes, header says {header.state_bytes}")
    if state_checksum(state) != header.checksum:
        raise EntryError("entry state does not match its signed digest")


def decoded_state(header: EntryHeader, blob: bytes, offset: int) -> tuple[bytes, int]:
    """The llama.cpp state of a verified entry as ``(buffer, offset)``: the entry itself for a raw
    state (no copy), else the decoded bytes. Raises EntryError (UnknownCodec for a codec this
    board does not know)."""
    if header.codec == codecs.RAW:
        return blob, offset
    return codecs.decode(memoryview(blob)[offset:], header.codec, header.raw_bytes), 0

"""One cache entry: the raw llama.cpp state bytes of one token range plus a small header.

Layout (no pickle): ``b"ECE1" | u32 header length | header JSON | state bytes``.
The header names the range ``[start, end)``, the digest of its tokens, the
state's byte count and checksum, the creator and time, and the top logits of
the range's last position (so a full hit samples its first token with no decode).
"""

from __future__ import annotations

import base64
import json
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from .errors import EntryError
from .keys import STATE_FORMAT_VERSION

MAGIC = b"ECE1"
_PREFIX = struct.Struct("<4sI")
# Bytes fetched first to read a header without its state; headers are ~1 KB.
HEADER_PEEK_BYTES = 4096
MAX_HEADER_BYTES = 64 * 1024


def state_checksum(state: bytes | memoryview) -> str:
    """xxh3-64 of the state bytes: catches corruption at >10 GB/s, off the critical path's budget."""
    return xxhash.xxh3_64_hexdigest(state)


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

    @property
    def token_count(self) -> int:
        return self.end - self.start

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
        }
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
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise EntryError(f"entry header is malformed: {exc}") from exc
        if not 0 <= header.start < header.end or header.state_bytes < 0:
            raise EntryError(f"entry header has an impossible range [{header.start}, {header.end})")
        return header


def encode_entry(header: EntryHeader, state: bytes) -> bytes:
    """Serialize one entry. ``header.state_bytes``/``checksum`` must describe ``state``."""
    if header.state_bytes != len(state):
        raise ValueError("header.state_bytes does not match the state")
    raw = header.to_json()
    return _PREFIX.pack(MAGIC, len(raw)) + raw + state


def decode_header(prefix: bytes) -> tuple[EntryHeader, int] | int:
    """Parse the header from the first bytes of an entry.

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
    offset = _PREFIX.size + header_len
    if len(prefix) < offset:
        return offset
    return EntryHeader.from_json(prefix[_PREFIX.size:offset]), offset


def verify_state(header: EntryHeader, state: bytes) -> None:
    """Raise EntryError unless ``state`` has the length and checksum the header promises."""
    if len(state) != header.state_bytes:
        raise EntryError(f"entry state is {len(state)} bytes, header says {header.state_bytes}")
    if state_checksum(state) != header.checksum:
        raise EntryError("entry state fails its checksum")

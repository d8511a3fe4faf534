"""One cache entry: the llama.cpp state of one token range, sealed under its namespace's data key,
behind a small signed header.

Layout (no pickle): ``b"ECE4" | u32 header length | 32-byte MAC | 64-byte producer signature |
header JSON | sealed state``.

- The **header** names what a board needs before it downloads the state: model fingerprint,
  namespace, range ``[start, end)``, the stored size, codec and cipher, the key generation, and
  a sealed *private* part (the digest of the range's tokens, the creator, and the top logits of
  the range's last position, so a full hit samples its first token with no decode). The MAC
  (HMAC-SHA256 under the namespace's MAC key, ``signing.KeyRing``) authenticates the header, so a
  board refuses a forged or oversized entry before downloading it.
- The **producer signature** (Ed25519, the key the producing board enrolled) covers the same
  header bytes, whose sealed private part names the producer and holds the SHA-256 of the state:
  the ring lets any member of the namespace seal, but only the producer can sign. A reader checks
  it against the producer's key in its namespace's producer table (``signing.ProducerTable``,
  signed by the control plane) and refuses an entry whose producer is unknown, quarantined, or
  whose signature or state digest fails. A board that re-seals another prompt's state under a
  header must sign it as itself: the audit then names it (``inference.serving.audit``).
- The **state** is encrypted and authenticated (AES-256-GCM or ChaCha20-Poly1305, a key of its own
  per entry: ``signing.seal_data``) with the header bytes as associated data: it opens only under
  the namespace's key and only behind the header it was written with. A dump of the cache box
  shows ranges and sizes, never a tenant's state, tokens or logits.

The state is stored raw or under a lossless codec (``cachebox.codec``) before it is sealed:
decryption authenticates the bytes before the decompressor or llama.cpp sees one, and
decompression is bounded by the signed decoded size.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import codec as codecs
from .errors import EntryError
from .keys import STATE_FORMAT_VERSION
from .signing import (
    CIPHERS,
    DEFAULT_CIPHER,
    MAC_BYTES,
    PRODUCER_SIGNATURE_BYTES,
    SALT_BYTES,
    TAG_BYTES,
    KeyRing,
    UnknownProducer,
)

MAGIC = b"ECE4"  # 4: producer-signed (STATE_FORMAT_VERSION 5)
_PRODUCER_CONTEXT = b"edgecache/entry-producer/v1|"
_PREFIX = struct.Struct("<4sI")
# Bytes fetched first to read a header without its state; headers are ~1.5 KB.
HEADER_PEEK_BYTES = 4096
MAX_HEADER_BYTES = 64 * 1024
SEAL_OVERHEAD = SALT_BYTES + TAG_BYTES

# Entries of one fetch are opened on a small pool (decryption releases the GIL for large
# inputs), each still checked before it is restored.
_open_pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="edgecache-open")


@dataclass
class EntryHeader:
    fingerprint: str
    namespace: str
    start: int
    end: int
    tokens_digest: str
    state_bytes: int  # the stored (sealed) state's size: what the cache box holds and a fetch moves
    device: str = ""
    created: float = field(default_factory=time.time)
    top_ids: np.ndarray | None = None  # int32, best first
    top_logits: np.ndarray | None = None  # float32, same order
    version: int = STATE_FORMAT_VERSION
    key_generation: int = 0  # the namespace key's generation (set by encode_entry)
    codec: str = codecs.RAW  # how the state was encoded before sealing (``cachebox.codec``)
    raw_bytes: int = 0  # the state's size once decoded (what llama.cpp reads); 0 for raw
    cipher: str = DEFAULT_CIPHER
    producer: str = ""  # who made and signed it (a board's name; ``signing.CONTROL_PLANE_PRODUCER``)
    state_digest: str = ""  # SHA-256 (hex) of the encoded state, signed by the producer
    # As read: the MAC, the producer's signature, the exact header bytes they cover, and the private part still sealed.
    mac: bytes = b""
    producer_signature: bytes = b""
    signed_bytes: bytes = b""
    sealed_private: bytes = b""

    @property
    def token_count(self) -> int:
        return self.end - self.start

    @property
    def plain_bytes(self) -> int:
        """The encoded state's size once opened (the sealed size without salt and tag)."""
        return max(0, self.state_bytes - SEAL_OVERHEAD)

    @property
    def decoded_bytes(self) -> int:
        """The size of the llama.cpp state this entry holds, once opened and decoded."""
        return self.raw_bytes if self.codec != codecs.RAW else self.plain_bytes

    def private_aad(self) -> bytes:
        return f"edgecache/entry-private/v4|{self.fingerprint}|{self.namespace}|{self.start}|{self.end}|{self.key_generation}".encode()

    def private_json(self) -> bytes:
        doc: dict = {"tok": self.tokens_digest, "dev": self.device, "by": self.producer, "sd": self.state_digest}
        if self.top_ids is not None and self.top_logits is not None:
            doc["top_ids"] = base64.b64encode(np.asarray(self.top_ids, "<i4").tobytes()).decode()
            doc["top_logits"] = base64.b64encode(np.asarray(self.top_logits, "<f4").tobytes()).decode()
        return json.dumps(doc, separators=(",", ":")).encode()

    def to_json(self) -> bytes:
        doc = {
            "v": self.version,
            "fp": self.fingerprint,
            "ns": self.namespace,
            "start": self.start,
            "end": self.end,
            "n": self.state_bytes,
            "t": round(self.created, 3),
            "kid": self.key_generation,
            "cipher": self.cipher,
            "priv": base64.b64encode(self.sealed_private).decode(),
        }
        if self.codec != codecs.RAW:
            doc["codec"] = self.codec
            doc["raw"] = self.raw_bytes
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "EntryHeader":
        try:
            doc = json.loads(raw)
            header = cls(
                fingerprint=str(doc["fp"]),
                namespace=str(doc["ns"]),
                start=int(doc["start"]),
                end=int(doc["end"]),
                tokens_digest="",
                state_bytes=int(doc["n"]),
                created=float(doc.get("t", 0.0)),
                version=int(doc["v"]),
                key_generation=int(doc.get("kid", 0)),
                codec=str(doc.get("codec", codecs.RAW)),
                raw_bytes=int(doc.get("raw", 0)),
                cipher=str(doc.get("cipher", "")),
                sealed_private=base64.b64decode(str(doc.get("priv", "")), validate=True),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise EntryError(f"entry header is malformed: {exc}") from exc
        if not 0 <= header.start < header.end or header.state_bytes < SEAL_OVERHEAD:
            raise EntryError(
                f"entry header has an impossible range [{header.start}, {header.end}) or size {header.state_bytes}"
            )
        if header.codec != codecs.RAW and header.raw_bytes <= 0:
            raise EntryError(f"entry header stores its state as {header.codec!r} without its decoded size")
        if header.cipher not in CIPHERS:
            raise EntryError(f"entry is sealed with {header.cipher!r}, a cipher this board does not know")
        return header

    def open_private(self, keyring: KeyRing) -> None:
        """Fill the private fields (tokens digest, creator, producer, state digest, top logits) from the sealed part."""
        plain = keyring.open_data(self.key_generation, self.sealed_private, self.private_aad(), cipher=self.cipher)
        try:
            doc = json.loads(plain)
            self.tokens_digest = str(doc["tok"])
            self.device = str(doc.get("dev", ""))
            self.producer = str(doc["by"])
            self.state_digest = str(doc["sd"])
            if "top_ids" in doc:
                top_ids = np.frombuffer(base64.b64decode(doc["top_ids"], validate=True), "<i4")
                top_logits = np.frombuffer(base64.b64decode(doc["top_logits"], validate=True), "<f4")
                if top_ids.shape != top_logits.shape:
                    raise ValueError("top ids and logits differ in length")
                self.top_ids, self.top_logits = top_ids, top_logits
        except (ValueError, KeyError, TypeError) as exc:
            raise EntryError(f"entry header's private part is malformed: {exc}") from exc


def encode_entry(header: EntryHeader, encoded_state: bytes, keyring: KeyRing) -> bytes:
    """Seal and sign one entry; ``encoded_state`` is the state after ``header.codec``. Fills the
    header's generation, cipher, sealed private part and stored size."""
    if not keyring.covers(header.namespace):
        raise ValueError(f"key ring of {keyring.namespace!r} cannot sign entries of namespace {header.namespace!r}")
    if keyring.producer is None:
        raise ValueError(
            "entries are signed by their producer: this ring carries no producer key (KeyRing.with_producers)"
        )
    header.key_generation = keyring.current
    header.cipher = header.cipher or DEFAULT_CIPHER
    header.producer = keyring.producer.name
    header.state_digest = hashlib.sha256(encoded_state).hexdigest()
    _, header.sealed_private = keyring.seal_data(header.private_json(), header.private_aad(), cipher=header.cipher)
    header.state_bytes = len(encoded_state) + SEAL_OVERHEAD
    raw = header.to_json()
    prefix = _PREFIX.pack(MAGIC, len(raw))
    _, mac = keyring.sign(prefix + raw)
    head = prefix + mac + keyring.producer.sign(_PRODUCER_CONTEXT + prefix + raw) + raw
    entry = bytearray(len(head) + header.state_bytes)  # one buffer: the state is encrypted straight into it
    entry[: len(head)] = head
    keyring.seal_into(encoded_state, prefix + raw, memoryview(entry)[len(head) :], cipher=header.cipher)
    return bytes(entry)


def decode_header(prefix: bytes) -> tuple[EntryHeader, int] | int:
    """Parse the public header from the first bytes of an entry (not yet authenticated nor opened:
    see ``verify_header``).

    Returns ``(header, offset_of_state)``, or the number of bytes needed when ``prefix`` is too
    short to hold the whole header. Raises EntryError when the bytes are not an entry.
    """
    if len(prefix) < _PREFIX.size:
        raise EntryError("entry is truncated before its header")
    magic, header_len = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise EntryError("entry does not start with the EdgeCache magic bytes (or is of an older format)")
    if header_len > MAX_HEADER_BYTES:
        raise EntryError(f"entry header claims {header_len} bytes (limit {MAX_HEADER_BYTES})")
    raw_at = _PREFIX.size + MAC_BYTES + PRODUCER_SIGNATURE_BYTES
    offset = raw_at + header_len
    if len(prefix) < offset:
        return offset
    raw = bytes(prefix[raw_at:offset])
    header = EntryHeader.from_json(raw)
    header.mac = bytes(prefix[_PREFIX.size : _PREFIX.size + MAC_BYTES])
    header.producer_signature = bytes(prefix[_PREFIX.size + MAC_BYTES : raw_at])
    header.signed_bytes = bytes(prefix[: _PREFIX.size]) + raw
    return header, offset


def verify_header(header: EntryHeader, keyring: KeyRing) -> None:
    """Raise EntryError unless the header was signed by a key of ``keyring`` (UnknownKey: a newer
    key), then open its private part, and check its producer's signature against the ring's
    producer table (UnknownProducer: a producer the table does not list yet; QuarantinedProducer)."""
    if not keyring.covers(header.namespace):
        raise EntryError(f"entry of namespace {header.namespace!r} is outside this board's key ring")
    keyring.verify(header.key_generation, header.mac, header.signed_bytes)
    header.open_private(keyring)
    if keyring.producers is None or not keyring.producers.covers(header.namespace):
        raise UnknownProducer(
            f"this holder has no producer table of {header.namespace!r} yet: it cannot tell who made the entry"
        )
    if len(header.state_digest) != 64:
        raise EntryError("entry header carries no state digest")
    keyring.producers.verify(header.producer, header.producer_signature, _PRODUCER_CONTEXT + header.signed_bytes)


def entry_size(header: EntryHeader, offset: int) -> int:
    """The whole entry's length in bytes, as its header describes it."""
    return offset + header.state_bytes


def open_entry(blob: bytes, keyring: KeyRing, max_state_bytes: int) -> tuple[EntryHeader, bytes]:
    """Parse, authenticate and decrypt a whole entry: signature, size limits, then the sealed state.

    Returns ``(header, encoded_state)`` (the state as its codec stored it); the caller still
    checks that the header is the one it asked for (model, namespace, range, tokens). Raises
    EntryError.
    """
    parsed = decode_header(blob)
    if isinstance(parsed, int):
        raise EntryError("entry is truncated inside its header")
    header, offset = parsed
    verify_header(header, keyring)
    if max(header.plain_bytes, header.decoded_bytes) > max_state_bytes:
        raise EntryError(f"entry holds {header.decoded_bytes} bytes, over the {max_state_bytes}-byte limit")
    return header, open_state(header, memoryview(blob)[offset:], keyring)


def open_state(header: EntryHeader, sealed: bytes | memoryview, keyring: KeyRing) -> bytes:
    """The encoded state of a verified header from its sealed bytes (EntryError when they differ in
    length from the header's promise, or fail to authenticate)."""
    if len(sealed) != header.state_bytes:
        raise EntryError(f"entry state is {len(sealed)} bytes, header says {header.state_bytes}")
    encoded = keyring.open_data(header.key_generation, sealed, header.signed_bytes, cipher=header.cipher)
    if not hmac.compare_digest(hashlib.sha256(encoded).hexdigest(), header.state_digest):
        raise EntryError(
            f"entry state is not the one its producer {header.producer!r} signed: re-sealed by another holder of the ring"
        )
    return encoded


def open_entries(blobs, keyring: KeyRing, max_state_bytes: int) -> list[tuple[EntryHeader, bytes] | EntryError]:
    """``open_entry`` for the entries of one fetch, opened concurrently.

    One result per blob, in order: ``(header, encoded_state)`` or the EntryError that refused it.
    """

    def one(blob):
        try:
            return open_entry(blob, keyring, max_state_bytes)
        except EntryError as exc:
            return exc

    blobs = list(blobs)
    return list(_open_pool.map(one, blobs)) if len(blobs) > 1 else [one(blob) for blob in blobs]


def decoded_state(header: EntryHeader, encoded: bytes) -> bytes:
    """The llama.cpp state of an opened entry: ``encoded`` itself for a raw state (no copy), else
    the decoded bytes. Raises EntryError (UnknownCodec for a codec this board does not know)."""
    if header.codec == codecs.RAW:
        return encoded
    return codecs.decode(encoded, header.codec, header.raw_bytes)

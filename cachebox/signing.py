"""Keys and signatures: namespace key rings, the control plane's signing key, sealed delivery.

- **Namespace rings.** One root key per namespace (tenant) and generation, derived on the control
  plane from one master secret (``derive_keyring``). From each root key come a MAC key (entry
  headers: HMAC-SHA256) and a data key (entry states and tenant messages: AEAD, ``seal_data``);
  a namespace's entry *names* are keyed by a name key that does not rotate (so a rotation keeps
  the cache), so a dump of the cache box confirms no guessed prompt. Boards receive their
  namespace's ring sealed to their own X25519 key and never see other tenants' keys.
- **The control plane's key.** An Ed25519 key derived from the same master secret
  (``control_plane_key``). What a board must trust (registry records, key rings, run requests,
  cancel flags) carries its signature; a board pins its public key at enrollment (``pin_proof``:
  the token vouches for it) and refuses anything signed by anyone else.
- **Documents.** ``sign_document`` / ``verify_document``: an Ed25519 signature over the canonical
  JSON of a dict (boards sign their messages the same way with their own key).

Pure logic and standard primitives (hashlib, hmac; Ed25519, X25519, HKDF, AES-GCM and
ChaCha20-Poly1305 from ``cryptography``): no I/O, tested in milliseconds.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Mapping

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import EntryError

MAC_BYTES = 32
# Generations kept after a rotation: entries signed just before it stay usable.
KEEP_GENERATIONS = 2


class UnknownKey(EntryError):
    """Signed with a generation newer than this ring: the board should refresh its keys.

    Not a forgery by itself, so the entry is skipped (a miss) but not evicted.
    """


def _subkey(root: bytes, purpose: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=f"edgecache/{purpose}/v1".encode()).derive(root)


@dataclass(frozen=True)
class KeyRing:
    """The keys of one namespace: generation -> 32-byte root key, and the name key.

    Each root key gives a MAC key (``sign``/``verify``: entry headers) and a data key
    (``seal_data``/``open_data``: entry states and the tenant's messages). ``name_key`` keys the
    namespace's entry names (``cachebox.keys.prefix_keys``); it does not rotate.
    """

    namespace: str
    keys: dict[int, bytes]
    current: int
    # Namespaces whose entries this ring signs (a tenant's own and its boards' private ones).
    extra_namespaces: tuple[str, ...] = field(default=())
    name_key: bytes = b""
    # Who this holder signs its entries as, and whose entries it accepts (``ProducerTable``):
    # attached where the ring is used (``with_producers``), never part of what is sealed to a board.
    producer: "Producer | None" = field(default=None, compare=False)
    producers: "ProducerTable | None" = field(default=None, compare=False)

    def __post_init__(self):
        if self.current not in self.keys:
            raise ValueError(f"key ring for {self.namespace!r} lacks its current generation {self.current}")
        if any(len(key) < 16 for key in self.keys.values()):
            raise ValueError("signing keys must be at least 16 bytes")

    @cached_property
    def _mac_keys(self) -> dict[int, bytes]:
        return {gen: _subkey(key, "entry-mac") for gen, key in self.keys.items()}

    @cached_property
    def _data_keys(self) -> dict[int, bytes]:
        return {gen: _subkey(key, "data") for gen, key in self.keys.items()}

    def covers(self, namespace: str) -> bool:
        return namespace == self.namespace or namespace in self.extra_namespaces

    def sign(self, message: bytes) -> tuple[int, bytes]:
        """(generation, MAC) of ``message`` under the current key."""
        return self.current, hmac.new(self._mac_keys[self.current], message, hashlib.sha256).digest()

    def verify(self, generation: int, mac: bytes, message: bytes) -> None:
        """Raise EntryError unless ``mac`` authenticates ``message`` under ``generation``."""
        key = self._mac_keys.get(self._known(generation))
        expected = hmac.new(key, message, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, mac):
            raise EntryError("entry signature does not match: forged or altered")

    def _known(self, generation: int) -> int:
        if generation not in self.keys:
            if generation > self.current:
                raise UnknownKey(f"signed with key generation {generation}, newer than this holder's {self.current}")
            raise EntryError(f"signed with key generation {generation}, which was retired")
        return generation

    def data_key(self, generation: int) -> bytes:
        """The data key of ``generation`` (UnknownKey / EntryError when this ring lacks it)."""
        return self._data_keys[self._known(generation)]

    def seal_data(self, plaintext: bytes | memoryview, aad: bytes, *, cipher: str = "") -> tuple[int, bytes]:
        """``(generation, sealed)``: ``plaintext`` encrypted and authenticated under the current data key."""
        return self.current, seal_data(self._data_keys[self.current], plaintext, aad, cipher=cipher or DEFAULT_CIPHER)

    def seal_into(self, plaintext: bytes | memoryview, aad: bytes, out: memoryview, *, cipher: str = "") -> int:
        """``seal_data`` into ``out``; returns the generation it was sealed under."""
        seal_into(self._data_keys[self.current], plaintext, aad, out, cipher=cipher or DEFAULT_CIPHER)
        return self.current

    def open_data(self, generation: int, sealed: bytes | memoryview, aad: bytes, *, cipher: str = "") -> bytes:
        """The plaintext of ``seal_data``'s output; EntryError when it was altered or is not ours."""
        return open_data(self.data_key(generation), sealed, aad, cipher=cipher or DEFAULT_CIPHER)

    def with_producers(self, producer: "Producer | None", producers: "ProducerTable | None") -> "KeyRing":
        """This ring, signing entries as ``producer`` and accepting those of ``producers``' members."""
        return replace(self, producer=producer, producers=producers)

    def to_dict(self) -> dict:
        return {
            "ns": self.namespace,
            "current": self.current,
            "keys": {str(gen): key.hex() for gen, key in self.keys.items()},
            "extra": list(self.extra_namespaces),
            "names": self.name_key.hex(),
        }

    @classmethod
    def from_dict(cls, doc: dict) -> "KeyRing":
        try:
            return cls(
                namespace=str(doc["ns"]),
                keys={int(gen): bytes.fromhex(key) for gen, key in doc["keys"].items()},
                current=int(doc["current"]),
                extra_namespaces=tuple(str(ns) for ns in doc.get("extra", ())),
                name_key=bytes.fromhex(str(doc.get("names", ""))),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed key ring: {exc}") from exc


# -- producers: who made an entry ---------------------------------------------------------------
# Every entry is signed by the board that made it with its own Ed25519 key (the one it enrolled).
# A reader checks that signature against the producer's public key from its namespace's producer
# table, which the control plane signs and publishes (``ec:producers:TENANT``, read-only to
# boards). A board that holds its namespace's ring can still seal anything, but only under its
# own name: what it stores names it, an audit that catches it names it, and the control plane
# then quarantines its entries (readers refuse them).
CONTROL_PLANE_PRODUCER = (
    "@control-plane"  # commands run next to the control plane (``infer``, ``bench``); '@' is in no device name
)
PRODUCER_SIGNATURE_BYTES = 64


class UnknownProducer(UnknownKey):
    """Signed by a producer this holder's table does not list (yet): a miss, and a refresh of the table."""


class QuarantinedProducer(EntryError):
    """Made by a producer the control plane quarantined (revoked, or caught by an audit): refused and evicted."""


@dataclass(frozen=True)
class Producer:
    """Who signs the entries this holder stores: a name and its Ed25519 private key."""

    name: str
    key: Ed25519PrivateKey = field(repr=False)

    @classmethod
    def control_plane(cls, master: bytes) -> "Producer":
        return cls(CONTROL_PLANE_PRODUCER, control_plane_key(master))

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)


@dataclass(frozen=True)
class ProducerTable:
    """A tenant's entry producers: board name -> Ed25519 public key (hex), and the producers whose
    entries are quarantined (name -> reason). Signed by the control plane (``sign``/``verified``);
    its serial only grows, so a reader refuses an older table (a replayed one would lift a quarantine)."""

    namespace: str
    producers: Mapping[str, str] = field(default_factory=dict)
    quarantined: Mapping[str, str] = field(default_factory=dict)
    control_plane_key: str = ""  # also a producer (CONTROL_PLANE_PRODUCER)
    serial: int = 0

    def covers(self, namespace: str) -> bool:
        return tenant_of(namespace) == self.namespace

    def public_key(self, name: str) -> str:
        """The public key entries of ``name`` are checked with; QuarantinedProducer or UnknownProducer."""
        if name in self.quarantined:
            raise QuarantinedProducer(
                f"entry made by {name!r}, whose entries are quarantined: {self.quarantined[name]}"
            )
        key = self.control_plane_key if name == CONTROL_PLANE_PRODUCER else self.producers.get(name, "")
        if not key:
            raise UnknownProducer(
                f"entry made by {name!r}, a producer this board's table of {self.namespace!r} does not list"
            )
        return key

    def verify(self, name: str, signature: bytes, message: bytes) -> None:
        """Raise EntryError unless ``name``'s key signed ``message`` (QuarantinedProducer / UnknownProducer first)."""
        key = self.public_key(name)
        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(key)).verify(signature, message)
        except (InvalidSignature, ValueError) as exc:
            raise EntryError(
                f"entry's producer signature does not match {name!r}'s key: forged, altered, or re-sealed by another board"
            ) from exc

    def to_document(self) -> dict:
        return {
            "ns": self.namespace,
            "producers": dict(sorted(self.producers.items())),
            "quarantined": dict(sorted(self.quarantined.items())),
            "control_plane_key": self.control_plane_key,
            "serial": self.serial,
        }

    def signed(self, signer: Ed25519PrivateKey) -> dict:
        return sign_document(signer, {**self.to_document(), "control_plane_key": public_hex(signer)})

    @classmethod
    def verified(cls, doc, control_plane_public_key: str, namespace: str, *, newer_than: int = 0) -> "ProducerTable":
        """The table in ``doc`` if the pinned control plane signed it for ``namespace`` and it is not
        older than ``newer_than``; ValueError (saying which) otherwise."""
        if not isinstance(doc, dict) or not verify_document(doc, control_plane_public_key):
            raise ValueError(
                f"the producer table of {namespace!r} is not signed by the control plane this board pinned"
            )
        try:
            table = cls(
                namespace=str(doc["ns"]),
                producers={str(k): str(v) for k, v in dict(doc["producers"]).items()},
                quarantined={str(k): str(v) for k, v in dict(doc["quarantined"]).items()},
                control_plane_key=str(doc["control_plane_key"]),
                serial=int(doc["serial"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed producer table: {exc}") from exc
        if table.namespace != namespace:
            raise ValueError(f"the producer table is of {table.namespace!r}, not {namespace!r}")
        if table.serial < newer_than:
            raise ValueError(
                f"the producer table of {namespace!r} is older than the one accepted before (serial {table.serial} < {newer_than}): a replay"
            )
        return table


def control_plane_ring(
    ring: KeyRing,
    master: bytes,
    producers: Mapping[str, str] | None = None,
    quarantined: Mapping[str, str] | None = None,
) -> KeyRing:
    """``ring`` as a holder of the master secret uses it: signing entries as the control plane,
    accepting the control plane's and ``producers``' (a table it does not need to read)."""
    producer = Producer.control_plane(master)
    table = ProducerTable(
        tenant_of(ring.namespace),
        dict(producers or {}),
        dict(quarantined or {}),
        public_hex(producer.key),
        time.time_ns(),
    )
    return ring.with_producers(producer, table)


def shared_producer_ring(ring: KeyRing) -> KeyRing:
    """``ring`` for boards that run without a control plane (benches, their child processes): every
    holder of this ring signs as, and accepts, one producer key derived from it. Not for serving:
    it makes the ring's holders indistinguishable, which is what producer signatures are for."""
    seed = hmac.new(ring.name_key or ring.keys[ring.current], b"edgecache/shared-producer/v1", hashlib.sha256).digest()
    producer = Producer(CONTROL_PLANE_PRODUCER, Ed25519PrivateKey.from_private_bytes(seed))
    return ring.with_producers(producer, ProducerTable(tenant_of(ring.namespace), {}, {}, public_hex(producer.key), 0))


def derive_key(master: bytes, namespace: str, generation: int) -> bytes:
    """The root key of ``namespace`` at ``generation`` (HMAC-SHA256 as a KDF)."""
    if generation < 1:
        raise ValueError("key generations start at 1")
    return hmac.new(master, f"edgecache/entry-key/v1/{namespace}/{generation}".encode(), hashlib.sha256).digest()


def derive_name_key(master: bytes, namespace: str) -> bytes:
    """The key of ``namespace``'s entry names: the same for every generation (a rotation keeps the
    cache), unknown to anyone outside the namespace (a dump's key names confirm no guess)."""
    return hmac.new(master, f"edgecache/entry-names/v1/{namespace}".encode(), hashlib.sha256).digest()


def derive_keyring(master: bytes, namespace: str, generation: int, extra_namespaces=()) -> KeyRing:
    """The ring a board of ``namespace`` holds: the current key and the one before it."""
    if len(master) < 16:
        raise ValueError("the signing master secret must be at least 16 bytes")
    first = max(1, generation - KEEP_GENERATIONS + 1)
    keys = {gen: derive_key(master, namespace, gen) for gen in range(first, generation + 1)}
    return KeyRing(namespace, keys, generation, tuple(extra_namespaces), derive_name_key(master, namespace))


# -- authenticated encryption of states and messages ------------------------------------------------
# Every sealed item gets a key of its own: HKDF(data key, a random 16-byte salt), with a zero nonce.
# No nonce is ever reused however many items a key seals (random 96-bit nonces would wear out at a
# few billion items), and the salt travels in front of the ciphertext.
AES_GCM = "aes-256-gcm"  # fast where the CPU has AES instructions (x86, Pi 5)
CHACHA20 = "chacha20-poly1305"  # fast without them (a Pi Zero 2W's Cortex-A53 has none)
CIPHERS = {AES_GCM: AESGCM, CHACHA20: ChaCha20Poly1305}
DEFAULT_CIPHER = os.environ.get("EDGECACHE_CIPHER", "").strip() or AES_GCM
SALT_BYTES = 16
TAG_BYTES = 16
_ZERO_NONCE = bytes(12)


def _item_key(data_key: bytes, salt: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=b"edgecache/item/v1").derive(data_key)


def seal_data(data_key: bytes, plaintext: bytes | memoryview, aad: bytes, *, cipher: str = AES_GCM) -> bytes:
    """``salt | ciphertext | tag`` of ``plaintext`` bound to ``aad``."""
    out = bytearray(SALT_BYTES + len(plaintext) + TAG_BYTES)
    seal_into(data_key, plaintext, aad, memoryview(out), cipher=cipher)
    return bytes(out)


def seal_into(
    data_key: bytes, plaintext: bytes | memoryview, aad: bytes, out: memoryview, *, cipher: str = AES_GCM
) -> None:
    """``seal_data`` written into ``out`` (exactly ``SALT_BYTES + len(plaintext) + TAG_BYTES`` long):
    no copy of the megabytes besides the ciphertext itself."""
    if cipher not in CIPHERS:
        raise ValueError(f"unknown cipher {cipher!r} (known: {', '.join(CIPHERS)})")
    salt = os.urandom(SALT_BYTES)
    out[:SALT_BYTES] = salt
    CIPHERS[cipher](_item_key(data_key, salt)).encrypt_into(_ZERO_NONCE, plaintext, aad, out[SALT_BYTES:])


def open_data(data_key: bytes, sealed: bytes | memoryview, aad: bytes, *, cipher: str = AES_GCM) -> bytes:
    """The plaintext of ``seal_data``'s output; EntryError when it was altered, cut, or sealed under
    another key or ``aad``."""
    if cipher not in CIPHERS:
        raise EntryError(f"sealed with a cipher this holder does not know ({cipher!r})")
    if len(sealed) < SALT_BYTES + TAG_BYTES:
        raise EntryError("sealed data is truncated")
    view = memoryview(sealed)
    try:
        return CIPHERS[cipher](_item_key(data_key, bytes(view[:SALT_BYTES]))).decrypt(
            _ZERO_NONCE, view[SALT_BYTES:], aad
        )
    except InvalidTag:
        raise EntryError(
            "sealed data does not authenticate: altered, or not sealed with this namespace's key"
        ) from None


# -- signed documents (the control plane's and the boards' Ed25519 keys) -----------------------------
SIGNATURE_FIELD = "signature"


def canonical(doc: dict) -> bytes:
    """The bytes a signature covers: the document without its signature, keys sorted, compact."""
    body = {key: value for key, value in doc.items() if key != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sign_document(key: Ed25519PrivateKey, doc: dict) -> dict:
    """``doc`` with its Ed25519 signature (``signature``, base64) over ``canonical(doc)``."""
    signed = {key_: value for key_, value in doc.items() if key_ != SIGNATURE_FIELD}
    signed[SIGNATURE_FIELD] = base64.b64encode(key.sign(canonical(signed))).decode()
    return signed


def verify_document(doc: dict, public_key_hex: str) -> bool:
    """True when ``doc`` carries a valid signature of the holder of this Ed25519 public key (hex)."""
    try:
        signature = base64.b64decode(str(doc.get(SIGNATURE_FIELD, "")), validate=True)
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex)).verify(signature, canonical(doc))
        return True
    except (InvalidSignature, ValueError, TypeError, AttributeError):
        return False


def public_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes_raw().hex()


def control_plane_key(master: bytes) -> Ed25519PrivateKey:
    """The control plane's Ed25519 key, derived from the master secret (every control-plane process
    derives the same one; no file of its own to lose or copy)."""
    if len(master) < 16:
        raise ValueError("the signing master secret must be at least 16 bytes")
    return Ed25519PrivateKey.from_private_bytes(
        hmac.new(master, b"edgecache/control-plane-signing/v1", hashlib.sha256).digest()
    )


def pin_proof(token: str, control_plane_public_key: str) -> str:
    """What lets a board that holds the device's token trust the control plane's public key once:
    a MAC under a key only the token gives. It reveals neither the token nor any key."""
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"edgecache/pin/v1").derive(token.encode())
    return hmac.new(key, control_plane_public_key.encode(), hashlib.sha256).hexdigest()


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
# A ring reaches a board signed by the control plane, then sealed to the board's own X25519
# public key (an ephemeral-static Diffie-Hellman, HKDF-SHA256, AES-256-GCM bound to the device
# name): sign then encrypt. Only the board, which keeps the private key and never sends it, can
# open it, and it accepts only a ring the control plane signed for it: anyone can seal to a
# public key, nobody else can sign. A Redis dump (sealed rings, public keys) or a database dump
# (public keys) alone opens no ring.

_SEAL_INFO = b"edgecache/keyring-seal/v3"


def _seal_key(shared: bytes, device: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SEAL_INFO + b"/" + device.encode()).derive(
        shared
    )


def seal(ring: KeyRing, box_public_key: bytes, device: str, signer: Ed25519PrivateKey) -> str:
    """The ring, signed by ``signer`` (the control plane) for ``device``, encrypted for the board's
    X25519 public key (32 bytes) and bound to its name."""
    signed = sign_document(signer, {"device": device, "ring": ring.to_dict()})
    ephemeral = X25519PrivateKey.generate()
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(box_public_key))
    nonce = os.urandom(12)
    sealed = AESGCM(_seal_key(shared, device)).encrypt(nonce, json.dumps(signed).encode(), device.encode())
    return base64.b64encode(ephemeral.public_key().public_bytes_raw() + nonce + sealed).decode()


def unseal(sealed: str, box_private_key: X25519PrivateKey, device: str, control_plane_public_key: str) -> KeyRing:
    """Open a ring sealed for ``device`` and signed by the control plane; ValueError when the key or
    the blob is wrong, or the ring inside was not signed by the control plane for this device."""
    try:
        raw = base64.b64decode(sealed, validate=True)
        if len(raw) < 32 + 12 + 16:
            raise ValueError("too short")
        shared = box_private_key.exchange(X25519PublicKey.from_public_bytes(raw[:32]))
        doc = json.loads(AESGCM(_seal_key(shared, device)).decrypt(raw[32:44], raw[44:], device.encode()))
    except (InvalidTag, ValueError, TypeError) as exc:
        raise ValueError(
            f"cannot open the key ring for device {device!r}: {exc or 'not sealed for this board'}"
        ) from exc
    if not isinstance(doc, dict) or doc.get("device") != device or not verify_document(doc, control_plane_public_key):
        raise ValueError(
            f"the key ring for device {device!r} is not signed by the control plane this board pinned: refused"
        )
    return KeyRing.from_dict(doc.get("ring"))


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

"""The Bloom catalog: "does the cache box probably hold this key?" without the network.

Pure: an ``rbloom.Bloom`` plus counters. Keys are already 16-byte BLAKE2b digests,
so the filter's hash is just their integer value: stable across processes, which
is what lets a filter be serialized and shipped between boards.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from dataclasses import asdict, dataclass

from rbloom import Bloom

from .errors import CatalogFormatError
from .keys import KEY_BYTES

DEFAULT_CAPACITY = 1_000_000
DEFAULT_FP_RATE = 0.01
_MAGIC = b"ECB1"
# Bounds on what serialized bytes may declare (1e8 entries at 1e-6 is ~360 MB of filter).
MAX_CAPACITY = 100_000_000
MIN_FP_RATE = 1e-6
MAX_PARAMS_BYTES = 1024
_PREFIX = struct.Struct("<4sI")


def expected_filter_bytes(capacity: int, fp_rate: float) -> int:
    """Size of an optimal Bloom filter for ``capacity`` keys at ``fp_rate`` (what rbloom allocates)."""
    return math.ceil(-capacity * math.log(fp_rate) / (math.log(2) ** 2) / 8)


def max_snapshot_bytes(capacity: int, fp_rate: float) -> int:
    """The most bytes a serialized catalog of ``capacity`` keys at ``fp_rate`` takes (what
    ``from_bytes`` accepts for it): a reader checks a snapshot's size against this before it fetches
    or loads it, so a planted one of another (larger) size costs it nothing."""
    return _PREFIX.size + MAX_PARAMS_BYTES + math.ceil(expected_filter_bytes(capacity, fp_rate) * 1.1) + 64


def key_hash(key: bytes) -> int:
    """rbloom hash: the key digest itself as a signed 128-bit integer (stable, serializable)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"catalog keys are {KEY_BYTES}-byte digests, got {len(key)} bytes")
    return int.from_bytes(key, "little", signed=True)


@dataclass
class CatalogStats:
    """What the filter was asked and what came of its answers. They add up: ``lookups`` = the
    certain "no"s + ``maybe_hits``, and every "maybe" is settled once, as one of the five below
    (``maybe_hits`` = ``true_hits`` + ``false_positives`` + ``held_on_board`` + ``policy_skipped``
    + ``cachebox_down``; for a moment more while a run is between its lookup and its asking)."""

    lookups: int = 0  # keys asked about
    maybe_hits: int = 0  # keys the filter said "maybe" to (the others: a certain "no")
    true_hits: int = 0  # maybes the cache box held when asked
    false_positives: int = 0  # maybes the cache box did not hold when asked
    held_on_board: int = 0  # maybes never asked about: the board's own context, RAM or flash tier held those ranges
    policy_skipped: int = 0  # maybes never asked about: the break-even policy forecast computing them faster
    cachebox_down: int = 0  # maybes never asked about: the cache box did not answer

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


NOT_ASKED = ("held_on_board", "policy_skipped", "cachebox_down")  # why a "maybe" was never asked about


class Catalog:
    """A board's local Bloom filter over cache-box keys, with lookup statistics."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, fp_rate: float = DEFAULT_FP_RATE):
        if capacity < 1 or not 0.0 < fp_rate < 1.0:
            raise ValueError("catalog capacity must be >= 1 and false-positive rate in (0, 1)")
        self.capacity = capacity
        self.fp_rate = fp_rate
        self.stats = CatalogStats()
        self._bloom = Bloom(capacity, fp_rate, key_hash)
        self._lock = threading.Lock()

    # -- membership -------------------------------------------------------------
    def add(self, key: bytes) -> None:
        with self._lock:
            self._bloom.add(key)

    def add_many(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._bloom.add(key)

    def lookup(self, keys: list[bytes]) -> list[bool]:
        """ "Maybe" for each key (counted); a "no" is certain."""
        with self._lock:
            answers = [key in self._bloom for key in keys]
        self.stats.lookups += len(keys)
        self.stats.maybe_hits += sum(answers)
        return answers

    def __contains__(self, key: bytes) -> bool:
        return key in self._bloom

    def record_true_hit(self, count: int = 1) -> None:
        self.stats.true_hits += count

    def record_false_positive(self, count: int = 1) -> None:
        self.stats.false_positives += count

    def record_not_asked(self, count: int, why: str) -> None:
        """``count`` "maybe"s the cache box was never asked about, for ``why`` (one of ``NOT_ASKED``)."""
        if why not in NOT_ASKED:
            raise ValueError(f"a maybe is not asked about for one of {NOT_ASKED}, not {why!r}")
        setattr(self.stats, why, getattr(self.stats, why) + count)

    def clear(self) -> None:
        with self._lock:
            self._bloom = Bloom(self.capacity, self.fp_rate, key_hash)

    def replace_with(self, other: "Catalog") -> None:
        """Take ``other``'s contents (after a resync) but keep this catalog's counters."""
        if (other.capacity, other.fp_rate) != (self.capacity, self.fp_rate):
            raise CatalogFormatError("catalogs of different sizes cannot replace each other")
        with self._lock:
            self._bloom = other._bloom.copy()

    def merge(self, other: "Catalog") -> None:
        """Union with another catalog of the same size (what a master copy does)."""
        if (other.capacity, other.fp_rate) != (self.capacity, self.fp_rate):
            raise CatalogFormatError("catalogs of different sizes cannot be merged")
        with self._lock:
            self._bloom |= other._bloom

    # -- estimates ----------------------------------------------------------------
    @property
    def size_bits(self) -> int:
        return self._bloom.size_in_bits

    @property
    def approx_items(self) -> float:
        return float(self._bloom.approx_items)

    @property
    def hash_count(self) -> int:
        # The optimal k for the configured size, which is what rbloom uses.
        return max(1, round(self.size_bits / self.capacity * math.log(2)))

    def fill_ratio(self) -> float:
        """Estimated fraction of bits set."""
        return 1.0 - math.exp(-self.hash_count * self.approx_items / self.size_bits)

    def estimated_fp_rate(self) -> float:
        """False-positive rate expected for a key that is not in the filter, at today's fill."""
        return self.fill_ratio() ** self.hash_count

    # -- serialization ----------------------------------------------------------
    def to_bytes(self) -> bytes:
        params = json.dumps({"capacity": self.capacity, "fp_rate": self.fp_rate}).encode()
        with self._lock:
            body = self._bloom.save_bytes()
        return _PREFIX.pack(_MAGIC, len(params)) + params + body

    @classmethod
    def from_bytes(cls, raw: bytes, *, expect: tuple[int, float] | None = None) -> "Catalog":
        """The catalog ``raw`` holds; CatalogFormatError before anything is allocated when it is
        malformed, or (``expect``: ``(capacity, fp_rate)``) made for other parameters."""
        try:
            magic, params_len = _PREFIX.unpack_from(raw)
            if magic != _MAGIC:
                raise ValueError("wrong magic bytes")
            if params_len > MAX_PARAMS_BYTES:
                raise ValueError(f"parameters claim {params_len} bytes")
            params = json.loads(raw[_PREFIX.size : _PREFIX.size + params_len])
            capacity, fp_rate = int(params["capacity"]), float(params["fp_rate"])
            if expect is not None and (capacity, fp_rate) != expect:
                raise ValueError(
                    f"made for {capacity} keys at rate {fp_rate}, not this catalog's {expect[0]} at {expect[1]}"
                )
            body = raw[_PREFIX.size + params_len :]
            # Sizes are checked against limits and against the bytes really there before
            # anything is allocated: a snapshot claiming 1e11 entries must not abort a process.
            if not 1 <= capacity <= MAX_CAPACITY or not MIN_FP_RATE <= fp_rate < 1.0:
                raise ValueError(
                    f"capacity {capacity} or false-positive rate {fp_rate} out of bounds (at most {MAX_CAPACITY} entries, rate >= {MIN_FP_RATE})"
                )
            expected = expected_filter_bytes(capacity, fp_rate)
            if not expected * 0.9 - 64 <= len(body) <= expected * 1.1 + 64:
                raise ValueError(f"{len(body)} filter bytes for a filter of about {expected}")
            catalog = cls(capacity, fp_rate)
            bloom = Bloom.load_bytes(body, key_hash)
        except Exception as exc:  # struct.error, ValueError, KeyError, rbloom's own errors
            raise CatalogFormatError(f"catalog bytes cannot be loaded: {exc}") from exc
        if bloom.size_in_bits != catalog.size_bits:
            raise CatalogFormatError("catalog bytes do not match their declared size")
        catalog._bloom = bloom
        return catalog

"""The one cache-entry exchange every serving strategy goes through.

Catalog lookup, header reads, chain planning, the download budget, fetch, verification,
rejection and eviction of bad entries, entries signed with a key this board has not
seen yet, restore into the engine, sealing, upload and announcement: implemented once
here. Prefix serving (``inference.serving.prefix``) and schema serving
(``inference.serving.schema``) are thin strategies over it: they say which entries
they want (``EntryRef``) and what a right entry holds (an ``expect`` check), and the
exchange does the rest with the same checks for both.

Nothing of an entry reaches llama.cpp before its signature, size, state digest, model,
namespace, range and tokens were checked. A cache box that is down or answers with an
error is recorded on the run's breakdown, never raised: the run answers by local work.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from cachebox import codec as codecs
from cachebox.catalog import Catalog
from cachebox.codec import UnknownCodec
from cachebox.entry import (
    HEADER_PEEK_BYTES,
    EntryHeader,
    decode_header,
    decoded_state,
    encode_entry,
    entry_size,
    open_entries,
    verify_header,
)
from cachebox.errors import CacheBoxOverQuota, CacheBoxUnavailable, EntryError
from cachebox.events import security_event
from cachebox.keys import entry_key_name, module_key, module_key_name, prefix_keys
from cachebox.signing import Keychain, KeyRing, UnknownKey
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry
from inference.contract.messages import StoredEntry
from inference.engine.llama import Engine, EngineError
from inference.engine.sampling import TOP_CANDIDATES, top_candidates
from inference.serving.breakdown import Breakdown, CacheBoxState, Decision
from inference.serving.run import ms_since

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EntryRef:
    """One entry a run may read or write: its range, its key and its Redis name, computed once.

    For a prefix range, ``key`` pins every token before ``end`` and ``start`` is the previous
    cut of this run (where a range this run stores begins); for a schema module, the range is
    the module's schema positions and ``piece`` its path.
    """

    start: int
    end: int
    key: bytes
    name: str
    piece: str = ""


def prefix_refs(
    namespace: str,
    fingerprint: str,
    tokens: Sequence[int],
    boundaries: Sequence[int],
    *,
    grid: int,
    extra: Sequence[int] = (),
) -> list[EntryRef]:
    """The prefix ranges of ``tokens`` cut at ``boundaries`` (ascending), as LMCache's token
    database yields them; ``extra``: the prompt's cuts off the grid (they enter the keys)."""
    keys = prefix_keys(namespace, fingerprint, tokens, boundaries, grid=grid, extra=extra)
    starts = [0, *boundaries[:-1]]
    return [
        EntryRef(start, end, key, entry_key_name(namespace, fingerprint, key))
        for start, end, key in zip(starts, boundaries, keys)
    ]


def module_ref(namespace: str, fingerprint: str, schema_digest: str, piece: str, start: int, end: int) -> EntryRef:
    """The entry of one prompt module (or scaffold) at its schema positions ``[start, end)``."""
    key = module_key(namespace, fingerprint, schema_digest, piece)
    return EntryRef(start, end, key, module_key_name(namespace, fingerprint, schema_digest, key), piece)


@dataclass
class Fetched:
    """An entry read, verified and opened: ``blob`` as stored (sealed), ``state[state_offset:]``
    what llama.cpp reads (decrypted, and decoded when a codec stored it)."""

    ref: EntryRef
    header: EntryHeader
    blob: bytes
    offset: int
    state: bytes = b""
    state_offset: int = 0
    source: str = ""  # the board tier it was read from ("": the cache box)


class OverLimit(EntryError):
    """A valid entry larger than this board accepts: skipped here (a miss), not evicted for every board."""


Expect = Callable[[EntryRef, EntryHeader], None]  # raises EntryError when the entry is not the one asked for


def plan_chain(
    headers: dict[int, EntryHeader], read_link: Callable[[int], EntryHeader | None], floor: int = 0
) -> list[int]:
    """Range ends from ``floor`` (what the board already holds) to the longest prefix whose whole
    chain exists.

    ``headers`` maps range ends to verified headers; ``read_link(end)`` reads a link that
    a prompt cut differently stored (None when absent or refused). Pure apart from it.
    """
    for longest in sorted(headers, reverse=True):
        if longest <= floor:
            break
        chain = [longest]
        while headers[chain[-1]].start > floor:
            start = headers[chain[-1]].start
            if start not in headers:
                link = read_link(start)
                if link is None:
                    break
                headers[start] = link
            chain.append(start)
        if headers[chain[-1]].start == floor:
            return chain[::-1]
    return []


class Exchange:
    """The cache box, the catalogs and the signing keys of one board, as every strategy uses them."""

    def __init__(
        self,
        store: CacheBox | None,
        catalogs: CatalogRegistry | None,
        *,
        fingerprint: str,
        device: str = "",
        keys: Keychain | None = None,
        max_entry_bytes: int = 64 * 1024 * 1024,
        max_fetch_bytes: int = 256 * 1024 * 1024,
        entry_ttl: int | None = None,
        codec: str = codecs.RAW,
    ):
        if codec not in codecs.CODECS:
            raise ValueError(f"unknown state codec {codec!r}; choose one of {', '.join(codecs.CODECS)}")
        self.codec = codec  # how this board stores the states it uploads
        self.store = store
        self.catalogs = catalogs
        self.fingerprint = fingerprint
        self.device = device
        self.keys = keys
        self.max_entry_bytes = max_entry_bytes
        self.max_fetch_bytes = max_fetch_bytes  # per request, all entries together
        self.entry_ttl = entry_ttl

    @property
    def connected(self) -> bool:
        return self.store is not None and self.catalogs is not None

    def reading_as(self, fingerprint: str) -> "Exchange":
        """This exchange, looking up the entries of another configuration of its model (computed by
        other kernels: approximate sharing across kernel classes). Its runs upload nothing."""
        other = copy.copy(self)
        other.fingerprint = fingerprint
        return other

    @property
    def link_label(self) -> str:
        return self.store.link_label if self.store is not None else ""

    def session(self, namespace: str, breakdown: Breakdown) -> "ExchangeSession | None":
        """What one run exchanges in ``namespace``; None (said on the breakdown, logged) without keys."""
        ring = self.keys.ring(namespace) if self.keys is not None else None
        if ring is None:
            security_event(
                "no_signing_key", device=self.device, namespace=namespace, outcome="cache off, local prefill"
            )
            return None
        return ExchangeSession(self, namespace, ring, breakdown)


def run_session(
    exchange: Exchange | None, namespace: str, breakdown: Breakdown, use_cache: bool
) -> "ExchangeSession | None":
    """The exchange of one run, or None when the run uses no cache (said on ``breakdown``: asked
    for none, no cache box configured, or no signing key for ``namespace``)."""
    if not use_cache or exchange is None or not exchange.connected:
        breakdown.cache_off(CacheBoxState.OFF, Decision.NO_CACHE)
        return None
    session = exchange.session(namespace, breakdown)
    if session is None:
        breakdown.cache_off(CacheBoxState.NO_KEY, Decision.NO_SIGNING_KEY)
    return session


@dataclass
class ExchangeSession:
    """One run's (or one encode's) exchange with the cache box, in one namespace."""

    exchange: Exchange
    namespace: str
    ring: KeyRing
    breakdown: Breakdown
    missing: set[str] = field(default_factory=set)  # names found absent or rejected in this run
    # The catalog's "maybe"s of this run not settled yet: each is counted once, as the cache box's
    # answer (true hit, false positive) or why it was never asked (``not_asked``).
    unsettled: set[str] = field(default_factory=set)

    @property
    def store(self) -> CacheBox:
        return self.exchange.store

    @property
    def catalog(self) -> Catalog:
        return self.exchange.catalogs.get(self.namespace).catalog

    # -- lookup ------------------------------------------------------------------------------
    def maybe(self, refs: Sequence[EntryRef], *, use_catalog: bool = True) -> list[EntryRef]:
        """The refs the local catalog says the cache box may hold (no network); times ``bloom_ms``."""
        mark = time.perf_counter()
        hits = self.catalog.lookup([ref.key for ref in refs]) if use_catalog else [True] * len(refs)
        self.breakdown.bloom_ms += ms_since(mark)
        found = [ref for ref, hit in zip(refs, hits) if hit]
        if use_catalog:
            self.unsettled.update(ref.name for ref in found)
        return found

    def _settle(self, ref: EntryRef) -> bool:
        """True the first time ``ref``, a catalog "maybe" of this run, is settled."""
        if ref.name in self.unsettled:
            self.unsettled.discard(ref.name)
            return True
        return False

    def not_asked(self, refs: Sequence[EntryRef], why: str) -> None:
        """Catalog "maybe"s of this run the cache box is not asked about, and why (``cachebox.catalog.NOT_ASKED``):
        counted, so that the catalog's counters add up."""
        count = sum(1 for ref in refs if self._settle(ref))
        if count:
            self.catalog.record_not_asked(count, why)

    def read_headers(self, refs: Sequence[EntryRef], expect: Expect) -> dict[str, EntryHeader]:
        """Verified headers of the entries that exist and are the ones asked for (one round trip).

        Absent entries count as catalog false positives; refused ones are evicted. The stored
        size is checked against the signed header before any state byte is downloaded.
        """
        if not refs:
            return {}
        mark = time.perf_counter()
        found: dict[str, EntryHeader] = {}
        try:
            heads = self.store.read_heads([ref.name for ref in refs], HEADER_PEEK_BYTES)
            for ref, (raw, size) in zip(refs, heads):
                if not raw:
                    if self._settle(ref):
                        self.catalog.record_false_positive()
                    self.breakdown.false_positives += 1
                    self.missing.add(ref.name)
                    continue
                if self._settle(ref):
                    self.catalog.record_true_hit()  # held, whatever its checks say below
                try:
                    parsed = decode_header(raw)
                    if isinstance(parsed, int):  # a header longer than the peek: read it whole
                        parsed = decode_header(self.store.read_prefixes([ref.name], parsed)[0])
                        if isinstance(parsed, int):
                            raise EntryError("entry is truncated inside its header")
                    header, offset = parsed
                    verify_header(header, self.ring)
                    self._check(ref, header, expect)
                    if size != entry_size(header, offset):
                        raise EntryError(f"entry is {size} bytes, its signed header says {entry_size(header, offset)}")
                except UnknownKey as exc:
                    self._newer_key(ref, exc)
                    continue
                except (OverLimit, UnknownCodec) as exc:
                    log.info("skipping %s: %s", ref.name, exc)
                    continue
                except EntryError as exc:
                    self.reject(ref, exc)
                    continue
                found[ref.name] = header
        except CacheBoxUnavailable as exc:
            self._unavailable(exc)
            self.not_asked(refs, "cachebox_down")  # those not answered yet
        finally:
            self.breakdown.fetch_ms += ms_since(mark)
        return found

    def within_budget(self, refs: Sequence[EntryRef], headers: dict[str, EntryHeader]) -> list[EntryRef]:
        """The longest start of ``refs`` whose entries fit in one request's download limit."""
        total = 0
        for index, ref in enumerate(refs):
            total += headers[ref.name].state_bytes + HEADER_PEEK_BYTES
            if total > self.exchange.max_fetch_bytes:
                log.warning(
                    "fetch limited to %d of %d entries: over %d bytes", index, len(refs), self.exchange.max_fetch_bytes
                )
                return list(refs[:index])
        return list(refs)

    def fetch(self, refs: Sequence[EntryRef], expect: Expect, *, chain: bool) -> list[Fetched]:
        """Download and verify entries (one round trip), their states hashed concurrently.

        What was really read is checked again (it may have been replaced since its header was
        read): signature, limits, state digest, then ``expect``. With ``chain`` the result
        stops before the first entry that fails (later links would not connect).
        """
        if not refs:
            return []
        mark = time.perf_counter()
        blobs = self.download(refs)
        usable = self.open(refs, blobs, expect, chain=chain) if blobs is not None else []
        self.breakdown.fetch_ms += ms_since(mark)
        return usable

    def download(self, refs: Sequence[EntryRef]) -> list[bytes | None] | None:
        """The entries as stored (None where absent), unchecked, in one round trip; None (said on
        the breakdown) when the cache box fails. ``open`` checks them."""
        try:
            return self.store.read_entries([ref.name for ref in refs])
        except CacheBoxUnavailable as exc:
            self._unavailable(exc)
            return None

    def open(
        self,
        refs: Sequence[EntryRef],
        blobs: Sequence[bytes | None],
        expect: Expect,
        *,
        chain: bool,
        reject: Callable[[EntryRef, Exception], None] | None = None,
    ) -> list[Fetched]:
        """Verify and decode downloaded entries (``fetch``'s checks); with ``chain``, stop before
        the first that fails. ``reject``: what to do with an entry that fails a check (default:
        count it and evict it from the cache box; the flash tier removes its own file instead)."""
        reject = reject or self.reject
        usable: list[Fetched] = []
        checking = time.perf_counter()
        opened = open_entries([blob or b"" for blob in blobs], self.ring, self.exchange.max_entry_bytes)
        self.breakdown.verify_ms += ms_since(checking)
        for ref, blob, result in zip(refs, blobs, opened):
            if blob is None:  # evicted since its header was read: a miss, not a forgery
                self.missing.add(ref.name)
                if chain:
                    break
                continue
            try:
                if isinstance(result, EntryError):
                    raise result
                header, encoded = result
                offset = len(blob) - header.state_bytes
                self._check(ref, header, expect)
                decoding = time.perf_counter()
                state = decoded_state(header, encoded)  # after decryption authenticated the stored bytes
                self.breakdown.decompress_ms += ms_since(decoding)
            except UnknownKey as exc:
                self._newer_key(ref, exc)
                if chain:
                    break
                continue
            except (OverLimit, UnknownCodec) as exc:
                log.info("skipping %s: %s", ref.name, exc)
                if chain:
                    break
                continue
            except EntryError as exc:
                reject(ref, exc)
                if chain:
                    break
                continue
            usable.append(Fetched(ref, header, blob, offset, state, 0))
            self.breakdown.codec = header.codec
        return usable

    def restore(
        self, engine: Engine, item: Fetched, seq: int, first_positions: range, last_position: int | None = None
    ) -> bool:
        """Import a verified entry into ``seq``; False (entry evicted) when llama.cpp refuses it or
        it leaves positions other than ``first_positions``..``last_position`` (default: the
        range's end - 1). Times ``restore_ms``."""
        mark = time.perf_counter()
        last_position = item.ref.end - 1 if last_position is None else last_position
        try:
            try:
                engine.import_range(item.state, item.state_offset, seq=seq)
            except EngineError as exc:
                self.reject(item.ref, exc)
                return False
            first, last = engine.positions(seq)
            if last != last_position or first not in first_positions:
                self.reject(
                    item.ref,
                    EntryError(
                        f"restore left positions {first}..{last}, expected {first_positions.start}..{last_position}"
                    ),
                )
                return False
            self.breakdown.fetched_bytes += len(item.blob)  # the whole entry, as moved
            return True
        finally:
            self.breakdown.restore_ms += ms_since(mark)

    def exists(self, refs: Sequence[EntryRef]) -> list[bool]:
        """Whether the cache box holds each entry (one round trip); raises CacheBoxUnavailable."""
        return self.store.exists([ref.name for ref in refs])

    # -- checks and refusals -------------------------------------------------------------------
    def _check(self, ref: EntryRef, header: EntryHeader, expect: Expect) -> None:
        if header.fingerprint != self.exchange.fingerprint or header.namespace != self.namespace:
            raise EntryError("entry was made for another model or namespace")
        expect(ref, header)
        if header.codec not in codecs.CODECS:
            raise UnknownCodec(f"entry is stored as {header.codec!r}, a codec this board does not know")
        if max(header.state_bytes, header.decoded_bytes) > self.exchange.max_entry_bytes:
            raise OverLimit(
                f"entry holds {header.decoded_bytes} bytes, over this board's {self.exchange.max_entry_bytes}-byte limit"
            )

    def reject(self, ref: EntryRef, reason: Exception) -> None:
        """An entry failed a check: count and log it, evict it (best effort); the run computes instead."""
        self.missing.add(ref.name)
        self.breakdown.rejected_entries += 1
        security_event(
            "entry_rejected", entry=ref.name, reason=str(reason), device=self.exchange.device, action="evicted"
        )
        try:
            self.store.delete([ref.name])
        except CacheBoxUnavailable:
            pass

    def _newer_key(self, ref: EntryRef, reason: Exception) -> None:
        """Signed after a key rotation this board has not seen yet: a miss, not a forgery.

        Neither evicted nor overwritten (not marked missing): boards with the new key use it.
        """
        log.info("skipping %s: %s; refreshing keys", ref.name, reason)
        if self.exchange.keys is not None:
            self.exchange.keys.refresh()

    def _unavailable(self, exc: Exception) -> None:
        log.warning("cache box unavailable, computing locally: %s", exc)
        self.breakdown.cachebox_failed(Decision.CACHEBOX_UNAVAILABLE)

    # -- upload ----------------------------------------------------------------------------------
    def seal(
        self,
        ref: EntryRef,
        state: bytes,
        tokens_digest: str,
        logits: np.ndarray | None = None,
        top: int = TOP_CANDIDATES,
    ) -> bytes:
        """The sealed, signed entry of ``state`` for ``ref`` (with the top logits of its last position, if given)."""
        top_ids = top_values = None
        if logits is not None:
            top_ids, top_values = top_candidates(logits, top)
        codec = self.exchange.codec
        stored = codecs.encode(state, codec)
        if codec != codecs.RAW and len(stored) >= len(state):
            codec, stored = codecs.RAW, state  # nothing gained: readers skip the decoding
        header = EntryHeader(
            fingerprint=self.exchange.fingerprint,
            namespace=self.namespace,
            start=ref.start,
            end=ref.end,
            tokens_digest=tokens_digest,
            state_bytes=0,  # set by encode_entry: the sealed size
            device=self.exchange.device,
            top_ids=top_ids,
            top_logits=top_values,
            codec=codec,
            raw_bytes=len(state) if codec != codecs.RAW else 0,
        )
        return encode_entry(header, stored, self.ring)

    def share(self, items: Iterable[tuple[EntryRef, bytes]], *, chain: bool) -> list[StoredEntry]:
        """Store sealed entries and announce their keys to every board's catalog (one place for both).

        Entries over the size limit are left out (with ``chain``, so is everything after the
        first: later ranges would link to a missing one). Fills ``uploaded_bytes``; a cache box
        that fails is recorded, not raised: the answer is already out, and keys are announced
        only after the store, so nothing is half-announced.
        """
        kept: list[tuple[EntryRef, bytes]] = []
        for ref, blob in items:
            if len(blob) > self.exchange.max_entry_bytes:
                log.warning("not uploading %s: %d bytes over the limit", ref.name, len(blob))
                if chain:
                    break
                continue
            kept.append((ref, blob))
        if not kept:
            return []
        try:
            self.breakdown.uploaded_bytes += self.store.put_entries(
                [(ref.name, blob) for ref, blob in kept], ttl=self.exchange.entry_ttl
            )
            self.exchange.catalogs.get(self.namespace).announce([ref.key for ref, _ in kept])
        except CacheBoxOverQuota as exc:  # the namespace is full (or the entry over the cache box's cap): not an outage
            log.warning("states not shared: %s", exc)
            return []
        except CacheBoxUnavailable as exc:
            log.warning("cache box unavailable, states not shared: %s", exc)
            self.breakdown.cachebox_failed()
            return []
        return [
            StoredEntry(
                name=ref.name,
                namespace=self.namespace,
                model=self.exchange.fingerprint,
                start=ref.start,
                end=ref.end,
                bytes=len(blob),
                piece=ref.piece,
            )
            for ref, blob in kept
        ]

    def touch(self, names: Sequence[str]) -> None:
        """Entries just used live another TTL (after the answer, off the TTFT path)."""
        if names and self.exchange.entry_ttl:
            try:
                self.store.touch(names, self.exchange.entry_ttl)
            except CacheBoxUnavailable:
                pass

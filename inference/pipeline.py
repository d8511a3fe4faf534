"""The cached-inference pipeline: the paper's steps with a timer around each.

tokenize -> catalog lookup (every candidate range) -> fetch the longest range the
cache box really holds -> verify and restore it -> prefill only the rest -> sample
the first token (TTFT) -> decode the rest (TTLT) -> export and upload the new
ranges, after the answer, and announce their keys to every board's catalog.

A cache box that is down, a catalog false positive, or a corrupted entry never
changes the answer: the run falls back to local prefill and says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from cachebox.catalog import Catalog
from cachebox.entry import (
    HEADER_PEEK_BYTES,
    EntryHeader,
    decode_header,
    encode_entry,
    entry_size,
    open_entries,
    state_checksum,
    verify_header,
)
from cachebox.errors import CacheBoxUnavailable, EntryError
from cachebox.events import security_event
from cachebox.keys import candidate_boundaries, check_namespace, entry_key_name, prefix_keys, tokens_digest
from cachebox.signing import Keychain, KeyRing, UnknownKey
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry

from .breakdown import Breakdown
from .breakeven import BreakEvenPolicy
from .engine import Engine, EngineError
from .sampling import TOP_CANDIDATES, SamplingParams, choose, sample, top_candidates

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt that cannot be run as given; the message says what to change."""


@dataclass
class RunResult:
    text: str
    tokens: list[int]
    breakdown: Breakdown
    # Cache-box entries this run used and stored, for the control plane's mirror.
    fetched: list[str] = field(default_factory=list)
    uploaded: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"text": self.text, **self.breakdown.as_dict()}


@dataclass
class _Restored:
    matched: int = 0
    top_ids: np.ndarray | None = None
    top_logits: np.ndarray | None = None
    entries: list[str] = field(default_factory=list)


@dataclass
class _Lookup:
    """Everything the lookup learned that the upload reuses."""

    boundaries: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    known: set[bytes] = field(default_factory=set)  # keys the catalog says the cache box holds
    missing: set[str] = field(default_factory=set)  # entry names found absent or rejected in this run
    ring: KeyRing | None = None  # the namespace's signing keys


def ms_since(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def share_entries(store: CacheBox, catalogs: CatalogRegistry, namespace: str, items, keys, ttl: int | None, breakdown: Breakdown) -> bool:
    """Store entries and announce their keys to every board's catalog (one place for both).

    Fills ``uploaded_bytes``; a cache box that is down is recorded, not raised: the answer
    is already out and nothing was half-written (keys are announced only after the store).
    """
    try:
        breakdown.uploaded_bytes = store.put_entries(items, ttl=ttl) if items else 0
        if keys:
            catalogs.get(namespace).announce(keys)
        return True
    except CacheBoxUnavailable as exc:
        log.warning("cache box unavailable, states not shared: %s", exc)
        breakdown.cachebox = "unavailable"
        breakdown.uploaded_bytes = 0
        return False


def signing_ring(keys: Keychain | None, namespace: str, device: str) -> KeyRing | None:
    """The ring that signs and checks ``namespace``'s entries; None (logged) when this board has none."""
    ring = keys.ring(namespace) if keys is not None else None
    if ring is None:
        security_event("no_signing_key", device=device, namespace=namespace, outcome="cache off, local prefill")
    return ring


def reject_entry(store: CacheBox, name: str, reason: Exception, device: str) -> None:
    """An entry failed a check: log it, evict it (best effort); the caller prefills instead."""
    security_event("entry_rejected", entry=name, reason=str(reason), device=device, action="evicted")
    try:
        store.delete([name])
    except CacheBoxUnavailable:
        pass


def decode_answer(engine: Engine, token: int, position: int, max_tokens: int, sampling: SamplingParams, rng, breakdown: Breakdown, started: float, top: int = TOP_CANDIDATES) -> tuple[list[int], str]:
    """Decode the answer after its first token (R-decode + Sample), stopping at end of generation.

    Fills ``decode_ms``, ``sample_ms``, ``ttlt_ms`` and ``generated_tokens``; returns the
    answer's tokens (without the end-of-generation token) and its text.
    """
    generated = [token]
    while len(generated) < max_tokens and not engine.is_end_of_generation(token):
        mark = time.perf_counter()
        logits = engine.decode_one(token, position)
        breakdown.decode_ms += ms_since(mark)
        position += 1
        mark = time.perf_counter()
        token = choose(logits, sampling, rng, top)
        breakdown.sample_ms += ms_since(mark)
        generated.append(token)
    breakdown.ttlt_ms = ms_since(started)
    if engine.is_end_of_generation(generated[-1]):
        generated.pop()
    breakdown.generated_tokens = len(generated)
    return generated, engine.detokenize(generated)


class CachedInference:
    """Serves prompts on one engine, sharing prompt states through one cache box."""

    def __init__(
        self,
        engine: Engine,
        store: CacheBox | None,
        catalogs: CatalogRegistry | None,
        *,
        device: str = "",
        chunk_tokens: int = 64,
        top_logits: int = TOP_CANDIDATES,
        max_entry_bytes: int = 64 * 1024 * 1024,
        max_fetch_bytes: int = 256 * 1024 * 1024,
        namespace: str = "default",
        entry_ttl: int | None = None,
        policy: BreakEvenPolicy | None = None,
        keys: Keychain | None = None,
    ):
        self.engine = engine
        self.store = store
        self.catalogs = catalogs
        self.device = device
        self.chunk_tokens = chunk_tokens
        self.top_logits = top_logits
        self.max_entry_bytes = max_entry_bytes
        self.max_fetch_bytes = max_fetch_bytes  # per request, all ranges together
        # Signing keys: without a ring for the namespace a run neither reads nor writes entries.
        self.keys = keys
        self.namespace = check_namespace(namespace)
        self.entry_ttl = entry_ttl
        self.policy = policy or BreakEvenPolicy()
        self.bytes_per_token = 18_500.0  # refined from every fetch

    # -- public -------------------------------------------------------------------------
    def tokenize(self, segments: Sequence[str]) -> tuple[list[int], list[int]]:
        """Token ids of the whole prompt and the token index where each segment ends.

        Segments are tokenized one by one, so a segment's tokens (and so its cache key)
        do not depend on the text that follows it.
        """
        tokens: list[int] = []
        ends: list[int] = []
        for index, segment in enumerate(segments):
            tokens += self.engine.tokenize(segment, add_bos=index == 0)
            ends.append(len(tokens))
        return tokens, ends

    def run(
        self,
        prompt: str | Sequence[str],
        *,
        max_tokens: int = 16,
        sampling: SamplingParams = SamplingParams(),
        use_cache: bool = True,
        namespace: str | None = None,
        upload: bool = True,
        use_catalog: bool = True,
    ) -> RunResult:
        """Answer ``prompt`` (a string, or its segments in order) and time every step.

        ``upload=False`` leaves the cache box as it was (benchmarks measure one state many
        ways); ``use_catalog=False`` asks the cache box about every candidate range, as a
        design without a catalog would.
        """
        segments = [prompt] if isinstance(prompt, str) else list(prompt)
        if not segments or not "".join(segments).strip():
            raise PromptError("the prompt is empty: give it some text")
        if max_tokens < 1:
            raise PromptError("max_tokens must be at least 1")
        namespace = check_namespace(namespace or self.namespace)
        engine = self.engine
        with engine.lock:
            breakdown = Breakdown()
            started = time.perf_counter()

            mark = time.perf_counter()
            tokens, segment_ends = self.tokenize(segments)
            breakdown.token_ms = ms_since(mark)
            prompt_tokens = len(tokens)
            breakdown.prompt_tokens = prompt_tokens
            if prompt_tokens + max_tokens > engine.n_ctx:
                raise PromptError(
                    f"the prompt has {prompt_tokens} tokens and {max_tokens} more were asked for, but the "
                    f"context holds {engine.n_ctx}; shorten the prompt, lower --max-tokens or raise EDGECACHE_N_CTX"
                )
            engine.clear()

            caching = use_cache and self.store is not None and self.catalogs is not None
            breakdown.link = self.store.link_label if self.store is not None else ""
            lookup = _Lookup(boundaries=candidate_boundaries(prompt_tokens, segment_ends, self.chunk_tokens))
            if caching:
                lookup.ring = signing_ring(self.keys, namespace, self.device)
                caching = lookup.ring is not None
                if not caching:
                    breakdown.cachebox, breakdown.decision = "no-key", "no-signing-key"
            restored = _Restored()
            if not caching:
                if breakdown.cachebox == "ok":
                    breakdown.cachebox = "off"
                    breakdown.decision = "no-cache"
            else:
                restored = self._lookup_and_restore(tokens, namespace, lookup, breakdown, use_catalog)
            matched = restored.matched
            breakdown.matched_tokens = matched
            breakdown.case = "miss" if matched == 0 else ("full" if matched == prompt_tokens else "partial")

            # P-decode: only what was not restored. Logits are kept at the segment ends so
            # that their entries carry them (one 1 MB copy each, no extra model work): a later
            # prompt that ends there is then a full hit with no decode at all. Entries at
            # fixed chunk ends go without (a prompt rarely ends exactly there; it then
            # recomputes one token) to keep entries small.
            boundary_logits: dict[int, np.ndarray] = {}
            exports: dict[int, bytes] = {}  # range end -> state, taken as soon as the range is computed
            if matched < prompt_tokens:
                wanted = {prompt_tokens - 1}
                on_batch = None
                if caching:
                    wanted |= {end - 1 for end in segment_ends if end > matched}
                    on_batch = self._exporter(lookup.boundaries, matched, exports)
                mark = time.perf_counter()
                boundary_logits = engine.prefill(tokens[matched:], matched, logits_at=wanted, on_batch=on_batch)
                breakdown.prefill_ms = ms_since(mark)
            elif restored.top_ids is None:
                # A full hit without stored logits: recompute the last position only.
                mark = time.perf_counter()
                engine.remove(0, prompt_tokens - 1, -1)
                boundary_logits = engine.prefill(tokens[-1:], prompt_tokens - 1, logits_at={prompt_tokens - 1})
                breakdown.prefill_ms = ms_since(mark)

            # First token: from fresh logits, or from the ones stored with a full hit.
            rng = np.random.default_rng(sampling.seed)
            mark = time.perf_counter()
            if prompt_tokens - 1 in boundary_logits:
                token = choose(boundary_logits[prompt_tokens - 1], sampling, rng, self.top_logits)
            else:
                token = sample(restored.top_ids, restored.top_logits, sampling, rng)
            breakdown.sample_ms = ms_since(mark)
            breakdown.ttft_ms = ms_since(started)

            generated, text = decode_answer(engine, token, prompt_tokens, max_tokens, sampling, rng, breakdown, started, self.top_logits)

            uploaded: list[dict] = []
            if caching and upload and breakdown.cachebox == "ok":
                uploaded = self._upload(tokens, namespace, lookup, matched, boundary_logits, exports, breakdown)
                self._touch(restored.entries)
            breakdown.state_bytes = breakdown.fetched_bytes + breakdown.uploaded_bytes
            self._learn(breakdown)
            return RunResult(text=text, tokens=generated, breakdown=breakdown, fetched=restored.entries, uploaded=uploaded)

    # -- steps ----------------------------------------------------------------------------
    def _lookup_and_restore(self, tokens: list[int], namespace: str, lookup: _Lookup, breakdown: Breakdown, use_catalog: bool = True) -> _Restored:
        fingerprint = self.engine.fingerprint
        catalog = self.catalogs.get(namespace).catalog
        mark = time.perf_counter()
        lookup.keys = prefix_keys(fingerprint, namespace, tokens, lookup.boundaries)
        maybe = catalog.lookup(lookup.keys) if use_catalog else [True] * len(lookup.keys)
        breakdown.bloom_ms = ms_since(mark)
        candidates = [end for end, hit in zip(lookup.boundaries, maybe) if hit]
        lookup.known = {key for key, hit in zip(lookup.keys, maybe) if hit}
        if not candidates:
            breakdown.decision = "catalog-miss"  # a sure miss: no network at all
            return _Restored()
        longest = max(candidates)
        breakdown.candidate_tokens = longest
        decision = self.policy.decide(longest, int(longest * self.bytes_per_token))
        breakdown.predicted_fetch_ms = decision.predicted_fetch_ms
        breakdown.predicted_prefill_ms = decision.predicted_prefill_ms
        if not decision.fetch:
            breakdown.decision = "policy-skip"  # recomputing is forecast to be faster on this board and link
            return _Restored()

        mark = time.perf_counter()
        names = {end: entry_key_name(namespace, fingerprint, key) for end, key in zip(lookup.boundaries, lookup.keys)}
        try:
            headers = self._read_headers(tokens, namespace, sorted(candidates, reverse=True), names, catalog, breakdown, lookup)
            chain = self._plan_chain(tokens, namespace, headers, names, catalog, breakdown, lookup)
            chain = self._within_budget(chain, headers)
            if not chain:
                breakdown.fetch_ms = breakdown.redis_ms = ms_since(mark)
                breakdown.decision = "no-usable-entry"
                return _Restored()
            blobs = self.store.read_entries([names[end] for end in chain])
        except CacheBoxUnavailable as exc:
            log.warning("cache box unavailable, prefilling locally: %s", exc)
            breakdown.cachebox = "unavailable"
            breakdown.decision = "cachebox-unavailable"
            breakdown.fetch_ms = breakdown.redis_ms = ms_since(mark)
            return _Restored()

        usable: list[tuple[int, bytes, int]] = []  # (range end, entry, offset of its state)
        # Check what was really read (it may have been replaced meanwhile): signature, limits
        # and the state's digest, before a byte of it reaches llama.cpp.
        checking = time.perf_counter()
        opened = open_entries([blob or b"" for blob in blobs], lookup.ring, self.max_entry_bytes)
        breakdown.verify_ms = ms_since(checking)
        for end, blob, result in zip(chain, blobs, opened):
            try:
                if not blob:
                    raise EntryError("entry vanished between the header and state reads")
                if isinstance(result, EntryError):
                    raise result
                header, offset = result
                self._check_header(header, tokens, namespace, end)
                headers[end] = (header, offset)
            except UnknownKey as exc:
                self._newer_key(names[end], exc, lookup)
                break
            except EntryError as exc:
                self._reject(names[end], exc, breakdown, lookup)
                break  # the chain is usable up to the range before this one
            usable.append((end, blob, offset))
        breakdown.fetch_ms = ms_since(mark)

        mark = time.perf_counter()
        matched = 0
        for end, blob, offset in usable:
            try:
                self.engine.import_range(blob, offset)
            except EngineError as exc:
                self._reject(names[end], exc, breakdown, lookup)
                break
            first, last = self.engine.positions()
            if first != 0 or last != end - 1:
                self._reject(names[end], EntryError(f"restore left positions {first}..{last}, expected 0..{end - 1}"), breakdown, lookup)
                break
            matched = end
            breakdown.fetched_bytes += len(blob)  # the whole entry, as moved
        if matched < (usable[-1][0] if usable else 0):
            self.engine.remove(0, matched, -1)  # drop a partly restored range
        breakdown.restore_ms = ms_since(mark)
        breakdown.redis_ms = breakdown.fetch_ms + breakdown.restore_ms
        if matched == 0:
            breakdown.decision = "no-usable-entry"
            return _Restored()
        catalog.record_true_hit(sum(1 for end, _, _ in usable if end <= matched))
        breakdown.decision = "fetch"
        header = headers[matched][0]
        full = matched == len(tokens)
        used = [names[end] for end, _, _ in usable if end <= matched]
        return _Restored(matched, header.top_ids if full else None, header.top_logits if full else None, used)

    def _read_headers(self, tokens, namespace, ends, names, catalog: Catalog, breakdown, lookup: _Lookup) -> dict[int, tuple[EntryHeader, int]]:
        """Headers of the entries at ``ends`` that exist and belong to these tokens (one round trip)."""
        headers: dict[int, tuple[EntryHeader, int]] = {}
        heads = self.store.read_heads([names[end] for end in ends], HEADER_PEEK_BYTES)
        for end, (raw, size) in zip(ends, heads):
            if not raw:
                catalog.record_false_positive()
                breakdown.false_positives += 1
                lookup.missing.add(names[end])
                continue
            try:
                parsed = decode_header(raw)
                if isinstance(parsed, int):  # a header longer than the peek: read it whole
                    parsed = decode_header(self.store.read_prefixes([names[end]], parsed)[0])
                    if isinstance(parsed, int):
                        raise EntryError("entry is truncated inside its header")
                header, offset = parsed
                verify_header(header, lookup.ring)
                self._check_header(header, tokens, namespace, end)
                if size != entry_size(header, offset):
                    raise EntryError(f"entry is {size} bytes, its signed header says {entry_size(header, offset)}")
            except UnknownKey as exc:
                self._newer_key(names[end], exc, lookup)
                continue
            except EntryError as exc:
                self._reject(names[end], exc, breakdown, lookup)
                continue
            headers[end] = (header, offset)
        return headers

    def _check_header(self, header: EntryHeader, tokens, namespace: str, end: int) -> None:
        if header.fingerprint != self.engine.fingerprint or header.namespace != namespace:
            raise EntryError("entry was made for another model or namespace")
        if header.end != end or header.start >= end:
            raise EntryError(f"entry covers [{header.start}, {header.end}), expected a range ending at {end}")
        if header.tokens_digest != tokens_digest(tokens[header.start : header.end]):
            raise EntryError("entry does not belong to these tokens")
        if header.state_bytes > self.max_entry_bytes:
            raise EntryError(f"entry holds {header.state_bytes} bytes, over the {self.max_entry_bytes}-byte limit")

    def _plan_chain(self, tokens, namespace, headers, names, catalog, breakdown, lookup: _Lookup) -> list[int]:
        """Range ends from the first range to the longest prefix whose whole chain exists."""
        fingerprint = self.engine.fingerprint
        for longest in sorted(headers, reverse=True):
            chain = [longest]
            while chain[-1] in headers and headers[chain[-1]][0].start > 0:
                start = headers[chain[-1]][0].start
                if start not in headers:
                    # A range stored by a prompt cut differently: read that link's header too.
                    names[start] = entry_key_name(namespace, fingerprint, prefix_keys(fingerprint, namespace, tokens, [start])[0])
                    headers.update(self._read_headers(tokens, namespace, [start], names, catalog, breakdown, lookup))
                    if start not in headers:
                        break
                chain.append(start)
            if chain[-1] in headers and headers[chain[-1]][0].start == 0:
                return chain[::-1]
        return []

    def _within_budget(self, chain: list[int], headers) -> list[int]:
        """The longest start of ``chain`` whose entries fit in one request's download limit."""
        total = 0
        for index, end in enumerate(chain):
            header, offset = headers[end]
            total += entry_size(header, offset)
            if total > self.max_fetch_bytes:
                log.warning("fetch limited to %d of %d ranges: over %d bytes", index, len(chain), self.max_fetch_bytes)
                return chain[:index]
        return chain

    def _newer_key(self, name: str, reason: Exception, lookup: _Lookup) -> None:
        """An entry signed after a key rotation this board has not seen yet: a miss, not a forgery.

        It is neither evicted nor overwritten (not marked missing): boards with the new key use it.
        """
        log.info("skipping %s: %s; refreshing keys", name, reason)
        if self.keys is not None:
            self.keys.refresh()

    def _learn(self, breakdown: Breakdown) -> None:
        """Feed this run's measured costs to the break-even policy."""
        self.policy.observe_prefill(breakdown.prompt_tokens - breakdown.matched_tokens, breakdown.prefill_ms)
        if breakdown.matched_tokens and breakdown.fetched_bytes:
            self.policy.observe_fetch(breakdown.fetched_bytes, breakdown.redis_ms)
            self.bytes_per_token = 0.8 * self.bytes_per_token + 0.2 * breakdown.fetched_bytes / breakdown.matched_tokens

    def _touch(self, names: list[str]) -> None:
        """Entries just used live another TTL (after the answer, off the TTFT path)."""
        if names and self.entry_ttl:
            try:
                self.store.touch(names, self.entry_ttl)
            except CacheBoxUnavailable:
                pass

    def _reject(self, name: str, reason: Exception, breakdown: Breakdown, lookup: _Lookup) -> None:
        """Evict an entry that failed a check; the run goes on with local prefill."""
        lookup.missing.add(name)
        breakdown.rejected_entries += 1
        reject_entry(self.store, name, reason, self.device)

    def _exporter(self, boundaries: list[int], matched: int, exports: dict[int, bytes]):
        """A prefill callback that copies each new range out as soon as it is computed.

        Exporting later (after the answer) would be too late for sliding-window layers:
        llama.cpp reuses the cells that no later token can see (about 0.1 ms per MB).
        """
        pending = [end for end in boundaries if end > matched]

        def export_ready(next_position: int) -> None:
            start = max([matched] + list(exports))
            while pending and pending[0] <= next_position:
                end = pending.pop(0)
                exports[end] = self.engine.export_range(start, end)
                start = end

        return export_ready

    def _upload(self, tokens, namespace, lookup: _Lookup, matched, boundary_logits, exports, breakdown: Breakdown) -> list[dict]:
        """Store the ranges this run computed (after the answer is out)."""
        mark = time.perf_counter()
        fingerprint = self.engine.fingerprint
        if not lookup.keys:
            lookup.keys = prefix_keys(fingerprint, namespace, tokens, lookup.boundaries)
        items: list[tuple[str, bytes]] = []
        new_keys: list[bytes] = []
        stored: list[dict] = []
        start = matched
        for end, key in zip(lookup.boundaries, lookup.keys):
            if end <= matched:
                continue
            state = exports.get(end)
            if state is None:
                break  # not computed in this run
            name = entry_key_name(namespace, fingerprint, key)
            if key in lookup.known and name not in lookup.missing:
                start = end  # the cache box has it already (the policy chose to recompute): no second upload
                continue
            top_ids = top_values = None
            if end - 1 in boundary_logits:
                top_ids, top_values = top_candidates(boundary_logits[end - 1], self.top_logits)
            header = EntryHeader(
                fingerprint=fingerprint,
                namespace=namespace,
                start=start,
                end=end,
                tokens_digest=tokens_digest(tokens[start:end]),
                state_bytes=len(state),
                checksum=state_checksum(state),
                device=self.device,
                top_ids=top_ids,
                top_logits=top_values,
            )
            if len(state) > self.max_entry_bytes:
                log.warning("not uploading range [%d, %d): %d bytes over the limit", start, end, len(state))
                break  # later ranges would chain to a missing link
            items.append((name, encode_entry(header, state, lookup.ring)))
            new_keys.append(key)
            stored.append({"name": items[-1][0], "namespace": namespace, "model": fingerprint, "start": start, "end": end, "bytes": len(items[-1][1])})
            start = end
        if not share_entries(self.store, self.catalogs, namespace, items, new_keys, self.entry_ttl, breakdown):
            stored = []
        breakdown.upload_ms = ms_since(mark)
        return stored

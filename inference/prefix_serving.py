"""Prefix serving: the paper's steps with a timer around each, over the one exchange path.

tokenize -> catalog lookup (every candidate range) -> fetch the longest range the
cache box really holds -> verify and restore it -> prefill only the rest -> sample
the first token (TTFT) -> decode the rest (TTLT) -> export and upload the new
ranges, after the answer, and announce their keys to every board's catalog.

A cached answer is the cold answer, bit for bit. llama.cpp's CPU kernels round differently
for different batch shapes while restoring state bytes is exact, so every prefill here
(cold or resumed) cuts its batches at the same absolute positions, every ``grid`` tokens;
ranges are stored at those positions (and at the prompt's end) and their keys include the
grid. A run that resumes from a stored range then computes exactly the batches its cold run
would have, and gets the same logits.

What is fetched, checked, restored and stored is the exchange's work
(``inference.exchange``); this strategy says which ranges a prompt has and what
a right entry for one holds. A cache box that is down, a catalog false positive, or
a corrupted entry never changes the answer: the run falls back to local prefill and
says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from cachebox.entry import EntryHeader, decode_header
from cachebox.errors import EntryError
from cachebox.keys import check_namespace, grid_cuts, range_boundaries, tokens_digest

from .breakdown import Breakdown, CacheBoxState, Decision, Tier
from .breakeven import BreakEvenPolicy
from .engine import MAIN_SEQ, Engine, EngineError
from .exchange import EntryRef, Exchange, ExchangeSession, Fetched, run_session, plan_chain, prefix_refs
from .local_tier import Context, RamTier
from .sampling import TOP_CANDIDATES, SamplingParams, choose, sample
from .serving import OnToken, PromptError, RunResult, context_error, decode_answer, ms_since

log = logging.getLogger(__name__)


@dataclass
class _Restored:
    matched: int = 0
    top_ids: np.ndarray | None = None
    top_logits: np.ndarray | None = None
    entries: list[str] = field(default_factory=list)


class PrefixServing:
    """Serves prompts on one engine, reusing the longest cached prefix through the exchange."""

    def __init__(
        self,
        engine: Engine,
        exchange: Exchange | None,
        *,
        chunk_tokens: int = 128,
        top_logits: int = TOP_CANDIDATES,
        namespace: str = "default",
        policy: BreakEvenPolicy | None = None,
        context_reuse: bool = False,
        ram_tier_bytes: int = 0,
    ):
        self.engine = engine
        self.context_reuse = context_reuse  # keep the last prompt in the engine for the next one
        self.ram = RamTier(ram_tier_bytes) if ram_tier_bytes > 0 else None
        self._context: Context | None = None
        self.exchange = exchange
        if chunk_tokens < 1 or engine.config.n_batch % chunk_tokens:
            raise ValueError(f"the batch grid ({chunk_tokens} tokens) must divide the batch size {engine.config.n_batch}")
        self.chunk_tokens = chunk_tokens  # the grid: batches are cut, and ranges stored, every this many tokens
        self.top_logits = top_logits
        self.namespace = check_namespace(namespace)
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
        on_token: OnToken | None = None,
        tokens: Sequence[int] | None = None,
    ) -> RunResult:
        """Answer ``prompt`` (a string, or its segments in order) and time every step.

        ``upload=False`` leaves the cache box as it was (benchmarks measure one state many
        ways); ``use_catalog=False`` asks the cache box about every candidate range, as a
        design without a catalog would. ``on_token`` sees each answer token as it is chosen
        (streaming) and may stop the generation.
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
            # ``tokens`` given (a chat prompt, inference.chat): the template's markup carries control
            # tokens that tokenizing segments never produces; ``prompt`` is then only its text.
            tokens, _ = self.tokenize(segments) if tokens is None else (list(tokens), [len(tokens)])
            breakdown.token_ms = ms_since(mark)
            prompt_tokens = len(tokens)
            breakdown.prompt_tokens = prompt_tokens
            if prompt_tokens + max_tokens > engine.n_ctx:
                raise context_error(prompt_tokens, max_tokens, engine.n_ctx)
            # Nearest first: this board's context (no copy), its RAM tier, then the cache box.
            restored = self._from_context(tokens, breakdown, use_cache)

            breakdown.link = self.exchange.link_label if self.exchange is not None else ""
            boundaries = range_boundaries(prompt_tokens, self.chunk_tokens)
            session = run_session(self.exchange, namespace, breakdown, use_cache)
            refs: list[EntryRef] = []
            known: set[bytes] = set()  # keys the catalog says the cache box holds
            if session is not None:
                refs = prefix_refs(namespace, engine.fingerprint, tokens, boundaries, grid=self.chunk_tokens)
                restored = self._from_ram(refs, restored, breakdown)
                if restored.matched < prompt_tokens:
                    restored = self._lookup_and_restore(session, tokens, refs, known, use_catalog, restored)
                elif breakdown.tier != Tier.NONE:
                    breakdown.decision = Decision.LOCAL
            matched = restored.matched
            breakdown.classify(matched, prompt_tokens)

            # P-decode: only what was not restored, in the batches of the grid. The entry at the
            # prompt's end keeps the top logits of its last position (no extra model work): the
            # same prompt later is a full hit with no decode at all.
            boundary_logits: dict[int, np.ndarray] = {}
            exports: dict[int, bytes] = {}  # range end -> state, taken as soon as the range is computed
            if matched < prompt_tokens:
                on_batch = self._exporter(boundaries, matched, exports) if session is not None else None
                mark = time.perf_counter()
                boundary_logits = engine.prefill(
                    tokens[matched:], matched, logits_at={prompt_tokens - 1}, on_batch=on_batch, cuts=grid_cuts(prompt_tokens, self.chunk_tokens, matched)
                )
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

            generated, text = decode_answer(engine, token, prompt_tokens, max_tokens, sampling, rng, breakdown, started, self.top_logits, on_token)

            uploaded = []
            if session is not None and upload and breakdown.cachebox == CacheBoxState.OK:
                uploaded = self._upload(session, tokens, refs, known, matched, boundary_logits, exports)
                session.touch(restored.entries)
            elif session is not None and self.ram is not None:
                self._keep_in_ram(session, tokens, refs, matched, boundary_logits, exports)
            breakdown.state_bytes = breakdown.fetched_bytes + breakdown.uploaded_bytes
            self._learn(breakdown)
            if self.context_reuse and use_cache:
                stored = (restored.top_ids, restored.top_logits) if restored.top_ids is not None else None
                self._context = Context.after(tokens, engine.claim_main(), boundary_logits.get(prompt_tokens - 1), stored, self.top_logits)
            else:
                self._context = None
            return RunResult(text=text, tokens=generated, breakdown=breakdown, fetched=restored.entries, uploaded=uploaded)

    # -- steps ----------------------------------------------------------------------------
    def _from_context(self, tokens: list[int], breakdown: Breakdown, use_cache: bool) -> _Restored:
        """Keep what the engine still holds of the last prompt, up to the last shared grid point."""
        engine = self.engine
        context, self._context = self._context, None  # only a run that completes leaves one again
        if not (self.context_reuse and use_cache and context is not None and context.generation == engine.generation):
            engine.clear()
            return _Restored()
        mark = time.perf_counter()
        reuse = context.reusable(tokens, self.chunk_tokens)
        if reuse == 0:
            engine.clear()
            return _Restored()
        engine.remove(MAIN_SEQ, reuse, -1)  # the rest of the old prompt and its answer's cells
        breakdown.local_ms += ms_since(mark)
        breakdown.tier = Tier.CONTEXT
        full = reuse == len(tokens)
        return _Restored(reuse, context.top_ids if full else None, context.top_logits if full else None)

    def _from_ram(self, refs: list[EntryRef], restored: _Restored, breakdown: Breakdown) -> _Restored:
        """Extend what is held with the chain of RAM-tier entries that starts where it ends."""
        if self.ram is None:
            return restored
        matched, last = restored.matched, None
        mark = time.perf_counter()
        for ref in refs:
            if ref.end <= matched:
                continue
            entry = self.ram.get(ref.name)
            if entry is None or entry.header.start != matched:
                break
            try:
                self.engine.import_range(entry.blob, entry.offset)
            except EngineError:
                break
            if self.engine.positions(MAIN_SEQ) != (0, ref.end - 1):
                self.engine.remove(MAIN_SEQ, matched, -1)
                break
            matched, last = ref.end, entry.header
        if last is None:
            return restored
        breakdown.local_ms += ms_since(mark)
        breakdown.tier = Tier.LOCAL
        full = matched == refs[-1].end
        return _Restored(matched, last.top_ids if full else None, last.top_logits if full else None)

    def _lookup_and_restore(self, session: ExchangeSession, tokens: list[int], refs: list[EntryRef], known: set[bytes], use_catalog: bool, held: _Restored) -> _Restored:
        """Extend what the board holds (``held``: its context or RAM tier) from the cache box."""
        breakdown = session.breakdown
        floor = held.matched
        candidates = session.maybe(refs, use_catalog=use_catalog)
        known.update(ref.key for ref in candidates)
        candidates = [ref for ref in candidates if ref.end > floor]
        if not candidates:
            breakdown.decision = Decision.LOCAL if floor else Decision.CATALOG_MISS  # no network at all
            return held
        longest = candidates[-1].end
        breakdown.candidate_tokens = longest
        decision = self.policy.decide(longest - floor, int((longest - floor) * self.bytes_per_token))
        breakdown.predicted_fetch_ms = decision.predicted_fetch_ms
        breakdown.predicted_prefill_ms = decision.predicted_prefill_ms
        if not decision.fetch:
            breakdown.decision = Decision.POLICY_SKIP  # recomputing is forecast to be faster on this board and link
            return held

        def expect(ref: EntryRef, header: EntryHeader) -> None:
            if header.end != ref.end or header.start >= ref.end:
                raise EntryError(f"entry covers [{header.start}, {header.end}), expected a range ending at {ref.end}")
            if header.tokens_digest != tokens_digest(tokens[header.start : header.end]):
                raise EntryError("entry does not belong to these tokens")

        by_end = {ref.end: ref for ref in refs}
        heads = session.read_headers(candidates[::-1], expect)
        headers = {ref.end: heads[ref.name] for ref in candidates if ref.name in heads}

        def read_link(end: int) -> EntryHeader | None:
            # A range stored by a prompt cut differently: read that link's header too.
            (by_end[end],) = prefix_refs(session.namespace, self.engine.fingerprint, tokens, [end], grid=self.chunk_tokens)
            return session.read_headers([by_end[end]], expect).get(by_end[end].name)

        ends = plan_chain(headers, read_link, floor)
        if ends and ends[-1] == len(tokens) and headers[ends[-1]].top_ids is None:
            # Stored by a longer prompt for which this end was a grid point: no logits with it.
            # Resume one link earlier and compute the last batch, as the cold run does.
            ends = ends[:-1]
        chain = [by_end[end] for end in ends]
        chain = session.within_budget(chain, {by_end[end].name: header for end, header in headers.items()})
        fetched = session.fetch(chain, expect, chain=True)
        matched = floor
        used: list[Fetched] = []
        for item in fetched:
            if not session.restore(self.engine, item, MAIN_SEQ, range(0, 1)):
                break
            matched = item.ref.end
            used.append(item)
        if fetched and matched < fetched[-1].ref.end:
            self.engine.remove(MAIN_SEQ, matched, -1)  # drop a partly restored range
        breakdown.redis_ms = breakdown.fetch_ms + breakdown.restore_ms
        if matched == floor:
            if breakdown.cachebox == CacheBoxState.OK:
                breakdown.decision = Decision.NO_USABLE_ENTRY
            return held
        session.record_hits(len(used))
        breakdown.decision = Decision.FETCH
        breakdown.tier = Tier.CACHEBOX
        if self.ram is not None:
            for item in used:
                self.ram.put(item.ref.name, item.header, item.blob, item.offset)
        last = used[-1].header
        full = matched == len(tokens)
        return _Restored(matched, last.top_ids if full else None, last.top_logits if full else None, [item.ref.name for item in used])

    def _learn(self, breakdown: Breakdown) -> None:
        """Feed this run's measured costs to the break-even policy."""
        self.policy.observe_prefill(breakdown.prompt_tokens - breakdown.matched_tokens, breakdown.prefill_ms)
        if breakdown.matched_tokens and breakdown.fetched_bytes:
            self.policy.observe_fetch(breakdown.fetched_bytes, breakdown.redis_ms)
            self.bytes_per_token = 0.8 * self.bytes_per_token + 0.2 * breakdown.fetched_bytes / breakdown.matched_tokens

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

    def _sealed(self, session: ExchangeSession, tokens, refs: list[EntryRef], known: set[bytes], matched: int, boundary_logits, exports) -> list[tuple[EntryRef, bytes, bool]]:
        """(range, signed entry, whether the cache box needs it) for each range this run computed.

        A range the cache box already holds (the policy chose to recompute) is sealed only
        for the RAM tier, and is not uploaded twice."""
        items: list[tuple[EntryRef, bytes, bool]] = []
        start = matched
        for ref in refs:
            if ref.end <= matched:
                continue
            state = exports.get(ref.end)
            if state is None:
                break  # not computed in this run
            needed = not (ref.key in known and ref.name not in session.missing)
            if needed or self.ram is not None:
                stored = EntryRef(start, ref.end, ref.key, ref.name)
                items.append((stored, session.seal(stored, state, tokens_digest(tokens[start : ref.end]), boundary_logits.get(ref.end - 1), self.top_logits), needed))
            start = ref.end
        return items

    def _remember(self, items) -> None:
        """Keep this run's own entries in the RAM tier (sealed here: nothing to verify)."""
        if self.ram is None:
            return
        for ref, blob, _ in items:
            header, offset = decode_header(blob)
            self.ram.put(ref.name, header, blob, offset)

    def _keep_in_ram(self, session: ExchangeSession, tokens, refs, matched, boundary_logits, exports) -> None:
        self._remember(self._sealed(session, tokens, refs, set(), matched, boundary_logits, exports))

    def _upload(self, session: ExchangeSession, tokens, refs: list[EntryRef], known: set[bytes], matched: int, boundary_logits, exports) -> list:
        """Store the ranges this run computed (after the answer is out), in RAM and in the cache box."""
        mark = time.perf_counter()
        items = self._sealed(session, tokens, refs, known, matched, boundary_logits, exports)
        self._remember(items)
        uploaded = session.share([(ref, blob) for ref, blob, needed in items if needed], chain=True)
        session.breakdown.upload_ms = ms_since(mark)
        return uploaded

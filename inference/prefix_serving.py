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
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from cachebox.entry import EntryHeader, decode_header
from cachebox.errors import EntryError
from cachebox.keys import check_namespace, grid_cuts, off_grid, range_boundaries, tokens_digest

from .breakdown import Breakdown, CacheBoxState, Decision, Tier
from .breakeven import BreakEvenPolicy, FetchPlan, Range
from .engine import MAIN_SEQ, Engine, EngineError
from .exchange import EntryRef, Exchange, ExchangeSession, Fetched, run_session, plan_chain, prefix_refs
from .local_tier import Context, RamTier
from .messages import StoredEntry
from .overlap import DONE, Arrival, RangeLoader
from .sampling import TOP_CANDIDATES, SamplingParams, choose, sample
from .serving import OnToken, PromptError, RunResult, context_error, decode_answer, ms_since, segment_tokens

log = logging.getLogger(__name__)

# A chain forecast to arrive within this many ms comes in one request (one round trip): per-range
# requests, which let a slow link's ranges be restored as they arrive, only cost round trips here.
AT_ONCE_MS = 50.0

Exports = dict[int, tuple[int, bytes]]  # range end -> (range start, state), taken as soon as computed
# Sealed states sent in one round trip at most: bounds what an upload holds besides the exports
# (a sealed copy and the client's packed copy of each state in flight).
UPLOAD_GROUP_BYTES = 2 * 1024 * 1024  # one 128-token range of Gemma-3 270M (2.4 MB) per round trip


def _upload_groups(refs: list[EntryRef], exports: Exports, limit: int) -> list[list[EntryRef]]:
    """``refs`` in order, in groups whose exported states add up to ``limit`` bytes or just past it. Pure."""
    groups: list[list[EntryRef]] = [[]]
    size = 0
    for ref in refs:
        if size >= limit and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(ref)
        size += len(exports[ref.end][1]) if ref.end in exports else 0
    return [group for group in groups if group]


@dataclass
class _Restored:
    """What the context holds before the rest of the prompt is computed: ``[0, matched)``."""

    matched: int = 0
    top_ids: np.ndarray | None = None
    top_logits: np.ndarray | None = None
    entries: list[str] = field(default_factory=list)
    computed: int = 0  # tokens of [0, matched) this run computed itself (the front, while loading)
    logits: dict[int, np.ndarray] = field(default_factory=dict)  # the last position's, when the front reached it
    exports: Exports = field(default_factory=dict)
    loader: RangeLoader | None = None  # may still be finishing a useless request: joined after the answer
    arrivals: list[Arrival] = field(default_factory=list)
    used: dict[str, Fetched] = field(default_factory=dict)

    @property
    def served(self) -> int:
        return self.matched - self.computed


@dataclass
class Extension:
    """What ``PrefixServing.extend`` added to the context: tokens computed, in how long, what it shared."""

    tokens: int = 0
    compute_ms: float = 0.0
    total_ms: float = 0.0  # with sealing and upload
    uploaded: list[StoredEntry] = field(default_factory=list)


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
        self._context: Context | None = None  # what the engine holds after the last run (prompt cells only)
        self._extra: tuple[int, ...] = ()  # the running prompt's cuts off the grid
        self.exchange = exchange
        if chunk_tokens < 1 or engine.config.n_batch % chunk_tokens:
            raise ValueError(f"the batch grid ({chunk_tokens} tokens) must divide the batch size {engine.config.n_batch}")
        self.chunk_tokens = chunk_tokens  # the grid: batches are cut, and ranges stored, every this many tokens
        self.top_logits = top_logits
        self.namespace = check_namespace(namespace)
        self.policy = policy or BreakEvenPolicy()
        self.bytes_per_token = engine.state_bytes_per_token  # what a range weighs on the link; refined from every header read

    # -- public -------------------------------------------------------------------------
    def tokenize(self, segments: Sequence[str]) -> tuple[list[int], list[int]]:
        """Token ids of the whole prompt and the token index where each segment ends.

        Segments are tokenized one by one, so a segment's tokens (and so its cache key)
        do not depend on the text that follows it.
        """
        return segment_tokens(self.engine, segments)

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
        cuts: Sequence[int] = (),
        on_stage: Callable[[str], None] | None = None,
    ) -> RunResult:
        """Answer ``prompt`` (a string, or its segments in order) and time every step.

        ``upload=False`` leaves the cache box as it was (benchmarks measure one state many
        ways); ``use_catalog=False`` asks the cache box about every candidate range, as a
        design without a catalog would. ``on_token`` sees each answer token as it is chosen
        (streaming) and may stop the generation; ``on_stage`` hears "fetching" when cached ranges
        start to load and "prefilling" when the board starts computing prompt tokens.

        Batches end on the grid, where the last segment begins (a prompt that shares all but its
        last segment with this one reuses that part whole), and at ``cuts`` (with ``tokens``:
        where a chat's messages begin, ``inference.chat``: the next turn of a conversation reuses
        this one whole). Not at every segment end: small batches made cold prefill 24-41% slower
        (``bench exact``).
        """
        segments = [prompt] if isinstance(prompt, str) else list(prompt)
        if not segments or not "".join(segments).strip():
            raise PromptError("the prompt is empty: give it some text")
        if max_tokens < 1:
            raise PromptError("max_tokens must be at least 1")
        namespace = check_namespace(namespace or self.namespace)
        engine = self.engine
        self._on_stage = on_stage or (lambda stage: None)
        with engine.lock:
            breakdown = Breakdown()
            started = time.perf_counter()

            mark = time.perf_counter()
            # ``tokens`` given (a chat prompt, inference.chat): the template's markup carries control
            # tokens that tokenizing segments never produces; ``prompt`` is then only its text.
            tokens, ends = self.tokenize(segments) if tokens is None else (list(tokens), [len(tokens)])
            breakdown.token_ms = ms_since(mark)
            prompt_tokens = len(tokens)
            # The last segment (the question after shared instructions and examples) starts a batch.
            self._extra = extra = tuple(cut for cut in off_grid([*cuts, *ends[-2:-1]], self.chunk_tokens) if cut < prompt_tokens)
            breakdown.prompt_tokens = prompt_tokens
            if prompt_tokens + max_tokens > engine.n_ctx:
                raise context_error(prompt_tokens, max_tokens, engine.n_ctx)
            # Nearest first: this board's context (no copy), its RAM tier, then the cache box.
            restored = self._from_context(tokens, extra, breakdown, use_cache)

            breakdown.link = self.exchange.link_label if self.exchange is not None else ""
            boundaries = range_boundaries(prompt_tokens, self.chunk_tokens, extra)
            session = run_session(self.exchange, namespace, breakdown, use_cache)
            refs: list[EntryRef] = []
            known: set[bytes] = set()  # keys the catalog says the cache box holds
            if session is not None:
                refs = prefix_refs(namespace, engine.fingerprint, tokens, boundaries, grid=self.chunk_tokens, extra=extra)
                restored = self._from_ram(refs, restored, breakdown)
                if restored.matched < prompt_tokens:
                    restored = self._lookup_and_restore(session, tokens, refs, known, use_catalog, restored)
                elif breakdown.tier != Tier.NONE:
                    breakdown.decision = Decision.LOCAL
            matched = restored.matched
            breakdown.classify(restored.served, prompt_tokens)

            # P-decode: only what was not restored, in the batches of the grid. The entry at the
            # prompt's end keeps the top logits of its last position (no extra model work): the
            # same prompt later is a full hit with no decode at all.
            boundary_logits: dict[int, np.ndarray] = dict(restored.logits)
            exports: Exports = dict(restored.exports)
            if matched < prompt_tokens:
                self._on_stage("prefilling")
                on_batch = self._exporter(boundaries, matched, exports) if session is not None else None
                mark = time.perf_counter()
                boundary_logits.update(
                    engine.prefill(tokens[matched:], matched, logits_at={prompt_tokens - 1}, on_batch=on_batch, cuts=grid_cuts(prompt_tokens, self.chunk_tokens, matched, extra))
                )
                breakdown.prefill_ms += ms_since(mark)

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
            self._finish_loading(restored, breakdown)
            breakdown.redis_ms = breakdown.fetch_ms + breakdown.restore_ms

            uploaded = []
            if session is not None and upload and breakdown.cachebox == CacheBoxState.OK:
                uploaded = self._upload(session, tokens, refs, known, boundary_logits, exports)
                session.touch(restored.entries)
            elif session is not None and self.ram is not None:
                self._keep_in_ram(session, tokens, refs, boundary_logits, exports)
            breakdown.state_bytes = breakdown.fetched_bytes + breakdown.uploaded_bytes
            self._learn(breakdown, restored)
            if use_cache:  # what the engine holds now: the next prompt's context, or a conversation's (extend)
                stored = (restored.top_ids, restored.top_logits) if restored.top_ids is not None else None
                self._context = Context.after(tokens, engine.claim_main(), boundary_logits.get(prompt_tokens - 1), stored, self.top_logits, extra)
            else:
                self._context = None
            return RunResult(text=text, tokens=generated, breakdown=breakdown, fetched=restored.entries, uploaded=uploaded)

    def extend(self, tokens: Sequence[int], cuts: Sequence[int] = (), *, namespace: str | None = None, upload: bool = True) -> Extension:
        """Carry the last run's prompt on to ``tokens``: a conversation's next prefix (the prompt,
        the answer as the client will send it back, the opening of the next turn).

        The answer's cells came one token per batch while decoding; the next turn's cold run
        computes them as one batch. So they are dropped and computed again on that turn's cuts,
        after the answer is out: the next turn then resumes there with the very bits of its cold
        run, from this board's context or, uploaded, from the cache box on another board.
        Does nothing (``Extension.tokens == 0``) when the engine no longer holds that prompt.
        """
        namespace = check_namespace(namespace or self.namespace)
        engine = self.engine
        tokens = list(tokens)
        with engine.lock:
            context = self._context
            held = len(context.tokens) if context is not None else 0
            extra = tuple(cut for cut in off_grid(cuts, self.chunk_tokens) if cut < len(tokens))
            if (
                context is None
                or context.generation != engine.generation
                or len(tokens) <= held
                or len(tokens) > engine.n_ctx
                or tokens[:held] != context.tokens
                or [cut for cut in extra if cut < held] != [cut for cut in context.extra if cut < held]
                or (held % self.chunk_tokens and held not in extra)
            ):
                return Extension()
            self._context = None
            started = time.perf_counter()
            engine.remove(MAIN_SEQ, held, -1)  # the answer's cells, decoded one by one
            boundaries = range_boundaries(len(tokens), self.chunk_tokens, extra)
            exports: Exports = {}
            engine.prefill(tokens[held:], held, on_batch=self._exporter(boundaries, held, exports), cuts=grid_cuts(len(tokens), self.chunk_tokens, held, extra))
            self._context = Context(tokens, engine.claim_main(), extra=extra)
            computed_ms = ms_since(started)
            uploaded: list[StoredEntry] = []
            breakdown = Breakdown()
            session = run_session(self.exchange, namespace, breakdown, True)
            if session is not None:
                refs = prefix_refs(namespace, engine.fingerprint, tokens, boundaries, grid=self.chunk_tokens, extra=extra)
                if upload and breakdown.cachebox == CacheBoxState.OK:
                    uploaded = self._upload(session, tokens, refs, set(), {}, exports)
                else:
                    self._keep_in_ram(session, tokens, refs, {}, exports)
            return Extension(len(tokens) - held, round(computed_ms, 3), round(ms_since(started), 3), uploaded)

    # -- steps ----------------------------------------------------------------------------
    def _from_context(self, tokens: list[int], extra: tuple[int, ...], breakdown: Breakdown, use_cache: bool) -> _Restored:
        """Keep what the engine still holds of the last prompt, up to the last shared cut."""
        engine = self.engine
        context, self._context = self._context, None  # only a run that completes leaves one again
        if not (self.context_reuse and use_cache and context is not None and context.generation == engine.generation):
            engine.clear()
            return _Restored()
        mark = time.perf_counter()
        reuse = context.reusable(tokens, self.chunk_tokens, extra)
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
        """Extend what the board holds (``held``: its context or RAM tier) from the cache box:
        load the chain of ranges, computing the front of it meanwhile when that is faster."""
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
        # Before any round trip: would even the best plan beat computing, at the sizes seen so far?
        guess = [Range(ref.start, ref.end, int((ref.end - ref.start) * self.bytes_per_token)) for ref in refs if floor < ref.end <= longest]
        if not self._planned(self.policy.plan(floor, guess), breakdown):
            return held

        def expect(ref: EntryRef, header: EntryHeader) -> None:
            if header.end != ref.end or header.start >= ref.end:
                raise EntryError(f"entry covers [{header.start}, {header.end}), expected a range ending at {ref.end}")
            if header.tokens_digest != tokens_digest(tokens[header.start : header.end]):
                raise EntryError("entry does not belong to these tokens")

        by_end = {ref.end: ref for ref in refs}
        heads = session.read_headers(candidates[::-1], expect)
        headers = {ref.end: heads[ref.name] for ref in candidates if ref.name in heads}
        if heads:  # what entries here really weigh (codec included): the next pre-plan's guess
            seen = sum(header.state_bytes for header in heads.values()) / sum(header.token_count for header in heads.values())
            self.bytes_per_token = 0.5 * self.bytes_per_token + 0.5 * seen

        def read_link(end: int) -> EntryHeader | None:
            # A range stored by a prompt cut differently: read that link's header too.
            (by_end[end],) = prefix_refs(session.namespace, self.engine.fingerprint, tokens, [end], grid=self.chunk_tokens, extra=self._extra)
            return session.read_headers([by_end[end]], expect).get(by_end[end].name)

        ends = plan_chain(headers, read_link, floor)
        if ends and ends[-1] == len(tokens) and headers[ends[-1]].top_ids is None:
            # Stored by a longer prompt for which this end was a grid point: no logits with it.
            # Resume one link earlier and compute the last batch, as the cold run does.
            ends = ends[:-1]
        chain = [by_end[end] for end in ends]
        chain = session.within_budget(chain, {by_end[end].name: header for end, header in headers.items()})
        if not chain:
            if breakdown.cachebox == CacheBoxState.OK:
                breakdown.decision = Decision.NO_USABLE_ENTRY
            return held
        # The real sizes are known now (compressed entries are smaller): plan again.
        plan = self.policy.plan(floor, [Range(headers[ref.end].start, ref.end, headers[ref.end].state_bytes) for ref in chain])
        if not self._planned(plan, breakdown):
            return held
        self._starts = {ref.end: headers[ref.end].start for ref in chain}
        restored = self._load(session, tokens, chain, expect, floor, plan)
        if restored.served <= floor:
            if breakdown.cachebox == CacheBoxState.OK:
                breakdown.decision = Decision.DEADLINE if breakdown.fetch_late else Decision.NO_USABLE_ENTRY
            restored.top_ids, restored.top_logits = (held.top_ids, held.top_logits) if restored.matched == held.matched else (None, None)
            return restored
        session.record_hits(len(restored.entries))
        breakdown.decision = Decision.FETCH
        breakdown.tier = Tier.CACHEBOX
        return restored

    def _planned(self, plan: FetchPlan, breakdown: Breakdown) -> bool:
        """Record the policy's forecast; False (said on the breakdown) when computing wins."""
        breakdown.predicted_fetch_ms = round(plan.predicted_ms if plan.fetch else plan.predicted_fetch_ms, 3)
        breakdown.predicted_prefill_ms = round(plan.predicted_prefill_ms, 3)
        if not plan.fetch:
            breakdown.decision = Decision.POLICY_SKIP  # recomputing is forecast to be faster on this board and link
        return plan.fetch

    def _load(self, session: ExchangeSession, tokens: list[int], chain: list[EntryRef], expect, floor: int, plan: FetchPlan) -> _Restored:
        """Get ``chain`` into the context, by the plan.

        ``plan.split == floor``: load the ranges front to back, restoring each as soon as it
        arrives; one later than forecast (the deadline) ends the wait, and the rest is computed.
        (On a fast link, the whole chain in one request.)
        Otherwise: load them back to front in a thread while the front is computed here, batch
        by batch on the grid, until the two meet; the loaded ranges then join the context.
        They are restored at the meeting, in position order, not on arrival: llama.cpp sums
        attention over cells in the order they sit in the cache, so cells restored out of order
        would give other bits than the cold run (restoring is a memory copy, ~1 ms a range).
        Verification and decoding happen in the loader, as each range arrives.
        A range that is missing or fails verification stops the loading; the rest is computed.
        """
        breakdown = session.breakdown
        breakdown.planned_split = plan.split
        forward = plan.split <= floor
        self._on_stage("fetching")
        if forward and plan.predicted_fetch_ms < AT_ONCE_MS:
            restored = self._load_at_once(session, chain, expect, floor)
        else:
            # An engine on every core stalls when a thread of it is preempted: then the loader only
            # downloads while the board computes, and the ranges are checked at the meeting.
            check = forward or self.engine.config.threads() < (os.cpu_count() or 1)
            loader = RangeLoader(session, chain if forward else chain[::-1], expect, check=check)  # one request per range
            loader.computed_to = floor
            started = time.perf_counter()
            loader.start()
            if forward:
                restored = self._load_in_order(session, loader, plan, floor, started)
            else:
                starts = [self._starts[ref.end] for ref in chain]
                restored = self._load_while_computing(session, tokens, loader, chain[-1].end, floor, plan, sorted(starts, reverse=True), started, expect)
            loader.stop()
            restored.loader = loader
        breakdown.met_at = floor + restored.computed if not forward else restored.matched  # where computing took over
        if not forward and restored.computed > plan.split - floor + self.chunk_tokens:
            breakdown.fetch_late = True  # the loads came slower than forecast: compute went past the plan
        if self.ram is not None:
            for name, item in restored.used.items():
                self.ram.put(name, item.header, item.state, item.state_offset)
        return restored

    def _load_at_once(self, session: ExchangeSession, chain: list[EntryRef], expect, floor: int) -> _Restored:
        """A fast link: the whole chain in one request (one round trip), restored in order."""
        mark = time.perf_counter()
        fetched = session.fetch(chain, expect, chain=True)
        elapsed = ms_since(mark)
        total = sum(len(item.blob) for item in fetched) or 1
        arrivals = [Arrival(item, elapsed * len(item.blob) / total, elapsed) for item in fetched]  # each range's share, to learn the rate
        matched, used = self._restore_in_order(session, fetched, floor)
        return self._restored(matched, 0, used, arrivals, {}, {})

    def _restore_in_order(self, session: ExchangeSession, items, matched: int, used: dict[str, Fetched] | None = None) -> tuple[int, dict[str, Fetched]]:
        """Restore ``items`` (position order) while each starts where the context ends; stop at a
        gap or a refusal, dropping a partly restored range. Returns where the context ends now."""
        used = {} if used is None else used
        for item in items:
            if item.header.end <= matched:
                continue  # computed meanwhile
            if item.header.start != matched or not session.restore(self.engine, item, MAIN_SEQ, range(0, 1)):
                break
            matched = item.ref.end
            used[item.ref.name] = item
        if self.engine.positions(MAIN_SEQ)[1] != matched - 1:
            self.engine.remove(MAIN_SEQ, matched, -1)  # drop a partly restored range
        return matched, used

    def _load_in_order(self, session: ExchangeSession, loader: RangeLoader, plan: FetchPlan, floor: int, started: float) -> _Restored:
        """Wait for each range, front to back, restoring it on arrival; stop at the deadline."""
        breakdown, matched, used = session.breakdown, floor, {}
        arrivals: list[Arrival] = []
        while True:
            deadline = plan.deadline_ms(len(arrivals))
            timeout = None if deadline is None else max(0.0, deadline - ms_since(started)) / 1000.0
            got = loader.take(timeout)
            if got is None:  # later than forecast: compute the rest (the deadline)
                breakdown.fetch_late = True
                break
            if got is DONE:
                break
            arrivals.append(got)
            restored_to, used = self._restore_in_order(session, [got.item], matched, used)
            if restored_to == matched:
                break
            matched = restored_to
        return self._restored(matched, 0, used, arrivals, {}, {})

    def _load_while_computing(
        self, session: ExchangeSession, tokens: list[int], loader: RangeLoader, end: int, floor: int, plan: FetchPlan, starts: list[int], started: float, expect
    ) -> _Restored:
        """Compute from ``floor`` while ranges arrive from ``end`` backwards; meet; restore in order.

        Before each batch: when the ranges down to where computing stands are forecast to arrive
        before that batch would end, wait for them (up to their deadline) instead: a batch once
        started cannot stop, and one that the loads overtake is wasted. ``starts``: the ranges'
        starts in load order."""
        engine, breakdown, total = self.engine, session.breakdown, len(tokens)
        computed, loaded_from, done = floor, end, False
        arrivals: list[Arrival] = []
        logits: dict[int, np.ndarray] = {}
        exports: Exports = {}
        on_batch = self._exporter(range_boundaries(total, self.chunk_tokens, self._extra), floor, exports)
        while computed < loaded_from:
            stop = ([*grid_cuts(total, self.chunk_tokens, computed, self._extra), total])[0]
            patience = 0.0
            if not done:
                # The arrival that would bring the loaded ranges down to ``computed``, and when it is due.
                needed = sum(1 for start in starts if start >= computed) - 1
                due = plan.arrivals_ms[needed] if 0 <= needed < len(plan.arrivals_ms) else None
                elapsed = ms_since(started)
                if due is not None and due <= elapsed + self.policy.predict_prefill_ms(stop - computed):
                    patience = max(0.0, plan.deadline_ms(needed) - plan.slack_ms + 25.0 - elapsed) / 1000.0
            got = None if done else loader.take(patience)
            if got is DONE:
                done = True
                continue
            if got is not None:
                range_end = got.item.ref.end
                if range_end != loaded_from or range_end <= computed:
                    loader.stop()  # computed past it: nothing later can be used either
                    done = True
                    continue
                arrivals.append(got)
                loaded_from = self._starts[range_end]
                continue
            if patience > 0:
                breakdown.fetch_late = True  # waited past the forecast: compute instead
            # One grid batch of the front, as the cold run computes it.
            if computed == floor:
                self._on_stage("prefilling")
            mark = time.perf_counter()
            logits.update(engine.prefill(tokens[computed:stop], computed, logits_at={total - 1} if stop == total else set(), on_batch=on_batch))
            breakdown.prefill_ms += ms_since(mark)
            computed = loader.computed_to = stop
        loader.stop()
        matched, used, recomputed = computed, {}, 0
        for arrival in sorted((arrival for arrival in arrivals if arrival.item.ref.end > computed), key=lambda arrival: arrival.item.ref.end):
            item = arrival.settle(session, expect)  # verified here when the loader only downloaded
            if item is None:  # refused (and evicted): compute that range, on the grid, and go on
                range_end = arrival.item.ref.end
                mark = time.perf_counter()
                logits.update(engine.prefill(tokens[matched:range_end], matched, logits_at={total - 1} if range_end == total else set(), on_batch=on_batch, cuts=grid_cuts(total, self.chunk_tokens, matched, self._extra)))
                breakdown.prefill_ms += ms_since(mark)
                recomputed += range_end - matched
                matched = range_end
                continue
            restored_to, used = self._restore_in_order(session, [item], matched, used)
            if restored_to == matched:
                break
            matched = restored_to
        return self._restored(matched, computed - floor + recomputed, used, arrivals, logits, exports)

    def _restored(self, matched: int, computed: int, used: dict[str, Fetched], arrivals, logits, exports) -> _Restored:
        last = max((item.header for item in used.values()), key=lambda header: header.end, default=None)
        full = last is not None and last.end == matched and last.top_ids is not None
        return _Restored(
            matched,
            last.top_ids if full else None,
            last.top_logits if full else None,
            list(used),
            computed=computed,
            logits=logits,
            exports=exports,
            arrivals=arrivals,
            used=used,
        )

    def _finish_loading(self, restored: _Restored, breakdown: Breakdown) -> None:
        """After the answer: let the loader end (it may be finishing a request nobody needs), then
        learn the link's rate from each range's own request."""
        if restored.loader is not None:
            restored.loader.stop()
            restored.loader.join(timeout=30.0)  # bounded by the cache box client's own I/O timeout
        for arrival in restored.arrivals:
            self.policy.observe_fetch(len(arrival.item.blob), arrival.ms)

    def _learn(self, breakdown: Breakdown, restored: _Restored) -> None:
        """Feed this run's measured costs to the break-even policy."""
        self.policy.observe_prefill(breakdown.prompt_tokens - breakdown.matched_tokens, breakdown.prefill_ms)
        loaded = sum(item.header.token_count for item in restored.used.values())
        if loaded and breakdown.fetched_bytes:
            self.bytes_per_token = 0.8 * self.bytes_per_token + 0.2 * breakdown.fetched_bytes / loaded

    def _exporter(self, boundaries: list[int], start: int, exports: Exports):
        """A prefill callback that copies each new range out as soon as it is computed.

        Exporting later (after the answer) would be too late for sliding-window layers:
        llama.cpp reuses the cells that no later token can see (about 0.1 ms per MB).
        """
        pending = [end for end in boundaries if end > start]
        begin = [start]

        def export_ready(next_position: int) -> None:
            while pending and pending[0] <= next_position:
                end = pending.pop(0)
                exports[end] = (begin[0], self.engine.export_range(begin[0], end))
                begin[0] = end

        return export_ready

    def _sealed(self, session: ExchangeSession, tokens, refs: list[EntryRef], known: set[bytes], boundary_logits, exports: Exports) -> list[tuple[EntryRef, bytes, bool, bytes]]:
        """(range, signed entry, whether the cache box needs it, state) for each range this run computed.

        A range the cache box already holds (the policy chose to recompute, or computed the
        front while the rest loaded) is sealed only for the RAM tier, and is not uploaded twice."""
        items: list[tuple[EntryRef, bytes, bool, bytes]] = []
        for ref in refs:
            if ref.end not in exports:
                continue  # not computed in this run
            start, state = exports[ref.end]
            needed = not (ref.key in known and ref.name not in session.missing)
            if needed or self.ram is not None:
                stored = EntryRef(start, ref.end, ref.key, ref.name)
                items.append((stored, session.seal(stored, state, tokens_digest(tokens[start : ref.end]), boundary_logits.get(ref.end - 1), self.top_logits), needed, state))
        return items

    def _remember(self, session: ExchangeSession, items) -> None:
        """Keep this run's own entries in the RAM tier, as states (sealed here: nothing to verify)."""
        if self.ram is None:
            return
        for ref, blob, _, state in items:
            header, _ = decode_header(blob)
            header.open_private(session.ring)  # sealed here a moment ago: its top logits serve a repeat
            self.ram.put(ref.name, header, state, 0)

    def _keep_in_ram(self, session: ExchangeSession, tokens, refs, boundary_logits, exports: Exports) -> None:
        self._remember(session, self._sealed(session, tokens, refs, set(), boundary_logits, exports))

    def _upload(self, session: ExchangeSession, tokens, refs: list[EntryRef], known: set[bytes], boundary_logits, exports: Exports) -> list:
        """Store the ranges this run computed (after the answer is out), in RAM and in the cache box.

        A few ranges at a time (``UPLOAD_GROUP_BYTES``): each group is sealed, sent in one round
        trip and let go before the next, and without a RAM tier each range's exported state goes
        as soon as it is sealed. On a small board the sealed and packed copies of a whole prompt's
        states would otherwise be most of its spare memory."""
        mark = time.perf_counter()
        uploaded: list = []
        for group in _upload_groups(refs, exports, UPLOAD_GROUP_BYTES):
            items = self._sealed(session, tokens, group, known, boundary_logits, exports)
            self._remember(session, items)
            if self.ram is None:
                for ref in group:
                    exports.pop(ref.end, None)
            wanted = [(ref, blob) for ref, blob, needed, _ in items if needed]
            del items
            stored = session.share(wanted, chain=True)
            uploaded += stored
            if len(stored) < len(wanted):
                break  # a range was left out or the cache box failed: later ranges would link to a missing one
        session.breakdown.upload_ms = ms_since(mark)
        return uploaded

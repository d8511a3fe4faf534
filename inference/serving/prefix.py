"""Prefix serving: the paper's steps with a timer around each, over the board's tiers.

tokenize -> the tiers, nearest first (the board's context, its RAM, the cache box: catalog
lookup of every candidate range, fetch of the longest range the cache box really holds,
verified and restored) -> prefill only the rest -> sample the first token (TTFT) -> decode the
rest (TTLT) -> after the answer, each tier keeps what it wants (the cache box: the new ranges,
uploaded and announced to every board's catalog).

A cached answer is the cold answer, bit for bit. llama.cpp's CPU kernels round differently
for different batch shapes while restoring state bytes is exact, so every prefill here
(cold or resumed) cuts its batches at the same absolute positions, every ``grid`` tokens;
ranges are stored at those positions (and at the prompt's end) and their keys include the
grid. A run that resumes from a stored range then computes exactly the batches its cold run
would have, and gets the same logits.

Where states are looked up, restored and kept is the tiers' work (``inference.tiers``; the
cache box's through ``inference.serving.exchange``); this strategy says which ranges a prompt has. A
cache box that is down, a catalog false positive, or a corrupted entry never changes the
answer: the run falls back to local prefill and says so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from cachebox.keys import check_namespace, grid_cuts, off_grid, range_boundaries
from inference.contract.messages import StoredEntry
from inference.engine.llama import MAIN_SEQ, Engine
from inference.engine.sampling import TOP_CANDIDATES
from inference.serving.breakdown import CROSS_CLASS, Breakdown
from inference.serving.breakeven import BreakEvenPolicy
from inference.serving.exchange import Exchange, prefix_refs, run_session
from inference.serving.run import (
    FirstToken,
    RunResult,
    RunState,
    ServingStrategy,
    ms_since,
    segment_tokens,
    text_layout,
)
from inference.tiers import (
    CacheBoxTier,
    Computed,
    ContextTier,
    Held,
    RamTier,
    Tier,
    TierRun,
    keep_nearest_first,
    restore_nearest_first,
)
from inference.tiers.base import Exports
from inference.tiers.flash import FlashTier


@dataclass
class Extension:
    """What ``PrefixServing.extend`` added to the context: tokens computed, in how long, what it shared."""

    tokens: int = 0
    compute_ms: float = 0.0
    total_ms: float = 0.0  # with sealing and upload
    uploaded: list[StoredEntry] = field(default_factory=list)
    prefix: tuple[int, ...] = ()  # the whole prefix the context now holds (a conversation's next turn)


@dataclass
class _PrefixRun:
    """One run between the skeleton's steps: the prompt as its tiers see it, then what they held."""

    tiers: TierRun
    namespace: str
    held: Held = field(default_factory=Held)
    logits: dict[int, np.ndarray] = field(default_factory=dict)  # by position, as computed
    exports: Exports = field(default_factory=dict)
    cross_class: bool = (
        False  # restored a state another kernel class computed: approximate, nothing it computes is kept
    )

    @property
    def prompt_tokens(self) -> int:
        return self.tiers.prompt_tokens


def _quiet(stage: str) -> None:
    pass


class PrefixServing(ServingStrategy[_PrefixRun]):
    """Serves prompts on one engine, reusing the longest prefix its tiers hold (exact)."""

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
        flash_tier_bytes: int = 0,
        flash_dir: Path | None = None,
        ram_rss_limit_bytes: int | None = None,
    ):
        self.engine = engine
        self.exchange = exchange
        if chunk_tokens < 1 or engine.config.n_batch % chunk_tokens:
            raise ValueError(
                f"the batch grid ({chunk_tokens} tokens) must divide the batch size {engine.config.n_batch}"
            )
        self.chunk_tokens = chunk_tokens  # the grid: batches are cut, and ranges stored, every this many tokens
        self.top = top_logits
        self.namespace = check_namespace(namespace)
        self.context = ContextTier(context_reuse)  # keeps the last prompt in the engine for the next one
        self.ram = RamTier(ram_tier_bytes, ram_rss_limit_bytes) if ram_tier_bytes > 0 else None
        if flash_tier_bytes > 0 and flash_dir is None:
            raise ValueError("a flash tier needs its folder (flash_dir)")
        self.flash = FlashTier(flash_dir, flash_tier_bytes) if flash_tier_bytes > 0 else None
        # An engine on every core stalls when one of its threads is preempted: its loader then only downloads.
        loader_checks = engine.config.threads() < (os.cpu_count() or 1)
        self.cachebox = CacheBoxTier(
            policy or BreakEvenPolicy(), engine.state_bytes_per_token, loader_checks=loader_checks
        )

    @property
    def tiers(self) -> list[Tier]:
        """Where a run's state may come from, nearest first (a new tier takes its place here)."""
        return [tier for tier in (self.context, self.ram, self.flash, self.cachebox) if tier is not None]

    @property
    def policy(self) -> BreakEvenPolicy:
        """The break-even policy that decides what to fetch from the cache box (and learns from every run)."""
        return self.cachebox.policy

    @policy.setter
    def policy(self, policy: BreakEvenPolicy) -> None:
        self.cachebox.policy = policy

    def layout(self, segments: Sequence[str]) -> tuple[list[int], tuple[int, ...]]:
        """A text prompt's tokens and where they are cut besides the grid (``serving.text_layout``)."""
        return text_layout(self.engine, segments)

    def tokenize(self, segments: Sequence[str]) -> tuple[list[int], list[int]]:
        """Token ids of the whole prompt and the token index where each segment ends.

        Segments are tokenized one by one, so a segment's tokens (and so its cache key)
        do not depend on the text that follows it.
        """
        return segment_tokens(self.engine, segments)

    # -- the skeleton's steps --------------------------------------------------------------------
    def prepare(self, run: RunState) -> _PrefixRun:
        """The prompt's tokens and cuts. Batches end on the grid, where the last segment and its
        last paragraph begin (``layout``: a prompt that shares all but those with this one reuses
        that part whole), and at the prompt's ``cuts`` (a chat's: where its messages begin, ``inference.engine.chat``, so the next
        turn of a conversation reuses this one whole). Not at every segment end: small batches
        made cold prefill 24-41% slower (``bench exact``)."""
        prompt, options = run.prompt, run.options
        namespace = check_namespace(options.namespace or self.namespace)
        tokens, text_cuts = self.layout(prompt.segments) if prompt.tokens is None else (list(prompt.tokens), ())
        extra = tuple(cut for cut in off_grid([*prompt.cuts, *text_cuts], self.chunk_tokens) if cut < len(tokens))
        boundaries = range_boundaries(len(tokens), self.chunk_tokens, extra)
        tiers = TierRun(
            self.engine,
            tokens,
            self.chunk_tokens,
            extra,
            boundaries,
            run.breakdown,
            use_cache=options.use_cache,
            top=self.top,
            use_catalog=options.use_catalog,
            on_stage=options.on_stage or _quiet,
        )
        return _PrefixRun(tiers, namespace)

    def first_token(self, run: RunState, prefix: _PrefixRun) -> FirstToken:
        """Restore what the tiers hold, nearest first; prefill the rest on the grid."""
        tiers, breakdown, engine = prefix.tiers, run.breakdown, self.engine
        breakdown.link = self.exchange.link_label if self.exchange is not None else ""
        tiers.session = run_session(self.exchange, prefix.namespace, breakdown, run.options.use_cache)
        if tiers.session is not None:
            tiers.refs = prefix_refs(
                prefix.namespace,
                engine.fingerprint,
                tiers.tokens,
                tiers.boundaries,
                grid=self.chunk_tokens,
                extra=tiers.extra,
            )
        held = prefix.held = restore_nearest_first(self.tiers, tiers)
        if held.served == 0 and tiers.session is not None and run.options.approximate_from:
            held = prefix.held = self._cross_class(run, prefix)
        total = tiers.prompt_tokens
        breakdown.classify(held.served, total)
        # P-decode: only what was not restored, in the batches of the grid. The entry at the
        # prompt's end keeps the top logits of its last position (no extra model work): the
        # same prompt later is a full hit with no decode at all.
        prefix.logits, prefix.exports = dict(held.logits), dict(held.exports)
        if held.matched < total:
            tiers.on_stage("prefilling")
            on_batch = (
                tiers.exporter(held.matched, prefix.exports)
                if tiers.session is not None and not prefix.cross_class
                else None
            )
            mark = time.perf_counter()
            cuts = grid_cuts(total, self.chunk_tokens, held.matched, tiers.extra)
            prefix.logits.update(
                engine.prefill(
                    tiers.tokens[held.matched :], held.matched, logits_at={total - 1}, on_batch=on_batch, cuts=cuts
                )
            )
            breakdown.prefill_ms += ms_since(mark)
        # The first token: from fresh logits, or from the ones stored with a full hit.
        return FirstToken(prefix.logits.get(total - 1), (held.top_ids, held.top_logits), position=total)

    def finish(self, run: RunState, prefix: _PrefixRun, first: FirstToken, result: RunResult) -> None:
        """After the answer: every tier keeps what it wants of this run."""
        computed = Computed(prefix.tiers, prefix.held, prefix.logits, prefix.exports, upload=run.options.upload)
        if prefix.cross_class:  # not this class's bits: no tier keeps them (the context tier forgot them at lookup)
            computed.held.settle()
        else:
            keep_nearest_first(self.tiers, computed)
        breakdown = run.breakdown
        breakdown.redis_ms = breakdown.fetch_ms + breakdown.restore_ms
        breakdown.state_bytes = breakdown.fetched_bytes + breakdown.uploaded_bytes
        result.fetched, result.uploaded = prefix.held.entries, computed.uploaded

    def _cross_class(self, run: RunState, prefix: _PrefixRun) -> Held:
        """Where the board's own tiers hold nothing of the prompt and its namespace shares across
        kernel classes: the longest prefix the cache box holds under another class's fingerprint of
        the same model (``RunOptions.approximate_from``), restored. Approximate: the run says so
        (``Breakdown.approximate``, the class it came from) and keeps nothing (``finish``)."""
        tiers, breakdown = prefix.tiers, run.breakdown
        own = tiers.session, tiers.refs
        try:
            for fingerprint, kernel_class in run.options.approximate_from.items():
                if fingerprint == self.engine.fingerprint or self.exchange is None:
                    continue
                tiers.session = run_session(self.exchange.reading_as(fingerprint), prefix.namespace, breakdown, True)
                if tiers.session is None:
                    break
                tiers.refs = prefix_refs(
                    prefix.namespace,
                    fingerprint,
                    tiers.tokens,
                    tiers.boundaries,
                    grid=self.chunk_tokens,
                    extra=tiers.extra,
                )
                held = restore_nearest_first([self.cachebox], tiers)
                if held.served:
                    prefix.cross_class = True
                    breakdown.approximate, breakdown.approximate_from = CROSS_CLASS, kernel_class
                    return held
        finally:
            tiers.session, tiers.refs = own
        return Held()

    # -- a conversation's next prefix ------------------------------------------------------------
    def extend(
        self, tokens: Sequence[int], cuts: Sequence[int] = (), *, namespace: str | None = None, upload: bool = True
    ) -> Extension:
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
            context = self.context.held
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
            self.context.held = None
            started = time.perf_counter()
            engine.remove(MAIN_SEQ, held, -1)  # the answer's cells, decoded one by one
            breakdown = Breakdown()
            run = TierRun(
                engine,
                tokens,
                self.chunk_tokens,
                extra,
                range_boundaries(len(tokens), self.chunk_tokens, extra),
                breakdown,
                top=self.top,
            )
            exports: Exports = {}
            engine.prefill(
                tokens[held:],
                held,
                on_batch=run.exporter(held, exports),
                cuts=grid_cuts(len(tokens), self.chunk_tokens, held, extra),
            )
            computed_ms = ms_since(started)
            run.session = run_session(self.exchange, namespace, breakdown, True)
            if run.session is not None:
                run.refs = prefix_refs(
                    namespace, engine.fingerprint, tokens, run.boundaries, grid=self.chunk_tokens, extra=extra
                )
            computed = Computed(run, Held(), {}, exports, upload=upload)
            keep_nearest_first(self.tiers, computed)  # the context now holds them; the RAM tier and the cache box too
            return Extension(
                len(tokens) - held, round(computed_ms, 3), round(ms_since(started), 3), computed.uploaded, tuple(tokens)
            )

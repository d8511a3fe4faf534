"""The farthest tier: the cache box, over the link, through the exchange (``inference.serving.exchange``).

Lookup: the catalog's "maybe"s (no network), the headers of the candidate ranges (one round
trip), the longest chain that really connects to what the board holds, and the break-even
policy's plan (fetch it, compute it, or compute the front while the back loads: Cake's idea,
``inference.serving.overlap``). Restore: load the chain by the plan. Keep: upload the ranges the cache
box lacks (after the answer) and learn the link's and the board's rates for the next plan.

A cache box that is down, a catalog false positive, or a corrupted entry never changes the
answer: the run computes what was not restored, and says so on its breakdown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from cachebox.entry import EntryHeader
from cachebox.errors import EntryError
from cachebox.keys import grid_cuts, tokens_digest
from inference.contract.messages import StoredEntry
from inference.engine.llama import MAIN_SEQ
from inference.serving.breakdown import Breakdown, CacheBoxState, Decision
from inference.serving.breakdown import Tier as TierLabel
from inference.serving.breakeven import BreakEvenPolicy, FetchPlan, Range
from inference.serving.exchange import EntryRef, Expect, Fetched, plan_chain, prefix_refs
from inference.serving.overlap import DONE, Arrival, RangeLoader
from inference.serving.run import ms_since

from .base import Computed, Exports, Held, TierRun

# A chain forecast to arrive within this many ms comes in one request (one round trip): per-range
# requests, which let a slow link's ranges be restored as they arrive, only cost round trips here.
AT_ONCE_MS = 50.0
# Sealed states sent in one round trip at most: bounds what an upload holds besides the exports
# (a sealed copy and the client's packed copy of each state in flight).
UPLOAD_GROUP_BYTES = 2 * 1024 * 1024  # one 128-token range of Gemma-3 270M (2.4 MB) per round trip


@dataclass
class _Load:
    """What the cache box can add: the chain of ranges, where each starts, the check each entry
    must pass, and the policy's plan for loading them."""

    chain: list[EntryRef]
    starts: dict[
        int, int
    ]  # range end -> its start (a range stored by a prompt cut differently starts off this run's cuts)
    expect: Expect
    plan: FetchPlan


class CacheBoxTier:
    """Ranges any board stored, fetched over the link when the break-even policy says it pays."""

    label = TierLabel.CACHEBOX

    def __init__(self, policy: BreakEvenPolicy, bytes_per_token: float, *, loader_checks: bool):
        self.policy = policy
        self.bytes_per_token = bytes_per_token  # what a range weighs on the link; refined from every header read
        # False for an engine on every core, whose threads stall when one of them is preempted: a
        # loader then only downloads while the board computes, and ranges are checked at the meeting.
        self.loader_checks = loader_checks

    # -- lookup -----------------------------------------------------------------------------------
    def lookup(self, run: TierRun, held: Held) -> _Load | None:
        """The chain to load after what the board holds, and the plan; None (the breakdown says
        why) when there is none or computing is forecast to win."""
        session = run.session
        if session is None:
            return None
        breakdown, tokens, floor = run.breakdown, run.tokens, held.matched
        if floor >= run.prompt_tokens:
            breakdown.decision = Decision.LOCAL  # a nearer tier holds it all: no network at all
            return None
        candidates = session.maybe(run.refs, use_catalog=run.use_catalog)
        run.known.update(ref.key for ref in candidates)
        session.not_asked([ref for ref in candidates if ref.end <= floor], "held_on_board")
        candidates = [ref for ref in candidates if ref.end > floor]
        if not candidates:
            breakdown.decision = Decision.LOCAL if floor else Decision.CATALOG_MISS  # no network at all
            return None
        longest = candidates[-1].end
        breakdown.candidate_tokens = longest
        # Before any round trip: would even the best plan beat computing, at the sizes seen so far?
        guess = [
            Range(ref.start, ref.end, int((ref.end - ref.start) * self.bytes_per_token))
            for ref in run.refs
            if floor < ref.end <= longest
        ]
        if not self._planned(self.policy.plan(floor, guess), breakdown):
            session.not_asked(candidates, "policy_skipped")
            return None

        def expect(ref: EntryRef, header: EntryHeader) -> None:
            if header.end != ref.end or header.start >= ref.end:
                raise EntryError(f"entry covers [{header.start}, {header.end}), expected a range ending at {ref.end}")
            if header.tokens_digest != tokens_digest(tokens[header.start : header.end]):
                raise EntryError("entry does not belong to these tokens")

        by_end = {ref.end: ref for ref in run.refs}
        heads = session.read_headers(candidates[::-1], expect)
        headers = {ref.end: heads[ref.name] for ref in candidates if ref.name in heads}
        if heads:  # what entries here really weigh (codec included): the next pre-plan's guess
            seen = sum(header.state_bytes for header in heads.values()) / sum(
                header.token_count for header in heads.values()
            )
            self.bytes_per_token = 0.5 * self.bytes_per_token + 0.5 * seen

        def read_link(end: int) -> EntryHeader | None:
            # A range stored by a prompt cut differently: read that link's header too.
            (by_end[end],) = prefix_refs(
                session.namespace, run.engine.fingerprint, tokens, [end], grid=run.grid, extra=run.extra
            )
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
            return None
        # The real sizes are known now (compressed entries are smaller): plan again.
        plan = self.policy.plan(
            floor, [Range(headers[ref.end].start, ref.end, headers[ref.end].state_bytes) for ref in chain]
        )
        if not self._planned(plan, breakdown):
            return None
        return _Load(chain, {ref.end: headers[ref.end].start for ref in chain}, expect, plan)

    def _planned(self, plan: FetchPlan, breakdown: Breakdown) -> bool:
        """Record the policy's forecast; False (said on the breakdown) when computing wins."""
        breakdown.predicted_fetch_ms = round(plan.predicted_ms if plan.fetch else plan.predicted_fetch_ms, 3)
        breakdown.predicted_prefill_ms = round(plan.predicted_prefill_ms, 3)
        if not plan.fetch:
            breakdown.decision = Decision.POLICY_SKIP  # recomputing is forecast to be faster on this board and link
        return plan.fetch

    # -- restore ----------------------------------------------------------------------------------
    def restore(self, run: TierRun, load: _Load, held: Held) -> Held:
        """Load the chain after what the board holds (``held``: its context or RAM tier)."""
        breakdown = run.breakdown
        restored = self._load(run, load, held.matched)
        restored.used = {**held.used, **restored.used}  # what nearer tiers keep of this run's restores
        if restored.served <= held.matched:
            if breakdown.cachebox == CacheBoxState.OK:
                breakdown.decision = Decision.DEADLINE if breakdown.fetch_late else Decision.NO_USABLE_ENTRY
            restored.top_ids, restored.top_logits = (
                (held.top_ids, held.top_logits) if restored.matched == held.matched else (None, None)
            )
            return restored
        breakdown.decision = Decision.FETCH
        breakdown.tier = self.label
        return restored

    def _load(self, run: TierRun, load: _Load, floor: int) -> Held:
        """Get the chain into the context, by the plan.

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
        session, breakdown, chain, plan = run.session, run.breakdown, load.chain, load.plan
        breakdown.planned_split = plan.split
        forward = plan.split <= floor
        run.on_stage("fetching")
        if forward and plan.predicted_fetch_ms < AT_ONCE_MS:
            restored = self._load_at_once(run, load, floor)
        else:
            loader = RangeLoader(
                session, chain if forward else chain[::-1], load.expect, check=forward or self.loader_checks
            )  # one request per range
            loader.computed_to = floor
            started = time.perf_counter()
            loader.start()
            if forward:
                restored = self._load_in_order(run, loader, plan, floor, started)
            else:
                starts = sorted((load.starts[ref.end] for ref in chain), reverse=True)
                restored = self._load_while_computing(run, loader, load, floor, starts, started)
            loader.stop()
            restored.loader = loader
        breakdown.met_at = floor + restored.computed if not forward else restored.matched  # where computing took over
        if not forward and restored.computed > plan.split - floor + run.grid:
            breakdown.fetch_late = True  # the loads came slower than forecast: compute went past the plan
        return restored

    def _load_at_once(self, run: TierRun, load: _Load, floor: int) -> Held:
        """A fast link: the whole chain in one request (one round trip), restored in order."""
        mark = time.perf_counter()
        fetched = run.session.fetch(load.chain, load.expect, chain=True)
        elapsed = ms_since(mark)
        total = sum(len(item.blob) for item in fetched) or 1
        arrivals = [
            Arrival(item, elapsed * len(item.blob) / total, elapsed) for item in fetched
        ]  # each range's share, to learn the rate
        matched, used = self._restore_in_order(run, fetched, floor)
        return _restored(matched, 0, used, arrivals, {}, {})

    def _restore_in_order(
        self, run: TierRun, items, matched: int, used: dict[str, Fetched] | None = None
    ) -> tuple[int, dict[str, Fetched]]:
        """Restore ``items`` (position order) while each starts where the context ends; stop at a
        gap or a refusal, dropping a partly restored range. Returns where the context ends now."""
        used = {} if used is None else used
        for item in items:
            if item.header.end <= matched:
                continue  # computed meanwhile
            if item.header.start != matched or not run.session.restore(run.engine, item, MAIN_SEQ, range(0, 1)):
                break
            matched = item.ref.end
            used[item.ref.name] = item
        if run.engine.positions(MAIN_SEQ)[1] != matched - 1:
            run.engine.remove(MAIN_SEQ, matched, -1)  # drop a partly restored range
        return matched, used

    def _load_in_order(self, run: TierRun, loader: RangeLoader, plan: FetchPlan, floor: int, started: float) -> Held:
        """Wait for each range, front to back, restoring it on arrival; stop at the deadline."""
        matched, used = floor, {}
        arrivals: list[Arrival] = []
        while True:
            deadline = plan.deadline_ms(len(arrivals))
            timeout = None if deadline is None else max(0.0, deadline - ms_since(started)) / 1000.0
            got = loader.take(timeout)
            if got is None:  # later than forecast: compute the rest (the deadline)
                run.breakdown.fetch_late = True
                break
            if got is DONE:
                break
            arrivals.append(got)
            restored_to, used = self._restore_in_order(run, [got.item], matched, used)
            if restored_to == matched:
                break
            matched = restored_to
        return _restored(matched, 0, used, arrivals, {}, {})

    def _load_while_computing(
        self, run: TierRun, loader: RangeLoader, load: _Load, floor: int, starts: list[int], started: float
    ) -> Held:
        """Compute from ``floor`` while ranges arrive from the chain's end backwards; meet; restore in order.

        Before each batch: when the ranges down to where computing stands are forecast to arrive
        before that batch would end, wait for them (up to their deadline) instead: a batch once
        started cannot stop, and one that the loads overtake is wasted. ``starts``: the ranges'
        starts in load order."""
        engine, breakdown, tokens, plan = run.engine, run.breakdown, run.tokens, load.plan
        total = len(tokens)
        computed, loaded_from, done = floor, load.chain[-1].end, False
        arrivals: list[Arrival] = []
        logits: dict[int, np.ndarray] = {}
        exports: Exports = {}
        on_batch = run.exporter(floor, exports)
        while computed < loaded_from:
            stop = ([*grid_cuts(total, run.grid, computed, run.extra), total])[0]
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
                loaded_from = load.starts[range_end]
                continue
            if patience > 0:
                breakdown.fetch_late = True  # waited past the forecast: compute instead
            # One grid batch of the front, as the cold run computes it.
            if computed == floor:
                run.on_stage("prefilling")
            mark = time.perf_counter()
            logits.update(
                engine.prefill(
                    tokens[computed:stop],
                    computed,
                    logits_at={total - 1} if stop == total else set(),
                    on_batch=on_batch,
                )
            )
            breakdown.prefill_ms += ms_since(mark)
            computed = loader.computed_to = stop
        loader.stop()
        matched, used, recomputed = computed, {}, 0
        for arrival in sorted(
            (arrival for arrival in arrivals if arrival.item.ref.end > computed),
            key=lambda arrival: arrival.item.ref.end,
        ):
            item = arrival.settle(run.session, load.expect)  # verified here when the loader only downloaded
            if item is None:  # refused (and evicted): compute that range, on the grid, and go on
                range_end = arrival.item.ref.end
                mark = time.perf_counter()
                logits.update(
                    engine.prefill(
                        tokens[matched:range_end],
                        matched,
                        logits_at={total - 1} if range_end == total else set(),
                        on_batch=on_batch,
                        cuts=grid_cuts(total, run.grid, matched, run.extra),
                    )
                )
                breakdown.prefill_ms += ms_since(mark)
                recomputed += range_end - matched
                matched = range_end
                continue
            restored_to, used = self._restore_in_order(run, [item], matched, used)
            if restored_to == matched:
                break
            matched = restored_to
        return _restored(matched, computed - floor + recomputed, used, arrivals, logits, exports)

    # -- keep -------------------------------------------------------------------------------------
    def keep(self, computed: Computed) -> None:
        """Upload the ranges this run computed that the cache box lacks (after the answer is out),
        touch the entries it used, and learn this run's rates for the next plan."""
        run, held = computed.run, computed.held
        breakdown, session = run.breakdown, run.session
        for arrival in held.arrivals:  # the link's rate, from each range's own request
            self.policy.observe_fetch(len(arrival.item.blob), arrival.ms)
        if session is not None and computed.upload and breakdown.cachebox == CacheBoxState.OK:
            sealed_before, mark = computed.seal_ms, time.perf_counter()
            # A range the cache box already holds (the policy chose to recompute, or the front was
            # computed while the rest loaded) is not uploaded twice.
            needed = [
                ref for ref in computed.ranges() if not (ref.key in run.known and ref.name not in session.missing)
            ]
            computed.uploaded = self._upload(computed, needed)
            breakdown.upload_ms = sealed_before + ms_since(mark)
            session.touch(held.entries)
        self.policy.observe_prefill(breakdown.prompt_tokens - breakdown.matched_tokens, breakdown.prefill_ms)
        loaded = sum(held.used[name].header.token_count for name in held.entries)  # fetched from the cache box
        if loaded and breakdown.fetched_bytes:
            self.bytes_per_token = 0.8 * self.bytes_per_token + 0.2 * breakdown.fetched_bytes / loaded

    @staticmethod
    def _upload(computed: Computed, needed: list[EntryRef]) -> list[StoredEntry]:
        """A few ranges at a time (``UPLOAD_GROUP_BYTES``): each group sealed, sent in one round trip
        and let go before the next. On a small board the sealed and packed copies of a whole
        prompt's states would otherwise be most of its spare memory."""
        session, uploaded = computed.run.session, []
        for group in upload_groups(needed, {ref.end: len(computed.state(ref)) for ref in needed}, UPLOAD_GROUP_BYTES):
            wanted = [(ref, computed.sealed(ref)) for ref in group]
            stored = session.share(wanted, chain=True)
            del wanted
            for ref in group:
                computed.release(ref)
            uploaded += stored
            if len(stored) < len(group):
                break  # a range was left out or the cache box failed: later ranges would link to a missing one
        return uploaded


def upload_groups(refs: list[EntryRef], sizes: dict[int, int], limit: int) -> list[list[EntryRef]]:
    """``refs`` in order, in groups whose states (``sizes`` by range end) add up to ``limit`` bytes
    or just past it. Pure."""
    groups: list[list[EntryRef]] = [[]]
    size = 0
    for ref in refs:
        if size >= limit and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(ref)
        size += sizes.get(ref.end, 0)
    return [group for group in groups if group]


def _restored(matched: int, computed: int, used: dict[str, Fetched], arrivals, logits, exports) -> Held:
    last = max((item.header for item in used.values()), key=lambda header: header.end, default=None)
    full = last is not None and last.end == matched and last.top_ids is not None
    return Held(
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

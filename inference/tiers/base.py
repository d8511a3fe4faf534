"""The tier contract: where a prefix run's prompt state may come from, and the walk over them.

A tier holds prompt states (the KV cells of token ranges) somewhere: the engine's own context,
the board's RAM, the cache box. A run asks its tiers nearest first (``restore_nearest_first``):
each extends what the nearer ones restored, from where they stopped, until the prompt is held
or no tier has more; after the answer each keeps what it wants of the run
(``keep_nearest_first``). A tier implements ``Tier``:

- ``label``: what ``Breakdown.tier`` says when the furthest restored range came from it;
- ``lookup(run, held)``: what it can add right after ``held.matched`` (any object the tier's own
  ``restore`` understands), or None (also when a nearer tier holds the whole prompt); moves no
  state (the cache box may read headers for it);
- ``restore(run, found, held)``: put that into the engine's main sequence after ``held.matched``
  and return what is held now (``held.used`` carried on), or ``held`` when nothing could be
  restored; a range restored only in part is removed again. It records what it did on
  ``run.breakdown`` (``tier``, its time), and adds the verified entries it restored to ``used``
  when nearer tiers should keep them (the cache box does: the RAM tier keeps them);
- ``keep(computed)``: after the answer, keep what it wants: the ranges this run computed
  (``computed.ranges()``, sealed once for every tier by ``computed.sealed(ref)``) and the entries
  restored from farther tiers (``computed.held.used``).

Every range a tier restores ends where the run's batches end (the grid and ``run.extra``), so the
run resumed from any tier computes the cold run's batches and gives its bits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

from cachebox.keys import tokens_digest
from inference.contract.messages import StoredEntry
from inference.engine.llama import Engine
from inference.serving.breakdown import Breakdown
from inference.serving.breakdown import Tier as TierLabel
from inference.serving.exchange import EntryRef, ExchangeSession, Fetched
from inference.serving.run import ms_since

if TYPE_CHECKING:
    from inference.serving.overlap import Arrival, RangeLoader

Exports = dict[int, tuple[int, bytes]]  # range end -> (range start, state), taken as soon as computed


@dataclass
class Held:
    """What the engine's main sequence holds before the rest of the prompt is computed: ``[0, matched)``."""

    matched: int = 0
    top_ids: np.ndarray | None = None  # the top logits of the prompt's last position, when held whole with them
    top_logits: np.ndarray | None = None
    entries: list[str] = field(default_factory=list)  # cache-box entries restored (touched after the answer)
    computed: int = 0  # tokens of [0, matched) this run computed itself (the front, while loading)
    logits: dict[int, np.ndarray] = field(default_factory=dict)  # the last position's, when the front reached it
    exports: Exports = field(default_factory=dict)  # ranges computed while loading
    loader: RangeLoader | None = None  # may still be finishing a useless request: ended after the answer
    arrivals: list[Arrival] = field(default_factory=list)
    used: dict[str, Fetched] = field(
        default_factory=dict
    )  # verified entries restored from far tiers (nearer ones keep them)

    @property
    def served(self) -> int:
        return self.matched - self.computed

    def settle(self) -> None:
        """After the answer: let a loader that may still be finishing a request nobody needs end."""
        if self.loader is not None:
            self.loader.stop()
            self.loader.join(timeout=30.0)  # bounded by the cache box client's own I/O timeout


@dataclass
class TierRun:
    """One prefix run as its tiers see it: the prompt, where its batches end, and its exchange."""

    engine: Engine
    tokens: list[int]
    grid: int  # batches end (and ranges are stored) every this many tokens
    extra: tuple[int, ...]  # and at these cuts off the grid
    boundaries: list[int]  # where its ranges end
    breakdown: Breakdown
    use_cache: bool = True
    top: int = 0  # top logits an entry keeps of its last position
    session: ExchangeSession | None = None  # None: no cache box (off, unreachable configuration, no key)
    refs: list[EntryRef] = field(default_factory=list)  # the prompt's ranges in the namespace (with a session)
    use_catalog: bool = True
    on_stage: Callable[[str], None] = lambda stage: None  # hears "fetching" and "prefilling"
    known: set[bytes] = field(default_factory=set)  # keys the catalog says the cache box holds

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)

    def exporter(self, start: int, exports: Exports) -> Callable[[int], None]:
        """A prefill callback that copies each new range out as soon as it is computed.

        Exporting later (after the answer) would be too late for sliding-window layers:
        llama.cpp reuses the cells that no later token can see (about 0.1 ms per MB).
        """
        pending = [end for end in self.boundaries if end > start]
        begin = [start]

        def export_ready(next_position: int) -> None:
            while pending and pending[0] <= next_position:
                end = pending.pop(0)
                exports[end] = (begin[0], self.engine.export_range(begin[0], end))
                begin[0] = end

        return export_ready


@dataclass
class Computed:
    """What a run leaves for its tiers to keep, after the answer."""

    run: TierRun
    held: Held  # what the tiers restored (``used``: entries a nearer tier may keep too)
    logits: dict[int, np.ndarray]  # by position: the prompt's last one goes with the entry that ends there
    exports: Exports  # the ranges this run computed
    upload: bool = True  # False: leave the cache box as it was
    uploaded: list[StoredEntry] = field(default_factory=list)  # filled by the cache box's keep
    seal_ms: float = 0.0  # spent sealing, whichever tier asked
    _sealed: dict[int, bytes] = field(default_factory=dict)

    def ranges(self) -> list[EntryRef]:
        """The ranges this run computed, each from where this run's computing of it began."""
        computed = []
        for ref in self.run.refs:
            if ref.end in self.exports:
                computed.append(EntryRef(self.exports[ref.end][0], ref.end, ref.key, ref.name))
        return computed

    def state(self, ref: EntryRef) -> bytes:
        return self.exports[ref.end][1]

    def release(self, ref: EntryRef) -> None:
        """Let go of a range's sealed entry and exported state once every tier kept it (a tier
        that keeps the state holds its own reference)."""
        self._sealed.pop(ref.end, None)
        self.exports.pop(ref.end, None)

    def sealed(self, ref: EntryRef) -> bytes:
        """The signed entry of a computed range (sealed once, for whichever tier asks first)."""
        blob = self._sealed.get(ref.end)
        if blob is None:
            mark = time.perf_counter()
            run = self.run
            blob = run.session.seal(
                ref,
                self.state(ref),
                tokens_digest(run.tokens[ref.start : ref.end]),
                self.logits.get(ref.end - 1),
                run.top,
            )
            self._sealed[ref.end] = blob
            self.seal_ms += ms_since(mark)
        return blob


class Tier(Protocol):
    """One place prompt states live (see the module's docstring for the contract)."""

    label: TierLabel

    def lookup(self, run: TierRun, held: Held) -> object | None: ...

    def restore(self, run: TierRun, found: object, held: Held) -> Held: ...

    def keep(self, computed: Computed) -> None: ...


def restore_nearest_first(tiers: Sequence[Tier], run: TierRun) -> Held:
    """What the tiers hold of the prompt, restored into the engine's main sequence, nearest first:
    each tier extends what the nearer ones restored (the first, the context, also decides what
    of the engine's last sequence stays)."""
    held = Held()
    for tier in tiers:
        found = tier.lookup(run, held)
        if found is not None:
            before = held.served
            held = tier.restore(run, found, held)
            run.breakdown.restored(tier.label, held.served - before)
    return held


def keep_nearest_first(tiers: Sequence[Tier], computed: Computed) -> None:
    """After the answer: whatever the restore left running ends, then each tier keeps its part."""
    computed.held.settle()
    for tier in tiers:
        tier.keep(computed)

"""The board's RAM tier: range entries this board computed or fetched, kept next to the model in
an LRU under a byte budget (``local_tier.RamEntries``), verified once when they entered (sealed
here, or checked on fetch). A lookup restores a chain of them with no network.
"""

from __future__ import annotations

import time

from cachebox.entry import decode_header
from inference.engine.llama import MAIN_SEQ, EngineError
from inference.engine.proc_memory import rss_bytes
from inference.serving.breakdown import Tier as TierLabel
from inference.serving.exchange import EntryRef
from inference.serving.run import ms_since
from inference.tiers.local import LocalEntry, RamEntries

from .base import Computed, Held, TierRun


class RamTier:
    """Signed range entries in the board's memory, least recently used dropped first."""

    label = TierLabel.LOCAL

    def __init__(self, budget_bytes: int, rss_limit_bytes: int | None = None):
        """``rss_limit_bytes``: the process's RSS the tier keeps entries under (a board registered
        with its memory: its budget), read as entries come in; None: the byte budget alone."""
        self.entries = RamEntries(budget_bytes, rss_limit_bytes, rss_bytes if rss_limit_bytes is not None else None)

    def status(self) -> dict:
        return self.entries.status()

    def clear(self) -> None:
        self.entries.clear()

    def lookup(self, run: TierRun, held: Held) -> list[tuple[EntryRef, LocalEntry]] | None:
        """The chain of entries here that starts where ``held`` ends (entries are the exchange's: a run without one has none)."""
        if run.session is None:
            return None
        chain, matched = [], held.matched
        for ref in run.refs:
            if ref.end <= matched:
                continue
            entry = self.entries.get(ref.name)
            if entry is None or entry.header.start != matched:
                break
            chain.append((ref, entry))
            matched = ref.end
        return chain or None

    def restore(self, run: TierRun, found: list[tuple[EntryRef, LocalEntry]], held: Held) -> Held:
        engine, matched, last = run.engine, held.matched, None
        mark = time.perf_counter()
        for ref, entry in found:
            try:
                engine.import_range(entry.blob, entry.offset)
            except EngineError:
                break
            if engine.positions(MAIN_SEQ) != (0, ref.end - 1):
                engine.remove(MAIN_SEQ, matched, -1)
                break
            matched, last = ref.end, entry.header
        if last is None:
            return held
        run.breakdown.local_ms += ms_since(mark)
        run.breakdown.tier = self.label
        full = matched == run.refs[-1].end
        return Held(matched, last.top_ids if full else None, last.top_logits if full else None, used=held.used)

    def keep(self, computed: Computed) -> None:
        """The entries fetched from farther tiers, then this run's own ranges (as states: sealed
        here, nothing to verify)."""
        if computed.run.session is None:
            return
        for name, item in computed.held.used.items():
            self.entries.put(name, item.header, item.state, item.state_offset)
        for ref in computed.ranges():
            header, _ = decode_header(computed.sealed(ref))
            header.open_private(computed.run.session.ring)  # sealed here a moment ago: its top logits serve a repeat
            self.entries.put(ref.name, header, computed.state(ref), 0)

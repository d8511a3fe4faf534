"""The pure bookkeeping of the board-local tiers (``inference.tiers.context`` and ``.ram``).

- ``Context``: what the engine's main sequence holds after a prefix run, and how much of a new
  prompt it serves exactly (up to the last cut both share: the cold run's batches, so the bits).
- ``RamEntries``: range entries this board computed or fetched, in an LRU under a byte budget,
  the same signed bytes that travel, verified once when they entered.

No engine here; the restores are the tiers'.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cachebox.entry import EntryHeader
from inference.engine.sampling import TOP_CANDIDATES, top_candidates


@dataclass
class LocalEntry:
    header: EntryHeader
    blob: bytes
    offset: int


class RamEntries:
    """Signed range entries kept next to the model, least recently used dropped first.

    Two bounds: the entries' own bytes (``budget_bytes``) and, when given, the whole process's
    resident set (``rss_limit_bytes``, read by ``rss``): a board registered with its memory plans
    the tier from estimates of everything else it holds; what the process really holds when an
    entry comes in decides (the estimate ran 1% short in ``bench vs-server``). Entries leave until
    the new one fits under both; the process's other memory never does, so with too little left the
    tier keeps nothing (``refused`` counts those).
    """

    def __init__(self, budget_bytes: int, rss_limit_bytes: int | None = None, rss: Callable[[], int] | None = None):
        self.budget_bytes = max(0, budget_bytes)
        self.rss_limit_bytes = rss_limit_bytes
        self._rss = rss
        self._entries: OrderedDict[str, LocalEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.evicted_for_rss = self.refused = 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> LocalEntry | None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(name)
            self.hits += 1
            return entry

    def put(self, name: str, header: EntryHeader, blob: bytes, offset: int) -> None:
        """Keep an entry (already verified or sealed by this board); older ones leave to fit the
        budget and the process's RSS limit."""
        if len(blob) > self.budget_bytes:
            return
        with self._lock:
            old = self._entries.pop(name, None)
            if old is not None:
                self._bytes -= len(old.blob)
            if self.rss_limit_bytes is not None and self._rss is not None:
                # The blob is resident already (it was just computed or fetched): it stays only if
                # the process fits once it is kept and nothing else is freed.
                over = self._rss() - self.rss_limit_bytes
                while over > 0 and self._entries:
                    _, dropped = self._entries.popitem(last=False)
                    self._bytes -= len(dropped.blob)
                    over -= len(dropped.blob)
                    self.evicted_for_rss += 1
                if over > 0:
                    self.refused += 1
                    return
            self._entries[name] = LocalEntry(header, blob, offset)
            self._bytes += len(blob)
            while self._bytes > self.budget_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped.blob)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def status(self) -> dict:
        return {
            "entries": len(self._entries),
            "bytes": self._bytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "rss_limit_bytes": self.rss_limit_bytes,
            "evicted_for_rss": self.evicted_for_rss,
            "refused": self.refused,
        }


@dataclass
class Context:
    """What the engine's main sequence holds after a prefix run: its prompt, computed in batches
    cut on the grid and at ``extra`` (the prompt's own cuts off the grid)."""

    tokens: list[int]
    generation: int  # the engine's clear() count when it was left: anything else clearing it voids it
    top_ids: np.ndarray | None = None  # top logits at the prompt's last position (a repeat needs no decode)
    top_logits: np.ndarray | None = None
    extra: tuple[int, ...] = ()

    @classmethod
    def after(
        cls,
        tokens: list[int],
        generation: int,
        last_logits: np.ndarray | None,
        stored: tuple | None,
        count: int = TOP_CANDIDATES,
        extra=(),
    ) -> "Context":
        if last_logits is not None:
            ids, values = top_candidates(last_logits, count)
        elif stored is not None:
            ids, values = stored
        else:
            ids = values = None
        return cls(list(tokens), generation, ids, values, tuple(extra))

    def reusable(self, tokens: list[int], grid: int, extra: tuple[int, ...] = ()) -> int:
        """How many leading tokens of ``tokens`` (cut at ``extra`` besides the grid) this context
        serves exactly: the whole prompt when it is the same one (with its logits), else the last
        position within the shared prefix where both ended a batch after the same batches."""
        if tokens == self.tokens and extra == self.extra and self.top_ids is not None:
            return len(tokens)
        shared = 0
        limit = min(len(tokens), len(self.tokens))
        while shared < limit and tokens[shared] == self.tokens[shared]:
            shared += 1
        if shared == len(tokens):  # the new prompt is a prefix of the old one: its last batch differs
            shared -= 1
        ours = {*self.extra, len(self.tokens)}
        best = shared // grid * grid
        for cut in extra:
            if best < cut <= shared and cut in ours:
                best = cut
        # The batches before it must be the same ones: the same off-grid cuts below it.
        while best and [cut for cut in self.extra if cut < best] != [cut for cut in extra if cut < best]:
            best = max(
                [
                    point
                    for point in (*extra, (best - 1) // grid * grid)
                    if point < best and (point % grid == 0 or point in ours)
                ],
                default=0,
            )
        return best

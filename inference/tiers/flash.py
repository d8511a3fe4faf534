"""The board's flash tier: signed range entries on its own disk (an SD card or eMMC), between its
RAM and the cache box.

A board's RAM is small, its flash is large, and an SD card reads at tens of MB/s where Wi-Fi 4
moves about 2.6 MB/s. Entries are kept as the same sealed bytes that travel to the cache box,
one file each, and verified on every read exactly as a fetched entry is (the namespace's ring,
the tokens' digest, the range's end): a file changed on disk is a miss, removed, never served.
An LRU under a byte budget (``EDGECACHE_FLASH_TIER_MB``) orders the files by their last use
(their modification time), so the tier survives a restart of the board in the order it was used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

from cachebox.entry import EntryHeader
from cachebox.errors import EntryError
from cachebox.events import security_event
from cachebox.keys import tokens_digest
from inference.engine.llama import MAIN_SEQ, EngineError
from inference.serving.breakdown import Tier as TierLabel
from inference.serving.exchange import EntryRef, Fetched
from inference.serving.run import ms_since

from .base import Computed, Held, TierRun

log = logging.getLogger(__name__)

SUFFIX = ".entry"


class FlashEntries:
    """Sealed entries in one folder, least recently used removed first to stay under a byte budget.

    Writes go to a temporary file renamed into place, so a board that loses power mid-write leaves
    either the old state or a stray temporary file (removed at the next start), never half an entry.
    """

    def __init__(self, directory: Path, budget_bytes: int):
        self.directory = Path(directory)
        self.budget_bytes = max(0, budget_bytes)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, oldest use first
        self._bytes = 0
        self.hits = self.misses = 0
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                stat = path.stat()
                found.append((stat.st_mtime_ns, path.name, stat.st_size))
        for _, name, size in sorted(found):
            self._sizes[name] = size
            self._bytes += size
        self._clock = max((mtime for mtime, _, _ in found), default=0)
        with self._lock:
            self._evict()

    @staticmethod
    def file_name(name: str) -> str:
        """An entry's file: a digest of its name (names hold characters no file system wants)."""
        return hashlib.sha256(name.encode()).hexdigest() + SUFFIX

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, name: str) -> bool:
        return self.file_name(name) in self._sizes

    def get(self, name: str) -> bytes | None:
        file = self.file_name(name)
        with self._lock:
            if file not in self._sizes:
                self.misses += 1
                return None
            self._sizes.move_to_end(file)
        path = self.directory / file
        try:
            blob = path.read_bytes()
            self._used(path)
        except OSError:  # removed behind our back
            self.discard(name)
            self.misses += 1
            return None
        self.hits += 1
        return blob

    def put(self, name: str, blob: bytes) -> None:
        """Keep an entry (sealed here or verified on fetch); older ones leave to fit the budget."""
        if len(blob) > self.budget_bytes:
            return
        file = self.file_name(name)
        path = self.directory / file
        temporary = path.with_name(f"{file}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            temporary.write_bytes(blob)
            os.replace(temporary, path)
            self._used(path)
        except OSError as exc:  # a full or failing card: the tier keeps less, the run is not affected
            temporary.unlink(missing_ok=True)
            log.warning("flash tier: could not keep an entry (%s)", exc)
            return
        with self._lock:
            self._bytes -= self._sizes.pop(file, 0)
            self._sizes[file] = len(blob)
            self._bytes += len(blob)
            self._evict()

    def _used(self, path: Path) -> None:
        """Stamp a file with its last use: the order the LRU finds again after a restart (a strictly
        rising clock: the kernel's file times are too coarse to order quick uses)."""
        with self._lock:
            self._clock = max(self._clock + 1, time.time_ns())
            stamp = self._clock
        os.utime(path, ns=(stamp, stamp))

    def discard(self, name: str) -> None:
        file = self.file_name(name)
        with self._lock:
            self._bytes -= self._sizes.pop(file, 0)
        (self.directory / file).unlink(missing_ok=True)

    def clear(self) -> None:
        with self._lock:
            for file in self._sizes:
                (self.directory / file).unlink(missing_ok=True)
            self._sizes.clear()
            self._bytes = 0

    def _evict(self) -> None:
        while self._bytes > self.budget_bytes and self._sizes:
            file, size = self._sizes.popitem(last=False)
            self._bytes -= size
            (self.directory / file).unlink(missing_ok=True)

    def status(self) -> dict:
        return {
            "entries": len(self._sizes),
            "bytes": self._bytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "directory": str(self.directory),
        }


class FlashTier:
    """Signed range entries on the board's disk: no network, read and verified on every hit."""

    label = TierLabel.FLASH

    def __init__(self, directory: Path, budget_bytes: int):
        self.entries = FlashEntries(directory, budget_bytes)

    def status(self) -> dict:
        return self.entries.status()

    def clear(self) -> None:
        self.entries.clear()

    def lookup(self, run: TierRun, held: Held) -> list[EntryRef] | None:
        """The ranges kept here that follow what ``held`` ends with (verified when restored)."""
        if run.session is None:
            return None
        chain = []
        for ref in run.refs:
            if ref.end <= held.matched:
                continue
            if ref.name not in self.entries:
                break
            chain.append(ref)
        return chain or None

    def restore(self, run: TierRun, chain: list[EntryRef], held: Held) -> Held:
        engine, session, tokens = run.engine, run.session, run.tokens
        mark = time.perf_counter()
        matched, last, used = held.matched, None, {}

        def expect(ref: EntryRef, header: EntryHeader) -> None:
            if header.end != ref.end or header.start >= ref.end:
                raise EntryError(f"entry covers [{header.start}, {header.end}), expected a range ending at {ref.end}")
            if header.tokens_digest != tokens_digest(tokens[header.start : header.end]):
                raise EntryError("entry does not belong to these tokens")

        blobs = []
        for ref in chain:
            blob = self.entries.get(ref.name)
            if blob is None:
                break
            blobs.append(blob)
        opened = session.open(chain[: len(blobs)], blobs, expect, chain=True, reject=self._reject(run)) if blobs else []
        for item in opened:
            if item.header.start != matched:
                break
            try:
                engine.import_range(item.state, item.state_offset)
            except EngineError as exc:
                self._reject(run)(item.ref, exc)
                break
            if engine.positions(MAIN_SEQ) != (0, item.ref.end - 1):
                engine.remove(MAIN_SEQ, matched, -1)
                break
            matched, last = item.ref.end, item.header
            used[item.ref.name] = replace(item, source=self.label.value)  # the RAM tier keeps what the flash served
        if last is None:
            return held
        run.breakdown.local_ms += ms_since(mark)
        run.breakdown.tier = self.label
        full = matched == run.refs[-1].end
        return Held(
            matched, last.top_ids if full else None, last.top_logits if full else None, used={**held.used, **used}
        )

    def _reject(self, run: TierRun):
        def reject(ref: EntryRef, reason: Exception) -> None:
            """A file that fails its check is removed here (the cache box's copy is not touched)."""
            self.entries.discard(ref.name)
            run.breakdown.rejected_entries += 1
            security_event(
                "entry_rejected", entry=ref.name, reason=str(reason), tier="flash", action="removed from flash"
            )

        return reject

    def keep(self, computed: Computed) -> None:
        """The entries restored from farther tiers (as they travelled: sealed; replacing a file
        here that a check refused), then this run's own ranges."""
        if computed.run.session is None:
            return
        for name, item in computed.held.used.items():
            if isinstance(item, Fetched) and item.source != self.label.value:
                self.entries.put(name, item.blob)
        for ref in computed.ranges():
            if ref.name not in self.entries:
                self.entries.put(ref.name, computed.sealed(ref))

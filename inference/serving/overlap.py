"""Loading while computing: cached ranges download back to front in a thread while the board
prefills the front of the prompt; the two meet wherever they really do.

The idea is Cake's ("compute or load? why not both"): on a slow link a full fetch loses to
recomputing, and recomputing wastes the cache, but the front of a prompt computed while
the back of it downloads beats both. ``RangeLoader`` fetches one range per request (each
verified, decoded and queued as soon as it arrives); the serving thread imports each into
a side sequence between its own prefill batches, which stay on the grid, so the result is
the cold run's bits. The engine is touched only by the serving thread.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from inference.serving.exchange import EntryRef, ExchangeSession, Expect, Fetched


@dataclass
class Unchecked:
    """A range downloaded but not yet verified (``RangeLoader(check=False)``)."""

    ref: EntryRef
    blob: bytes


@dataclass
class Arrival:
    item: Fetched | Unchecked
    ms: float  # the request's own time: download (and, when the loader checks, verification and decoding)
    at_ms: float  # when it arrived, from the loader's start

    def settle(self, session: ExchangeSession, expect: Expect) -> Fetched | None:
        """The verified range (checked here if the loader did not); None when it fails its checks."""
        if isinstance(self.item, Unchecked):
            # Its time goes to verify_ms (in ``open``) only: the loader may still be adding to fetch_ms.
            opened = session.open([self.item.ref], [self.item.blob], expect, chain=True)
            if not opened:
                return None
            self.item = opened[0]
        return self.item


_DONE = object()


class RangeLoader(threading.Thread):
    """Fetches ``refs`` in the order given (back to front), one request each, into a queue.

    Stops at the first range that is missing or refused (later ones would not connect to
    what the board holds), when told to, or when the serving thread has computed past the
    next range (``computed_to``). Every fetch goes through the exchange session's checks.
    """

    def __init__(self, session: ExchangeSession, refs: Sequence[EntryRef], expect: Expect, *, check: bool = True):
        super().__init__(name="edgecache-range-loader", daemon=True)
        self.session = session
        self.refs = list(refs)
        self.expect = expect
        # False: only download here; the serving thread checks each range (``settle``). For an
        # engine that uses every core, whose threads stall when one of them is preempted.
        self.check = check
        self.arrived: queue.Queue = queue.Queue()
        self.computed_to = 0  # written by the serving thread: ranges ending at or before it are useless
        self._stop_event = threading.Event()
        self.started_at = 0.0
        self.failed = False  # a range was missing or refused: the rest is computed

    def run(self) -> None:
        self.started_at = time.perf_counter()
        try:
            for ref in self.refs:
                if self._stop_event.is_set() or ref.end <= self.computed_to:
                    break
                mark = time.perf_counter()
                if self.check:
                    fetched = self.session.fetch([ref], self.expect, chain=True)
                    item = fetched[0] if fetched else None
                else:
                    blobs = self.session.download([ref])
                    item = Unchecked(ref, blobs[0]) if blobs and blobs[0] is not None else None
                    if blobs is not None and item is None:
                        self.session.missing.add(ref.name)  # evicted since its header was read
                if item is None:
                    self.failed = True
                    break
                now = time.perf_counter()
                self.arrived.put(Arrival(item, (now - mark) * 1000.0, (now - self.started_at) * 1000.0))
        finally:
            self.arrived.put(_DONE)

    def stop(self) -> None:
        self._stop_event.set()

    def take(self, timeout: float | None) -> Arrival | None | object:
        """The next arrival; None when nothing came within ``timeout`` seconds (0: don't wait);
        ``DONE`` when the loader has finished."""
        try:
            if timeout == 0:
                return self.arrived.get_nowait()
            return self.arrived.get(timeout=timeout)
        except queue.Empty:
            return None


DONE = _DONE

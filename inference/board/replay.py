"""Runs on a board: the requests it has answered, kept on its disk until they expire, so a request
replayed after the board restarts (the same signed envelope, pushed onto its queue again while it is
still within its expiry) is refused, not served twice.

A request counts as spent once it was answered (its report sent): a board killed in the middle of a
run gets that run again from the broker when it comes back (acknowledged late), and serves it then.
While it runs, the process's own memory (``inference.board.tasks``) refuses a second delivery.

The file holds one line per request, ``<expiry> <request id>``, appended as each run is answered
(one small write; no fsync: what a board restart must survive is the process, not the machine).
Expired lines are dropped when the board starts and whenever the file has grown past
``MAX_SPENT`` lines, so it stays small: a board answers a few thousand runs within one expiry.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

MAX_SPENT = 50_000  # lines kept before the file is rewritten without expired ones
DEFAULT_EXPIRY_S = 24 * 3600  # how long a request that names no expiry is remembered
_LINE = re.compile(r"^(\d+) ([0-9a-fA-F-]{32,36})$")


class SpentRequests:
    """The request ids this board answered, with their expiries, in memory and in ``path``."""

    def __init__(self, path: Path, *, now: float | None = None):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._expiries: dict[str, float] = {}
        self._lines = 0
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._load(time.time() if now is None else now)

    def spent(self, request_id: str, *, now: float | None = None) -> bool:
        """True when ``request_id`` was answered and has not expired yet."""
        now = time.time() if now is None else now
        with self._lock:
            expires = self._expiries.get(request_id)
            return expires is not None and expires >= now

    def record(self, request_id: str, expires: float | None, *, now: float | None = None) -> None:
        """``request_id`` was answered; remember it until ``expires`` (epoch seconds; None: a day)."""
        now = time.time() if now is None else now
        until = float(expires) if isinstance(expires, (int, float)) else now + DEFAULT_EXPIRY_S
        if until < now or not _LINE.match(f"0 {request_id}"):
            return
        with self._lock:
            self._expiries[request_id] = until
            try:
                if self._lines >= MAX_SPENT:
                    self._rewrite(now)
                with open(self.path, "a", encoding="ascii") as out:
                    out.write(f"{int(until) + 1} {request_id}\n")
                self._lines += 1
            except OSError as exc:  # a full or read-only disk: refused in memory until the board restarts
                log.warning("spent request %s not written to %s: %s", request_id, self.path, exc)

    def _load(self, now: float) -> None:
        try:
            text = self.path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot read the spent requests in %s: %s", self.path, exc)
            return
        lines = text.splitlines()
        for line in lines:
            matched = _LINE.match(line.strip())
            if matched and int(matched.group(1)) >= now:
                self._expiries[matched.group(2)] = float(matched.group(1))
        self._lines = len(lines)
        if len(self._expiries) < self._lines:
            self._rewrite(now)

    def _rewrite(self, now: float) -> None:
        """The file again with only the unexpired requests (written whole, then moved into place)."""
        self._expiries = {request_id: until for request_id, until in self._expiries.items() if until >= now}
        if len(self._expiries) >= MAX_SPENT:  # more live requests than a board answers in an expiry: keep the latest
            kept = sorted(self._expiries.items(), key=lambda item: item[1])[-MAX_SPENT // 2 :]
            self._expiries = dict(kept)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        temporary.write_text(
            "".join(f"{int(until)} {request_id}\n" for request_id, until in self._expiries.items()), encoding="ascii"
        )
        os.replace(temporary, self.path)
        self._lines = len(self._expiries)


_spent: SpentRequests | None = None


def keep_in(path: Path) -> SpentRequests:
    """Remember this board's answered requests in ``path`` (the edge command, at start)."""
    global _spent
    _spent = SpentRequests(path)
    return _spent


def spent(request_id: str) -> bool:
    """True when this board answered ``request_id`` before (also before it restarted) and it has not expired."""
    return _spent is not None and _spent.spent(request_id)


def record(request_id: str, expires: float | None) -> None:
    """``request_id`` was answered (a process without ``keep_in``, such as a test's, remembers nothing)."""
    if _spent is not None:
        _spent.record(request_id, expires)

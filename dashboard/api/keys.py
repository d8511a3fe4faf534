"""API keys at the door of /v1/: the key in a request's ``Authorization`` header, checked and
counted against its rate.

Keys are made and revoked by the verbs of ``dashboard.actions.api_keys`` (the API keys page,
``manage.py apikey``, the admin); only a key's SHA-256 is kept, so one indexed lookup finds it.

A web process remembers the keys it found active, so that a request with one costs no database
query: the **key epoch**, a counter in the cache box that every change of a key moves
(``actions.api_keys.key_changed``: a revocation, an edit, a deletion), comes back with the key's rate count in the
one round trip the rate limit makes anyway (``ratelimit.hit_unanswered(read=...)``). A key remembered under
another epoch is read from the database again, and so is every key while the cache box does not
answer. The epoch is read before the database is, so a change that lands in between moves it
again and is seen by the next request; and a remembered key is read again after
``REMEMBERED_FOR_S`` whatever the epoch says (an epoch move lost to an outage). Only on a shared cache (the cache box's Redis): with
Django's per-process cache another process's revocation would go unseen, so nothing is remembered.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Callable, NamedTuple

from django.core.cache import cache
from django.utils import timezone

from dashboard.security import ratelimit
from dashboard.store.django_cache import CACHE_SERVER_ERRORS

from ..actions.api_keys import EPOCH, REMEMBERED_FOR_S, hash_key
from ..models import ApiKey

LAST_USED_EVERY = timedelta(minutes=1)  # how stale a key's "last used" may be
REMEMBERED_AT_MOST = 10_000  # keys one process remembers (the oldest are forgotten first)


def bearer(header: str) -> str:
    """The key in an ``Authorization: Bearer KEY`` header ("" when there is none)."""
    scheme, _, value = (header or "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _digest(header: str) -> str | None:
    key = bearer(header)
    if not key.startswith(ApiKey.PREFIX) or len(key) > 200:
        return None
    return hash_key(key)


def _read(digest: str) -> ApiKey | None:
    """The active key with this SHA-256, from the database (its "last used" moved, to the minute)."""
    row = ApiKey.objects.select_related("namespace").filter(key_sha256=digest, revoked_at__isnull=True).first()
    if row is not None:
        _touch(row)
    return row


def _touch(row: ApiKey) -> None:
    now = timezone.now()
    if row.last_used is None or now - row.last_used >= LAST_USED_EVERY:
        # To the minute: a write per request would queue every call behind the database's write lock.
        ApiKey.objects.filter(pk=row.pk).update(last_used=now)
        row.last_used = now


def authenticate(header: str) -> ApiKey | None:
    """The active key named by the ``Authorization`` header, or None (from the database)."""
    digest = _digest(header)
    return _read(digest) if digest is not None else None


class Checked(NamedTuple):
    key: ApiKey | None  # None: no active key of that name
    verdict: ratelimit.Verdict | None  # its rate count (None without a key)


class _Remembered:
    """The active keys this process read, by SHA-256, with the key epoch read before each was."""

    def __init__(self):
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[ApiKey, object, float]] = {}

    def get(self, digest: str) -> tuple[ApiKey, object] | None:
        found = self._keys.get(digest)
        if found is None or time.monotonic() - found[2] > REMEMBERED_FOR_S:
            return None
        return found[0], found[1]

    def keep(self, digest: str, row: ApiKey, epoch: object) -> None:
        if epoch is ratelimit.UNREAD or not _shared():
            return
        with self._lock:
            self._keys.pop(digest, None)
            self._keys[digest] = (row, epoch, time.monotonic())
            while len(self._keys) > REMEMBERED_AT_MOST:
                del self._keys[next(iter(self._keys))]

    def forget(self, digest: str | None = None) -> None:
        with self._lock:
            if digest is None:
                self._keys.clear()
            else:
                self._keys.pop(digest, None)


_REMEMBERED = _Remembered()
_READING = tuple(threading.Lock() for _ in range(64))  # by a key's digest: one database read of a key at a time


def _shared() -> bool:
    """Whether Django's cache is the cache box's (shared by every process, so the epoch is too)."""
    return hasattr(cache, "count_and_read_unanswered")


def _epoch() -> object:
    try:
        return cache.get(EPOCH)
    except CACHE_SERVER_ERRORS:
        return ratelimit.UNREAD


def check(header: str) -> Checked:
    """The active key named by the ``Authorization`` header, and this request counted against
    its rate (``dashboard.security.ratelimit``, scope "api"). A key this process remembers costs
    one round trip to the cache box and no query; any other is read from the database."""
    return check_unanswered(header)[1]()


def check_unanswered(header: str) -> tuple[ApiKey | None, Callable[[], Checked]]:
    """``check``, in two halves: the key as this process remembers it, at once, and a function that
    gives the ``Checked`` verdict (call it once, and always). For a remembered key the rate's count
    and the key epoch are sent at once and read by that function, so the caller's work in between
    (an API request's parsing and routing) runs beside the round trip; the caller may prepare with
    the remembered key, and act on it only once the verdict allows it. A key not remembered, or
    one refused in this window, is checked at once and comes back as None: the caller reads the
    verdict before anything else (a refused client costs no routing)."""
    digest = _digest(header)
    remembered = _REMEMBERED.get(digest) if digest is not None else None
    if remembered is None or _REFUSED.lately(digest):
        checked = _check_now(digest)
        return None, lambda: checked
    row, epoch = remembered
    counted = ratelimit.hit_unanswered("api", row.pk, row.rate(), read=EPOCH)
    return row, lambda: _noted(digest, _settle(digest, row, epoch, counted()))


def _check_now(digest: str | None) -> Checked:
    if digest is None:
        return Checked(None, None)
    remembered = _REMEMBERED.get(digest)
    if remembered is None:
        # One read of a key at a time in this process: requests that come together with a key not
        # remembered yet (a client's connections opening at once) wait for the first one's read and
        # find it remembered, instead of each reading it and writing its "last used" (8 writes at
        # once held each other up to 70 ms behind SQLite's lock, bench api's first requests).
        with _READING[hash(digest) % len(_READING)] if _shared() else contextlib.nullcontext():
            remembered = _REMEMBERED.get(digest)
            if remembered is None:
                epoch = _epoch() if _shared() else ratelimit.UNREAD  # before the database: a change after it moves it
                row = _read(digest)
                if row is None:
                    return Checked(None, None)
                _REMEMBERED.keep(digest, row, epoch)
                return _noted(digest, Checked(row, ratelimit.hit("api", row.pk, row.rate())))
    row, epoch = remembered
    return _noted(digest, _settle(digest, row, epoch, ratelimit.hit("api", row.pk, row.rate(), read=EPOCH)))


def _settle(digest: str, row: ApiKey, epoch: object, verdict: ratelimit.Verdict) -> Checked:
    """A remembered key's verdict: the key as remembered while the epoch did not move, else read again."""
    if verdict.read is not ratelimit.UNREAD and verdict.read == epoch:
        _touch(row)
        return Checked(row, verdict)
    # A key changed since (or the cache box did not answer): this one is read again.
    _REMEMBERED.forget(digest)
    row = _read(digest)
    if row is None:
        return Checked(None, None)
    _REMEMBERED.keep(digest, row, verdict.read)
    return Checked(row, verdict.under(row.rate()))


def _noted(digest: str, checked: Checked) -> Checked:
    if checked.verdict is not None and not checked.verdict.allowed:
        _REFUSED.note(digest)
    return checked


class _Refused:
    """The keys refused for their rate in this process, by SHA-256, with the window (minute) of the
    last refusal: such a key is checked before its request is routed until the window ends."""

    def __init__(self):
        self._lock = threading.Lock()
        self._keys: dict[str, int] = {}

    @staticmethod
    def _window() -> int:
        return int(ratelimit.clock() // ratelimit.WINDOW_SECONDS)

    def note(self, digest: str) -> None:
        window = self._window()
        with self._lock:
            if len(self._keys) >= REMEMBERED_AT_MOST:
                self._keys = {name: when for name, when in self._keys.items() if when == window}
            self._keys[digest] = window

    def lately(self, digest: str) -> bool:
        return self._keys.get(digest) == self._window()


_REFUSED = _Refused()

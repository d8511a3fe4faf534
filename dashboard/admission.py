"""Bounded queues: overload is refused at once, not queued without end.

A namespace holds at most ``EDGECACHE_QUEUE_PER_BOARD`` runs under way (waiting in a board's queue
or running) per online board of it, whoever sent them (the API, the Run page); an API key at most
``EDGECACHE_API_QUEUE_PER_KEY``. Past either bound a run is refused before it is sent: the API
answers 429 (the key's own bound) or 503 (the namespace's: the fleet is busy), with ``Retry-After``,
and the Run page says the fleet is busy. A client then waits its turn outside, where it can give
up, instead of inside a queue longer than it will wait.

The counts are sorted sets in the cache box's Redis (``cachebox.store.CacheBox.admit``: one atomic
script), shared by every web process and control worker. A run stops counting when its answer
comes (the API's stream ends; the control worker records the report) or, should that be lost
with its process, at its deadline. Without the cache box nothing is admitted: the bounds could not
be kept (every web process would let runs through uncounted), so a run is refused with a 503 that
says the cache box is unreachable (``CacheBoxUnreachable``), and nothing is sent.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from django.conf import settings

from cachebox.errors import CacheBoxError
from cachebox.keys import queue_key_names
from cachebox.store import CacheBox

from .actions.cache import kept_cachebox

log = logging.getLogger("dashboard.admission")

DEFAULT_RETRY_AFTER_S = 2  # a refused client's wait when nothing better is known


def _store() -> CacheBox:
    """This process's client of the cache box for the counts (its connections reused: every API
    request counts; no skipping after a failure, or every release of the next seconds would fail
    and hold its place until its deadline)."""
    return kept_cachebox()


@dataclass(frozen=True)
class Ticket:
    """A run counted as under way; ``release`` it when its answer came."""

    names: tuple[str, ...]
    request_id: str


class FleetBusy(Exception):
    """A bound is reached: ``scope`` "key" (this API key's own runs) or "namespace" (the fleet's)."""

    def __init__(self, scope: str, namespace: str, limit: int, under_way: int, retry_after: int):
        self.scope, self.namespace, self.limit, self.under_way, self.retry_after = (
            scope,
            namespace,
            limit,
            under_way,
            retry_after,
        )
        if scope == "key":
            what = f"This API key has {under_way} requests under way, its bound (EDGECACHE_API_QUEUE_PER_KEY {limit})"
        else:
            what = f"The fleet is busy: namespace {namespace!r} has {under_way} runs under way, its bound ({limit}: EDGECACHE_QUEUE_PER_BOARD per online board)"
        seconds = "1 second" if retry_after == 1 else f"{retry_after} seconds"
        super().__init__(f"{what}. Nothing was sent; try again in {seconds}.")


class CacheBoxUnreachable(FleetBusy):
    """The bounded queues cannot be counted (the cache box does not answer): admission fails closed."""

    def __init__(self, namespace: str, reason: str, retry_after: int = DEFAULT_RETRY_AFTER_S):
        Exception.__init__(
            self,
            f"The cache box is unreachable ({reason}), so runs cannot be counted against the fleet's bounds. Nothing was sent; "
            f"start the cache box or check REDIS_URL / EDGECACHE_CACHEBOX_URL, then try again in {retry_after} seconds.",
        )
        self.scope, self.namespace, self.limit, self.under_way, self.retry_after = (
            "cachebox",
            namespace,
            0,
            0,
            retry_after,
        )


def namespace_limit(online_boards: int) -> int:
    """How many runs a namespace with ``online_boards`` may have under way (0: no bound)."""
    per_board = settings.EDGECACHE_QUEUE_PER_BOARD
    return per_board * max(1, online_boards) if per_board > 0 else 0


def admit(
    namespace: str,
    request_id: str,
    *,
    online_boards: int,
    key_id: int | None = None,
    hold_s: float,
    retry_after: int = DEFAULT_RETRY_AFTER_S,
) -> Ticket:
    """Count run ``request_id`` as under way in ``namespace`` (and for API key ``key_id``) for at most
    ``hold_s`` seconds; FleetBusy (nothing counted) when a bound is reached, CacheBoxUnreachable (a
    FleetBusy) when the counts cannot be read: it fails closed."""
    return admit_unanswered(namespace, request_id, online_boards=online_boards, key_id=key_id, hold_s=hold_s)(
        retry_after
    )


def admit_unanswered(
    namespace: str, request_id: str, *, online_boards: int, key_id: int | None = None, hold_s: float
) -> Callable[[int], Ticket]:
    """``admit``, in two halves: the count is sent to the cache box at once, and the returned
    function, given what a refused client is told to wait (``retry_after``, seconds), gives the
    run's ``Ticket`` or raises ``FleetBusy`` / ``CacheBoxUnreachable``. Call it once, and always
    (its connection goes back to the pool then). The round trip runs beside the caller's work in
    between (an API request's routing)."""
    limits = [namespace_limit(online_boards)]
    who = ""
    if key_id is not None:
        who = str(key_id)
        limits.append(settings.EDGECACHE_API_QUEUE_PER_KEY)
    names = tuple(queue_key_names(namespace, who))
    if all(limit <= 0 for limit in limits):
        return lambda retry_after: Ticket((), request_id)
    now = time.time()
    try:
        answer = _store().admit_unanswered(names, limits, request_id, now=now, until=now + hold_s)
    except CacheBoxError as exc:
        failure = exc

        def answer():
            raise failure

    def ticket(retry_after: int) -> Ticket:
        retry_after = max(1, int(retry_after))
        try:
            full, under_way, _ = answer()
        except CacheBoxError as exc:
            log.warning("run %s refused: the bounded queues cannot be counted: %s", request_id, exc)
            raise CacheBoxUnreachable(namespace, str(exc)[:200], retry_after) from None
        if full:
            raise FleetBusy("namespace" if full == 1 else "key", namespace, limits[full - 1], under_way, retry_after)
        return Ticket(names, request_id)

    return ticket


def release(ticket: Ticket | None) -> None:
    """``ticket``'s run is no longer under way (never raises)."""
    if ticket is None or not ticket.names:
        return
    for attempt in (1, 2):
        try:
            _store().release(ticket.names, ticket.request_id)
            return
        except CacheBoxError as exc:
            if attempt == 2:  # it stops counting at its deadline
                log.warning("run %s not released from the bounded queues: %s", ticket.request_id, exc)


def answered(namespace: str, request_id: str) -> None:
    """A run's report was recorded: it no longer counts in its namespace (whichever process admitted it)."""
    try:
        release(Ticket(tuple(queue_key_names(namespace)), request_id))
    except ValueError:  # not a namespace name: nothing was counted under it
        pass


def retry_after_s(expected_ms: float | None) -> int:
    """What a refused client is told to wait: the chosen board's expected wait, in whole seconds."""
    if not expected_ms or expected_ms <= 0:
        return DEFAULT_RETRY_AFTER_S
    return max(1, min(settings.EDGECACHE_API_TIMEOUT, math.ceil(expected_ms / 1000.0)))

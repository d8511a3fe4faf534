"""Cache-aware routing on the control plane: which board answers a prompt sent to "any board".

The choice is ``inference.placement.route`` (the same function ``bench fleet`` measures), fed
from what the control plane already keeps:

- **what each board holds**: its routing history. Every dispatched run keeps its prompt's
  prefix keys in ``Dispatch.routing``; a board's context is its last dispatched prompt, its
  RAM tier the ones before, within the budget its heartbeat reports (``ram_tier``);
- **what the cache box holds**: the entry mirror (``CacheEntry``), for the board's namespace and model;
- **its rates**: the prefill and decode times of its recent runs, dated by their rows (``created``)
  and forgotten once ``RATE_MAX_AGE_S`` old (a board shunned after a slow spell is tried again); without
  any, the rates it measured when it started (its heartbeat's ``rates``);
- **its queue**: runs dispatched to it and not reported yet (within the task expiry).

That history and the mirror's entry names are kept in memory (``RoutingState``), brought up to date
from the rows written since the last read: by a thread of each web process, or before a decision
where none follows. A decision in a web process reads memory only, whatever the fleet's size (it
used to cost two queries per candidate board: 0.9 s at 100 boards, ``bench fleet-sim``).

The prompt is tokenized with the control plane's vocabulary of the model (the tokens a board
computes for the same segments or chat messages), and those tokens travel in the run's request
(``RunRequest.tokenized``, ``Routed.request``): a board of that vocabulary does not tokenize it
again. Runs to a named board keep the same record, so the history is whole whichever way a run was sent.
"""

from __future__ import annotations

import bisect
import functools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from cachebox.keys import entry_key_name
from cachebox.link import LinkProfile
from dashboard.models import CacheEntry, Device, Dispatch, InferenceRun, offline_after
from inference.contract.messages import MAX_PROMPT_TOKENS, PromptTokens, RunRequest
from inference.engine.chat import chat_prompt
from inference.engine.llama import Vocabulary
from inference.engine.model_file import resolve_model
from inference.placement import HISTORY, RATE_SAMPLES, FleetIndex, PromptKeys, prompt_keys, route
from inference.serving.run import text_layout

log = logging.getLogger("dashboard.router")


@dataclass(frozen=True)
class Routed:
    device: Device
    record: dict  # kept on the Dispatch (``routing``) and shown with the run
    tokenized: PromptTokens | None = (
        None  # the prompt's tokens and cuts as routing made them (None: not tokenized here)
    )

    def request(self, prompt: RunRequest) -> RunRequest:
        """``prompt`` as its board receives it: carrying the tokens routing made of it."""
        return prompt.model_copy(update={"tokenized": self.tokenized}) if self.tokenized is not None else prompt


@functools.lru_cache(maxsize=2)
def _vocabulary(model: str):
    return _RememberedTokens(Vocabulary.load(resolve_model(model or None)))


class _RememberedTokens:
    """A vocabulary that remembers the tokens of the texts it tokenized last: the router tokenizes
    every prompt, and most repeat their system prompt, their few-shot examples and the chat
    template's markup (five calls a chat, 1 ms of a 3 ms decision at 1,000 boards)."""

    def __init__(self, vocabulary):
        self._vocabulary = vocabulary
        self._tokenize = functools.lru_cache(maxsize=1024)(
            lambda text, add_bos, special: tuple(vocabulary.tokenize(text, add_bos=add_bos, special=special))
        )

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return list(self._tokenize(text, add_bos, special))  # a copy: callers extend what they get

    def __getattr__(self, name: str):
        return getattr(self._vocabulary, name)


def prompt_tokens(prompt: RunRequest) -> tuple[list[int], tuple[int, ...]] | None:
    """The tokens a board computes for ``prompt`` and where it cuts them besides the grid (where its
    last segment and last paragraph begin, ``text_layout``; where a chat's messages begin); None: a
    schema run, or no vocabulary here."""
    if prompt.is_schema_run or (not prompt.segments and not prompt.messages):
        return None
    try:
        vocabulary = _vocabulary(settings.EDGECACHE_MODEL)
        if prompt.messages:
            chat = chat_prompt(vocabulary, [(message.role, message.content) for message in prompt.messages])
            return chat.tokens, chat.cuts

        return text_layout(vocabulary, prompt.segments)
    except Exception as exc:  # routing then weighs queues only; the board reports any real error
        log.warning("prompt not tokenized for routing: %s", exc)
        return None


def carried(layout: tuple[list[int], tuple[int, ...]] | None) -> PromptTokens | None:
    """``prompt_tokens``'s tokens and cuts as a run carries them to its board, named by the vocabulary
    that made them (None: none made, or more than a request carries)."""
    if not layout or not layout[0] or len(layout[0]) > MAX_PROMPT_TOKENS:
        return None
    try:
        return PromptTokens(
            tokens=layout[0], cuts=list(layout[1]), vocabulary=_vocabulary(settings.EDGECACHE_MODEL).digest
        )
    except Exception as exc:  # the board tokenizes the prompt itself
        log.warning("prompt tokens not carried to the board: %s", exc)
        return None


def keys_for(device: Device, layout: tuple[list[int], tuple[int, ...]] | None) -> PromptKeys:
    """The prefix keys ``device`` uses for a prompt's tokens and cuts (its namespace and model; none
    before its first heartbeat)."""
    fingerprint = (device.status or {}).get("fingerprint")
    if not layout or not layout[0] or not isinstance(fingerprint, str) or not fingerprint:
        return PromptKeys()
    tokens, cuts = layout
    try:
        return prompt_keys(
            device.cache_namespace, fingerprint, tokens, grid=settings.EDGECACHE_BOARD.chunk_tokens, extra=cuts
        )
    except ValueError:
        return PromptKeys()


def link_of(device: Device) -> LinkProfile | None:
    if not device.link_bandwidth_mbps:
        return None
    return LinkProfile(device.link_bandwidth_mbps, device.link_rtt_ms or 0.0)


def ram_budget(device: Device) -> int:
    ram = (device.status or {}).get("ram_tier")
    budget = ram.get("budget_bytes") if isinstance(ram, dict) else 0
    return budget if isinstance(budget, int) and budget > 0 else 0


def cachebox_tokens(device: Device, keys: PromptKeys, mirrored: set[str]) -> int:
    """Leading tokens of the prompt whose entries the cache box holds for ``device``, of the entry
    names ``mirrored`` (the mirror's, looked up for every candidate at once)."""
    if not keys.keys:
        return 0
    names = _entry_names(device, keys)
    return keys.held({names[name] for name in names if name in mirrored})


def _entry_names(device: Device, keys: PromptKeys) -> dict[str, str]:
    return _names(device.cache_namespace, device.status["fingerprint"], keys.keys)


@functools.lru_cache(maxsize=256)
def _names(namespace: str, fingerprint: str, keys: tuple[str, ...]) -> dict[str, str]:
    return {entry_key_name(namespace, fingerprint, bytes.fromhex(key)): key for key in keys}


def _wanted_names(devices: list[Device], keys: dict[str, PromptKeys]) -> set[str]:
    """The entry names of every candidate's prompt keys (boards of one namespace and model share theirs)."""
    wanted: set[str] = set()
    for device in devices:
        if keys[device.name].keys:
            wanted.update(_entry_names(device, keys[device.name]))
    return wanted


def measured_rates(index: FleetIndex, device: Device) -> None:
    """The rates ``device`` measured when it started (its heartbeat's ``rates``), for the router."""
    rates = (device.status or {}).get("rates")
    if isinstance(rates, dict):
        index.measured(
            device.name,
            prefill_ms_per_token=_number(rates.get("prefill_ms_per_token")),
            decode_ms_per_token=_number(rates.get("decode_ms_per_token")),
        )


def fleet_index(devices: list[Device]) -> FleetIndex:
    """The routing history of ``devices`` rebuilt from the database: recent dispatches (oldest first),
    their reports, rates. Two queries per device: the reference ``RoutingState`` is checked
    against (tests); routing itself reads the state kept in memory."""
    index = FleetIndex(prefill_prior=settings.EDGECACHE_BOARD.prefill_ms_per_token)
    now = timezone.now()
    expired_before = now - timedelta(seconds=settings.EDGECACHE_TASK_EXPIRES)
    for device in devices:
        measured_rates(index, device)
        dispatches = list(
            Dispatch.objects.filter(device=device, kind="run")
            .order_by("-created")
            .values_list("request_id", "created", "routing")[:HISTORY]
        )[::-1]
        reported = {
            str(run_id): (error, created)
            for run_id, error, created in InferenceRun.objects.filter(
                request_id__in=[row[0] for row in dispatches]
            ).values_list("request_id", "error", "created")
        }
        for dispatch_id, created, record in dispatches:
            request_id = str(dispatch_id)
            record = record or {}
            index.dispatched(
                device.name,
                request_id,
                PromptKeys.from_dict(record.get("prompt")),
                _number(record.get("work_ms")),
                at=created.timestamp(),
            )
            run = reported.get(request_id)
            if run is not None:
                index.reported(device.name, request_id, failed=bool(run[0]), at=run[1].timestamp())
            elif created < expired_before:
                index.reported(device.name, request_id, failed=True)  # it expired: it holds nothing of it, owes nothing
        for run in (
            InferenceRun.objects.filter(device=device, error="")
            .order_by("-created")
            .values("request_id", "created", "breakdown")[:RATE_SAMPLES][::-1]
        ):
            _learn(index, device.name, str(run["request_id"]), run["breakdown"], at=run["created"].timestamp())
    index.age(now.timestamp())
    return index


def _learn(index: FleetIndex, board: str, request_id: str, breakdown, *, at: float) -> None:
    """Feed a run's report to ``index``: its rates, dated ``at`` (its row's ``created``, wall-clock
    seconds, the clock ``plan`` decides by), so they age (``RATE_MAX_AGE_S``)."""
    b = breakdown if isinstance(breakdown, dict) else {}
    index.reported(
        board,
        request_id,
        prompt_tokens=int(_number(b.get("prompt_tokens"))),
        matched_tokens=int(_number(b.get("matched_tokens"))),
        prefill_ms=_number(b.get("prefill_ms")),
        decode_ms=_number(b.get("decode_ms")),
        generated_tokens=int(_number(b.get("generated_tokens"))),
        at=at,
    )


class RoutingState:
    """The router's ``FleetIndex`` for every board, kept in this process's memory and brought up to date
    before each decision from the rows written since (dispatches and reports, by id: two indexed
    queries that return only what is new), instead of two queries per candidate board.

    Each web process keeps its own, fed from the database every process writes to, so several web
    processes see the same history. It is rebuilt from scratch every ``REBUILD_S`` (a run re-sent
    to another board changes its dispatch in place), in a thread of its own while decisions go on
    with the index they have (a rebuild inside a decision stalled every request of the web process
    for 0.5-0.7 s, ``bench fleet-sim``), and at once whenever the rows it last read are gone (a
    database restored or rolled back). What it holds equals ``fleet_index`` of the same rows.
    """

    REBUILD_S = 30.0
    LOOKBACK = 64  # ids re-read behind the cursor: PostgreSQL may commit a lower id after a higher one
    # ... at most once a second: re-reading them at every decision (128 request ids, each made a
    # UUID) was most of a decision's 6 ms at 1,000 boards; between, only the cursor's row and newer.
    LOOKBACK_EVERY_S = 1.0
    SEEN = 50_000  # request ids remembered (a re-read row is fed once)

    FRESH_S = 0.5  # a follower that has not followed for this long is not trusted: decisions follow inline

    def __init__(self):
        self.lock = threading.RLock()  # held by a decision while it reads the index
        self.index: FleetIndex | None = None
        self._rebuilding: threading.Thread | None = None
        self._looked_back = float("-inf")  # time.monotonic() of the last look-back
        self._follower: threading.Thread | None = None
        self._follow_every = 0.0
        self._followed_at = float("-inf")  # time.monotonic() of the follower's last look
        # The entry mirror's names (what the cache box holds, ``CacheEntry.key``), followed with the
        # history: a decision reads memory only. The cursor is the newest row read, the mark its name.
        self.entry_names: set[str] = set()
        self.entry_cursor, self.entry_mark = 0, None

    def current(self, now: float | None = None) -> FleetIndex:
        """The index as of now: rows committed before this call, or, where this process's follower
        keeps it (``follow_in_background``), up to its period before it."""
        with self.lock:
            now = time.time() if now is None else now
            if self.index is None or (not self._fresh() and not self._follow()):
                self._build(now)
            elif now - self.built_at > self.REBUILD_S and (self._rebuilding is None or not self._rebuilding.is_alive()):
                self._rebuilding = threading.Thread(target=self._rebuild, name="edgecache-routing-rebuild", daemon=True)
                self._rebuilding.start()
            self._expire(now)
            self.index.age(now)  # rate samples too old to trust: only the boards whose oldest just aged
            return self.index

    def _rebuild(self) -> None:
        """Build the index again from scratch apart from any decision, then take it in: the rows
        written meanwhile are followed from the new index's cursors before it replaces the old."""
        from django.db import connections

        try:
            fresh = RoutingState()
            fresh._build(time.time())
            if not fresh._follow():
                return  # the database changed under the build: the next decision finds out
            with self.lock:
                for name in (
                    "index",
                    "built_at",
                    "dispatch_cursor",
                    "run_cursor",
                    "marks",
                    "seen_dispatches",
                    "seen_runs",
                    "entry_names",
                    "entry_cursor",
                    "entry_mark",
                ):
                    setattr(self, name, getattr(fresh, name))
        except Exception as exc:  # the next period tries again; decisions keep following meanwhile
            log.warning("routing history not rebuilt: %s: %s", type(exc).__name__, exc)
        finally:
            connections.close_all()  # this thread's own connection

    def reset(self) -> None:
        with self.lock:
            self.index = None

    # -- building and following ------------------------------------------------------------------
    def _build(self, now: float) -> None:
        from django.db.models import F, Window
        from django.db.models.functions import RowNumber

        index = FleetIndex(prefill_prior=settings.EDGECACHE_BOARD.prefill_ms_per_token)
        self.dispatch_cursor, dispatch_mark = Dispatch.objects.order_by("-pk").values_list(
            "pk", "request_id"
        ).first() or (0, None)
        self.run_cursor, run_mark = InferenceRun.objects.order_by("-pk").values_list("pk", "request_id").first() or (
            0,
            None,
        )
        self.marks = (dispatch_mark, run_mark)
        self.seen_dispatches: dict[str, None] = {}
        self.seen_runs: dict[str, None] = {}
        recent = (
            Dispatch.objects.filter(kind="run", device__isnull=False, pk__lte=self.dispatch_cursor)
            .annotate(rank=Window(RowNumber(), partition_by=[F("device_id")], order_by=F("created").desc()))
            .filter(rank__lte=HISTORY)
            .values_list("pk", "request_id", "device__name", "created", "routing")
        )
        rows = sorted(recent, key=lambda row: (row[3], row[0]))
        reports = {
            str(run_id): (error, created)
            for run_id, error, created in InferenceRun.objects.filter(
                request_id__in=[row[1] for row in rows], pk__lte=self.run_cursor
            ).values_list("request_id", "error", "created")
        }
        for _, dispatch_id, board, created, record in rows:
            request_id = str(dispatch_id)
            record = record or {}
            index.dispatched(
                board,
                request_id,
                PromptKeys.from_dict(record.get("prompt")),
                _number(record.get("work_ms")),
                at=created.timestamp(),
            )
            self._remember(self.seen_dispatches, request_id)
            run = reports.get(request_id)
            if run is not None:
                index.reported(board, request_id, failed=bool(run[0]), at=run[1].timestamp())
        rates = (
            InferenceRun.objects.filter(error="", pk__lte=self.run_cursor)
            .annotate(rank=Window(RowNumber(), partition_by=[F("device_id")], order_by=F("created").desc()))
            .filter(rank__lte=RATE_SAMPLES)
            .values_list("pk", "request_id", "device__name", "created", "breakdown")
        )
        for _, run_id, board, created, breakdown in sorted(rates, key=lambda row: (row[3], row[0])):
            _learn(index, board, str(run_id), breakdown, at=created.timestamp())
        for run_id in InferenceRun.objects.filter(
            pk__gt=self.run_cursor - self.LOOKBACK, pk__lte=self.run_cursor
        ).values_list("request_id", flat=True):
            self._remember(self.seen_runs, str(run_id))  # read above, as history or rates
        for dispatch_id in Dispatch.objects.filter(
            pk__gt=self.dispatch_cursor - self.LOOKBACK, pk__lte=self.dispatch_cursor
        ).values_list("request_id", flat=True):
            self._remember(self.seen_dispatches, str(dispatch_id))
        self._take_entries(True, _entry_rows(0))
        index.age(now)  # here, beside decisions when rebuilding: not every board's at the next decision
        self.index = index
        self.built_at = now

    def _follow(self) -> bool:
        """Feed the rows written since the last read (the lock held); False when the rows at the
        cursors are not the ones read (the database is not the one this state was built from:
        restored, rolled back)."""
        return self._apply(self._read(self._lookback()))

    def _lookback(self) -> int:
        if time.monotonic() - self._looked_back >= self.LOOKBACK_EVERY_S:
            self._looked_back = time.monotonic()
            return self.LOOKBACK
        return 0

    def _cursors(self) -> tuple:
        return (
            self.dispatch_cursor,
            self.run_cursor,
            self.marks,
            self.entry_cursor,
            self.entry_mark,
            len(self.entry_names),
        )

    def _read(self, lookback: int) -> tuple:
        """What was written since the cursors: queries only, no index touched (the follower runs it
        without the lock). Ids first (cheap), then whole rows for the ones not fed yet: the
        look-back re-reads no JSON. ``(cursors, None)`` when the rows at the cursors are not the
        ones read."""
        cursors = self._cursors()
        entries = self._read_entries(whole_count=lookback > 0)
        ids = _ids_from(Dispatch, cursors[0] - lookback)
        runs = _ids_from(InferenceRun, cursors[1] - lookback)
        if ids.get(cursors[0]) != cursors[2][0] or runs.get(cursors[1]) != cursors[2][1]:
            return cursors, None
        new_dispatches = [pk for pk, request_id in ids.items() if str(request_id) not in self.seen_dispatches]
        dispatch_rows = (
            list(
                Dispatch.objects.filter(pk__in=new_dispatches, kind="run", device__isnull=False)
                .order_by("pk")
                .values_list("pk", "request_id", "device__name", "created", "routing")
            )
            if new_dispatches
            else []
        )
        new_runs = [pk for pk, request_id in runs.items() if str(request_id) not in self.seen_runs]
        run_rows = (
            list(
                InferenceRun.objects.filter(pk__in=new_runs)
                .order_by("pk")
                .values_list("pk", "request_id", "device__name", "created", "error", "breakdown")
            )
            if new_runs
            else []
        )
        return cursors, (ids, runs, new_dispatches, dispatch_rows, new_runs, run_rows, entries)

    def _read_entries(self, *, whole_count: bool) -> tuple[bool, dict[int, str]] | None:
        """What changed in the entry mirror (``CacheEntry``) since it was read: ``(False, rows)``, the
        rows added after the cursor; ``(True, rows)``, every row (read again when rows went that the
        newest row or the count shows: a flush, a reconcile, a database restored); None, nothing.
        The count is compared once a second (``whole_count``): an entry deleted without a new one is
        seen within a second, or at the next rebuild where rows were added meanwhile."""
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(_entry_top_sql(connection))
            row = cursor.fetchone()
        count, top, top_name = row if row is not None else (0, 0, None)
        known = len(self.entry_names)
        if top == self.entry_cursor and top_name == self.entry_mark and (not whole_count or count == known):
            return None
        if top > self.entry_cursor:
            rows = _entry_rows(self.entry_cursor)  # the cursor's own row included: it must be the one read
            still = self.entry_cursor == 0 or rows.pop(self.entry_cursor, None) == self.entry_mark
            if still and (not whole_count or count == known + len(rows)):
                return False, rows
        return True, _entry_rows(0)

    def _take_entries(self, whole: bool, rows: dict[int, str]) -> None:
        """Take in what ``_read_entries`` found (the lock held, or a state nobody else sees yet)."""
        if whole:
            self.entry_names = set(rows.values())
            self.entry_cursor, self.entry_mark = 0, None
        else:
            self.entry_names.update(rows.values())
        if rows:
            top = max(rows)
            if top > self.entry_cursor:
                self.entry_cursor, self.entry_mark = top, rows[top]

    def mirrored(self, wanted: set[str]) -> set[str]:
        """The names of ``wanted`` that the entry mirror held when the index was last brought up to
        date (the lock held, after ``current``)."""
        return wanted & self.entry_names

    def _apply(self, read: tuple) -> bool:
        """Feed what ``_read`` found (the lock held); False when it found the database changed."""
        _, found = read
        if found is None:
            return False
        ids, runs, new_dispatches, dispatch_rows, new_runs, run_rows, entries = found
        if entries is not None:
            self._take_entries(*entries)
        index = self.index
        for _, dispatch_id, board, created, record in dispatch_rows:
            request_id = str(dispatch_id)
            if request_id in self.seen_dispatches:
                continue  # fed meanwhile (this process dispatched it)
            record = record or {}
            index.dispatched(
                board,
                request_id,
                PromptKeys.from_dict(record.get("prompt")),
                _number(record.get("work_ms")),
                at=created.timestamp(),
            )
        for pk in new_dispatches:  # encode dispatches and runs for a whole namespace included: nothing to feed
            self._remember(self.seen_dispatches, str(ids[pk]))
        if ids:  # rows fed already (``feed``) move the cursor too
            top = max(ids)
            self.dispatch_cursor, self.marks = top, (ids[top], self.marks[1])
        if new_runs:
            for _, run_id, board, created, error, breakdown in run_rows:
                request_id = str(run_id)
                if request_id in self.seen_runs:
                    continue
                self._remember(self.seen_runs, request_id)
                if error:
                    index.reported(board, request_id, failed=True, at=created.timestamp())
                else:
                    _learn(index, board, request_id, breakdown, at=created.timestamp())
            top = max(runs)
            self.run_cursor, self.marks = top, (self.marks[0], runs[top])
        return True

    # -- the web process's follower ----------------------------------------------------------------
    def follow_in_background(self, every_s: float) -> None:
        """Follow the rows other processes write every ``every_s`` seconds from a thread of this
        process, so that a decision reads memory only: following inline was about half a decision's
        time at 1,000 boards, its queries each a point where the deciding thread gave the
        interpreter to the web process's other threads (``bench fleet-sim``). A decision then sees
        rows other processes wrote up to ``every_s`` before it (this process's own dispatches at
        once, ``feed``); one made while the follower is late, stopped or absent follows inline as
        before. A web process's start-up calls this (``dashboard.asgi``); nothing else does."""
        with self.lock:
            if every_s <= 0 or (self._follower is not None and self._follower.is_alive()):
                return
            self._follow_every = every_s
            self._follower = threading.Thread(target=self._follow_loop, name="edgecache-routing-follow", daemon=True)
            self._follower.start()

    def _fresh(self) -> bool:
        """Whether the follower followed lately enough for a decision to trust it."""
        return (
            self._follower is not None
            and time.monotonic() - self._followed_at < max(self.FRESH_S, 4 * self._follow_every)
            and self._follower.is_alive()
        )

    def _follow_loop(self) -> None:
        from django.db import connections

        failing = False
        while True:
            time.sleep(self._follow_every)
            try:
                self._follow_once()
                failing = False
            except Exception as exc:  # decisions follow inline meanwhile (the follower is not fresh)
                if not failing:
                    log.warning("routing history not followed in the background: %s: %s", type(exc).__name__, exc)
                failing = True
                connections.close_all()  # this thread's connection, which may be the broken part

    def _follow_once(self) -> None:
        """One look at the rows written since the cursors: read without the lock, fed under it."""
        if self.index is None:
            return  # the first decision builds it
        read = self._read(self._lookback())
        with self.lock:
            if self._cursors() != read[0]:
                return  # followed or rebuilt meanwhile: the next look reads from the new cursors
            if self._apply(read):
                self._followed_at = time.monotonic()
            else:
                self._followed_at = float("-inf")  # the database changed: the next decision rebuilds

    def feed(self, request_id: str, board: str, record: dict, created) -> None:
        """A run this process dispatched a moment ago (its row just written): into the index now,
        so the next decision's follow finds it already fed and need not read it back (one query
        fewer per decision, most of a decision's time in a loaded web process). The cursor does not
        move: rows other processes wrote before it are still read. Nothing before the first build."""
        with self.lock:
            if self.index is None or request_id in self.seen_dispatches:
                return
            record = record or {}
            self.index.dispatched(
                board,
                request_id,
                PromptKeys.from_dict(record.get("prompt")),
                _number(record.get("work_ms")),
                at=created.timestamp(),
            )
            self._remember(self.seen_dispatches, request_id)

    def _expire(self, now: float) -> None:
        """Runs nobody took before their expiry: the board holds nothing of them and owes nothing."""
        expired_before = now - settings.EDGECACHE_TASK_EXPIRES
        for board in list(self.index.busy):  # only boards that owe runs
            history = self.index.boards[board]
            for request_id in [
                rid for rid, item in history.outstanding.items() if item.at is not None and item.at < expired_before
            ]:
                self.index.reported(board, request_id, failed=True)

    def _remember(self, seen: dict, request_id: str) -> None:
        seen[request_id] = None
        if len(seen) > self.SEEN:
            del seen[next(iter(seen))]


@functools.lru_cache(maxsize=None)
def _ids_sql(model, vendor: str) -> str:
    """The ORM's SQL for ``model``'s (pk, request_id) rows from a pk on, compiled once: a decision
    runs it twice, and compiling the query cost more than running it (0.2-0.3 ms each)."""
    sql, params = model.objects.filter(pk__gte=0).values_list("pk", "request_id").query.sql_with_params()
    if list(params) != [0]:
        raise RuntimeError(f"unexpected parameters in the routing follow query: {params!r}")
    return sql


def _ids_from(model, first_pk: int) -> dict:
    """``{pk: request_id}`` of ``model``'s rows from ``first_pk`` on, as ``values_list`` gives them."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(_ids_sql(model, connection.vendor), [first_pk])
        return {pk: value if isinstance(value, uuid.UUID) else uuid.UUID(value) for pk, value in cursor.fetchall()}


def _entry_table(connection) -> tuple[str, str, str]:
    quote = connection.ops.quote_name
    return (
        quote(CacheEntry._meta.db_table),
        quote(CacheEntry._meta.pk.column),
        quote(CacheEntry._meta.get_field("key").column),
    )


def _entry_top_sql(connection) -> str:
    """The mirror's row count and its newest row (pk, name), in one statement (no row: empty)."""
    table, pk, key = _entry_table(connection)
    return f"SELECT (SELECT COUNT(*) FROM {table}), {pk}, {key} FROM {table} ORDER BY {pk} DESC LIMIT 1"


def _entry_rows(from_pk: int) -> dict[int, str]:
    """``{pk: name}`` of the mirror's rows from ``from_pk`` on."""
    from django.db import connection

    table, pk, key = _entry_table(connection)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {pk}, {key} FROM {table} WHERE {pk} >= %s", [from_pk])
        return dict(cursor.fetchall())


STATE = RoutingState()


class Candidates:
    """The devices of each namespace the API routes among, read at most once per ``TTL_S`` per web
    process (1,000 devices take ~50 ms to read and decode; a decision takes a few), with what the
    router reads of each worked out once per read (``Roster``). A device saved in this process
    (registered, edited, revoked, a heartbeat recorded here) is seen at once; heartbeats recorded
    by a control worker within ``TTL_S``, well inside a board's heartbeat interval.

    In a web process (``refresh_in_background``, from its start-up) the read is a thread's of its
    own: a request finding the devices read more than ``TTL_S`` ago routes on them (up to
    ``STALE_S`` old) while that thread reads them again, instead of reading them itself (at 1,000
    boards, one API request a second waited 50-100 ms for it, ``bench fleet-sim``)."""

    TTL_S = 1.0
    STALE_S = 5.0  # older than this, a roster is read again before it is used (the refresher stopped or far behind)

    def __init__(self):
        self._lock = threading.Lock()
        self._read: dict[str, tuple[float, Roster]] = {}
        self._generation = 0  # moved on by ``forget``: a read begun before it is not kept
        self._background = False
        self._wanted: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._refreshing: set[str] = set()  # namespaces asked of the refresher and not read yet
        self._refresher: threading.Thread | None = None

    def of(self, namespace: str) -> list[Device]:
        return self.roster(namespace).devices

    def roster(self, namespace: str, *, fresh: bool = False) -> "Roster":
        """The namespace's devices as read less than ``TTL_S`` ago, or less than ``STALE_S`` ago
        while the refresher reads them again (``fresh``: read now)."""
        with self._lock:
            read = self._read.get(namespace)
            if not fresh and read is not None:
                age = time.monotonic() - read[0]
                if age < self.TTL_S:
                    return read[1]
                if self._background and age < self.STALE_S:
                    self._refresh_later(namespace)
                    return read[1]
        return self._load(namespace)

    def _load(self, namespace: str) -> Roster:
        with self._lock:
            generation, read = self._generation, self._read.get(namespace)
        began, read_at = time.monotonic(), time.time()
        roster = Roster(
            list(Device.objects.filter(namespace_id=namespace, revoked_at__isnull=True).select_related("namespace")),
            read_at=read_at,
        )
        if read is not None:
            roster.carry(read[1])
        with self._lock:
            if generation == self._generation:
                self._read[namespace] = (began, roster)
        return roster

    def forget(self, **kwargs) -> None:
        with self._lock:
            self._read.clear()
            self._generation += 1

    # -- the web process's refresher ----------------------------------------------------------------
    def refresh_in_background(self) -> None:
        """Read the devices again from a thread of this process when a request finds them older
        than ``TTL_S``. A web process's start-up calls this (``dashboard.asgi``); nothing else does."""
        with self._lock:
            self._background = True

    def stop_background(self, timeout: float = 5.0) -> None:
        """Stop the refresher: requests read the devices themselves again, and its thread ends and
        closes its database connection (a test database is dropped only once nobody uses it)."""
        with self._lock:
            self._background = False
            refresher = self._refresher
        if refresher is not None and refresher.is_alive():
            self._wanted.put(None)
            refresher.join(timeout)

    def _refresh_later(self, namespace: str) -> None:
        """Ask the refresher to read ``namespace`` again (the lock held), once however often asked."""
        if self._refresher is None or not self._refresher.is_alive():
            self._refreshing.clear()
            self._refresher = threading.Thread(target=self._refresh_loop, name="edgecache-roster", daemon=True)
            self._refresher.start()
        if namespace not in self._refreshing:
            self._refreshing.add(namespace)
            self._wanted.put(namespace)

    def _refresh_loop(self) -> None:
        from django.db import close_old_connections, connections

        while True:
            namespace = self._wanted.get()
            if namespace is None:  # stop_background
                connections.close_all()
                return
            try:
                close_old_connections()  # its connection is kept between reads, closed when it failed or aged out
                self._load(namespace)
            except Exception as exc:  # requests read them themselves once they are STALE_S old
                log.warning(
                    "devices of namespace %s not read in the background: %s: %s", namespace, type(exc).__name__, exc
                )
                connections.close_all()  # this thread's connection, which may be the broken part
            finally:
                with self._lock:
                    self._refreshing.discard(namespace)


class _Entry:
    """What the router reads of one device, worked out once per read of it."""

    __slots__ = ("device", "name", "until", "models", "keys_kind", "idle_kind", "prefill", "decode", "applied")

    def __init__(self, device: Device):
        status = device.status or {}
        self.device = device
        self.name = device.name
        # Online while its last heartbeat is younger than ``offline_after`` (``Device.online_at``).
        self.until = (
            float("-inf")
            if device.revoked_at is not None or device.last_seen is None
            else device.last_seen.timestamp() + offline_after(status).total_seconds()
        )
        fingerprint = status.get("fingerprint")
        self.models = {value for value in (status.get("model"), fingerprint) if isinstance(value, str) and value}
        self.keys_kind = (
            device.cache_namespace,
            fingerprint,
        )  # boards of one namespace and model share a prompt's keys
        self.idle_kind = (
            device.namespace_id,
            device.namespace.share_across_devices,
            fingerprint,
            device.link_bandwidth_mbps,
            device.link_rtt_ms,
        )
        rates = status.get("rates")
        rates = rates if isinstance(rates, dict) else {}
        self.prefill, self.decode = (
            _number(rates.get("prefill_ms_per_token")),
            _number(rates.get("decode_ms_per_token")),
        )
        self.applied = None  # the index its measured rates were given to


class _Ranking:
    """A roster's boards of each idle kind in order of prefill rate (then position), as one index
    rates them: what a decision reads the fastest idle boards from without rating every board. Built
    once per roster and index (applying the rates each board measured), then kept in order as the
    index's rates change (its ``rate_changes``)."""

    def __init__(self, roster: "Roster", index: FleetIndex):
        self.index = index
        self.kinds: dict[tuple, list[tuple[float, int]]] = {}
        self.rated: dict[str, tuple[tuple, tuple[float, int]]] = {}  # board -> (its kind, its place)
        for entry in roster.entries:
            if entry.applied is not index:  # what it measured at start, until its runs say better
                index.measured(entry.name, prefill_ms_per_token=entry.prefill, decode_ms_per_token=entry.decode)
                entry.applied = index
        for position, entry in enumerate(roster.entries):
            place = (index.prefill_rate(entry.name), position)
            self.kinds.setdefault(entry.idle_kind, []).append(place)
            self.rated[entry.name] = (entry.idle_kind, place)
        for places in self.kinds.values():
            places.sort()
        self.epoch, self.seen = index.rate_epoch, len(index.rate_changes)  # the changes above are in

    def current(self, index: FleetIndex) -> bool:
        """Bring the order up to date with ``index``'s rate changes (False: another index, or its log
        started over: build again)."""
        if index is not self.index or index.rate_epoch != self.epoch:
            return False
        changed = index.rate_changes[self.seen :]
        self.seen = len(index.rate_changes)
        for name in set(changed):
            rated = self.rated.get(name)
            if rated is None:
                continue  # not a board of this roster
            kind, place = rated
            fresh = (index.prefill_rate(name), place[1])
            if fresh != place:
                places = self.kinds[kind]
                del places[bisect.bisect_left(places, place)]
                bisect.insort(places, fresh)
                self.rated[name] = (kind, fresh)
        return True


class Roster:
    """Devices as the router reads them: liveness as one instant, the kinds boards share, the rates
    they measured, each worked out once when the devices are read (``Candidates``) instead of once
    per device per decision (6-9 ms a decision at 1,000 boards, ``bench fleet-sim``); and, for the
    router, the boards by name, their liveness in order and the idle boards ranked by rate, so that
    a decision reads the boards that are busy or hold the prompt and the fastest idle ones of each
    kind, not the whole fleet."""

    def __init__(self, devices: list[Device], entries: list[_Entry] | None = None, read_at: float | None = None):
        self.devices = devices
        self.read_at = time.time() if read_at is None else read_at  # when the database said this (wall clock)
        self.entries = entries if entries is not None else [_Entry(device) for device in devices]
        self.by_name = {entry.name: (position, entry) for position, entry in enumerate(self.entries)}
        self.untils = sorted(entry.until for entry in self.entries)
        self.key_kinds = {entry.keys_kind: entry for entry in self.entries}  # one board of each (namespace, model)
        self.tenants = {
            entry.device.namespace_id for entry in self.entries
        }  # one, for a roster a run is routed in (``plan``)
        self._ranking: _Ranking | None = None
        self._serving: dict[str, Roster] = {}
        self._earlier: Roster | None = None  # the read this one carried from (its sub-rosters carry theirs)

    def ranking(self, index: FleetIndex) -> _Ranking:
        """The idle ranking as ``index`` rates the boards (the caller holds the routing state's lock)."""
        if self._ranking is None or not self._ranking.current(index):
            self._ranking = _Ranking(self, index)
        return self._ranking

    def online_count(self, now: float) -> int:
        return len(self.untils) - bisect.bisect_right(self.untils, now)

    def judged_at(self, now: float) -> float:
        """The moment this roster's liveness is judged at: ``now``, or, for a roster read longer ago
        than ``Candidates.TTL_S`` (one the refresher is reading again), ``TTL_S`` after it was read. A
        board that beat since is in the next read; judged at ``now``, a board beating every second
        looked offline in a read a few seconds old."""
        return min(now, self.read_at + Candidates.TTL_S)

    def carry(self, earlier: "Roster") -> None:
        """Keep what the router was told of each device by ``earlier`` (a read a second ago) where
        its rates are the same: else the first decision after each read gave every board its rates
        again (1,000 calls, the slowest decisions at 1,000 boards). Where every board is as it was
        (name, place, kind, measured rates), the idle ranking is kept too."""
        self._earlier, earlier._earlier = earlier, None
        before = {entry.name: entry for entry in earlier.entries}
        for entry in self.entries:
            old = before.get(entry.name)
            if old is not None and (old.prefill, old.decode) == (entry.prefill, entry.decode):
                entry.applied = old.applied
        if (
            earlier._ranking is not None
            and len(earlier.entries) == len(self.entries)
            and all(
                old.name == new.name and old.idle_kind == new.idle_kind and old.applied is new.applied
                for old, new in zip(earlier.entries, self.entries)
            )
        ):
            self._ranking = earlier._ranking

    def online(self, now: float | None = None) -> "Roster":
        now = time.time() if now is None else now
        entries = [entry for entry in self.entries if entry.until > now]
        return Roster([entry.device for entry in entries], entries)

    def serving(self, model: str) -> "Roster":
        """The boards serving ``model`` (worked out once per roster: its ranking lasts across decisions)."""
        found = self._serving.get(model)
        if found is None:
            entries = [entry for entry in self.entries if model and model in entry.models]
            found = Roster([entry.device for entry in entries], entries)
            earlier = self._earlier._serving.get(model) if self._earlier is not None else None
            if earlier is not None:
                found.carry(earlier)
            if entries:  # a model nobody serves (any name a request sends) is not kept
                self._serving[model] = found
        return found

    def __len__(self) -> int:
        return len(self.entries)


CANDIDATES = Candidates()


def _number(value) -> float:
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= 0
        else 0.0
    )


def plan(
    devices: "list[Device] | Roster",
    prompt: RunRequest,
    *,
    preferred: str = "",
    policy: str = "cache-aware",
    all_online: bool = False,
    online_at: float | None = None,
) -> Routed | None:
    """The board of ``devices`` that should answer ``prompt`` (None when none is online), with the
    record the Dispatch keeps: the choice, its expected time and saving, and the prompt's keys.
    A board is online while its last heartbeat is fresh at ``online_at`` (default: now; the API
    passes the instant it counted the boards it routes among), or whatever it says (``all_online``).

    Weighed are the boards the routing history says are busy or hold part of the prompt (the
    index keeps both as sets), and of the other online boards, which hold none of it and owe
    nothing, the two fastest of each kind (namespace, model, link; the roster keeps them ranked by
    rate) and the ``preferred`` board: an idle board that holds nothing is expected to take its
    prefill at its rate and its answer at its decode pace, or a fetch that is the same for every
    board of its kind, so no other can come first or second (where a board's two rates rank alike,
    as they do when both come from its CPU). That gives the choice, runner-up and saving of weighing every board, at a
    cost that grows with the boards that are busy or hold the prompt, not with the fleet.

    ``devices`` are boards of one namespace (the run's): boards of several are a ValueError, so no
    run is sent to, or weighed against, another tenant's board."""
    roster = devices if isinstance(devices, Roster) else Roster(devices)
    if not roster.entries:
        return None
    if len(roster.tenants) > 1:  # a run goes to, and its record names, boards of its own namespace only
        raise ValueError(
            f"one run is routed among the boards of one namespace, not of {', '.join(sorted(roster.tenants))}"
        )
    began, began_cpu = time.perf_counter(), time.thread_time()
    layout = prompt_tokens(prompt)
    tokens = layout[0] if layout else None
    now = timezone.now().timestamp()
    alive_after = float("-inf") if all_online else (now if online_at is None else online_at)

    def alive(entry: _Entry) -> bool:  # ``all_online``: a named board, even one that never beat yet
        return all_online or entry.until > alive_after

    kinds: dict[tuple, PromptKeys] = {}  # (namespace, model) -> the prompt's keys there: boards of one kind share them

    def keys_of(entry: _Entry) -> PromptKeys:
        if entry.keys_kind not in kinds:
            kinds[entry.keys_kind] = keys_for(entry.device, layout)
        return kinds[entry.keys_kind]

    with STATE.lock:
        index = STATE.current(now)
        ranking = roster.ranking(index)  # applies the rates boards measured; kept in order since
        online = len(roster.entries) if all_online else roster.online_count(alive_after)
        weigh: dict[int, _Entry] = {}  # position -> device: weighed as they are
        active = set(index.busy)
        for kind, entry in roster.key_kinds.items():
            active.update(
                name
                for name in index.holding(keys_of(entry))
                if name in roster.by_name and roster.by_name[name][1].keys_kind == kind
            )
        for name in active:
            found = roster.by_name.get(name)
            if found is not None and alive(found[1]):
                weigh[found[0]] = found[1]
        # Idle and holding none of the prompt: its expected time is its prefill at its rate (or a
        # fetch, the same for its kind), so only the two fastest of its kind can come first or second.
        for places in ranking.kinds.values():
            taken = 0
            for _, position in places:
                entry = roster.entries[position]
                if entry.name in active or not alive(entry):
                    continue
                weigh[position] = entry
                taken += 1
                if taken == 2:
                    break
        if preferred in roster.by_name and preferred not in active:
            position, entry = roster.by_name[preferred]
            if alive(entry):
                weigh[position] = entry
        chosen_entries = [weigh[position] for position in sorted(weigh)]
        weighed = [entry.device for entry in chosen_entries]
        keys = {entry.name: keys_of(entry) for entry in chosen_entries}
        mirrored = STATE.mirrored(_wanted_names(weighed, keys))  # followed with the history: no query here
        views = [
            index.view(
                device.name,
                keys[device.name],
                online=True,
                link=link_of(device),
                ram_budget_bytes=ram_budget(device),
                cachebox_tokens=cachebox_tokens(device, keys[device.name], mirrored),
                now=now,
            )
            for device in weighed
        ]
        chosen = route(len(tokens or ()), views, preferred=preferred, answer_tokens=prompt.max_tokens)
        if chosen is None:
            return None
        device = next(device for device in weighed if device.name == chosen.board)
        work_ms = index.work_ms(
            device.name, keys[device.name], prompt.max_tokens, link_of(device), estimate=chosen.chosen
        )
    record = {
        **chosen.record(),
        "candidates": online,
        "policy": policy,
        "work_ms": round(work_ms, 3),
        "prompt": keys[device.name].as_dict(),
        "decided_ms": round((time.perf_counter() - began) * 1000.0, 3),  # the whole decision, tokenizing included
        # ... of which this thread ran: the rest it waited (for the interpreter's lock, a CPU, the tokenizer)
        "decided_cpu_ms": round((time.thread_time() - began_cpu) * 1000.0, 3),
    }
    return Routed(device, record, carried(layout))


def named(device: Device, prompt: RunRequest) -> Routed:
    """A run sent to a named board: the record of its prompt's keys and expected work (no choice
    made), and its tokens."""
    routed = plan([device], prompt, policy="named", all_online=True)  # it waits in the board's queue if it is away
    return routed if routed is not None else Routed(device, {})


def history(device: Device, prompt: RunRequest) -> dict:
    """The record of a run sent to a named board (``named``)."""
    return named(device, prompt).record


def shown(record: dict) -> dict:
    """The part of a routing record a run keeps and shows (without the prompt's keys)."""
    return {key: value for key, value in (record or {}).items() if key not in ("prompt", "work_ms")}

"""bench fleet-sim: its summary maths, the routing state kept in memory (the same decisions as the
history rebuilt from the database for every request), and a small simulated fleet against a real stack."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from dashboard.bench.fleet_sim import (
    beyond_chosen_wait,
    p50_p99,
    per_board_minute,
    thirds_p99,
    trend_per_minute,
    verdicts,
)
from inference.placement import PromptKeys, route
from tests.dashboard.test_dashboard import control_plane  # noqa: F401 (fixture)


# -- the summary maths ----------------------------------------------------------------------------
def test_medians_and_p99_ignore_missing_values_and_say_how_many():
    assert p50_p99([1.0, None, 3.0, 2.0]) == {"p50": 2.0, "p99": 2.98, "n": 3}
    assert p50_p99([]) == {"p50": None, "p99": None, "n": 0}


def test_a_lag_that_grows_by_one_second_a_minute_has_that_trend_and_a_flat_one_none():
    assert trend_per_minute([(t, 100.0 + t * 1000.0 / 60.0) for t in range(0, 120, 5)]) == pytest.approx(1000.0)
    assert trend_per_minute([(t, 250.0) for t in range(10)]) == 0.0
    assert trend_per_minute([(1, 5.0), (2, 6.0)]) is None


def test_p99_by_third_of_the_run_shows_where_a_lag_grew():
    points = (
        [(t, 10.0) for t in range(0, 20)] + [(t, 10.0) for t in range(20, 40)] + [(t, 900.0) for t in range(40, 60)]
    )
    first, middle, last = thirds_p99(points)
    assert first == middle == 10.0 and last == 900.0
    assert thirds_p99([]) == [None, None, None]


def test_cpu_per_board_per_minute():
    assert per_board_minute(60.0, 1000, 120.0) == 0.03  # 60 CPU s over 2 minutes for 1,000 boards
    assert per_board_minute(1.0, 0, 10.0) is None


def test_the_overhead_beyond_the_routers_chosen_wait_leaves_out_only_the_wait_it_expected():
    # Sent to wait 260 ms for the board holding the prompt, waited 264: 4 ms more than chosen, plus 6 of API.
    assert beyond_chosen_wait(270.0, 264.0, 260.0) == 10.0
    # Expected no wait but waited 200 ms (a board slower than its rates): all of it stays in.
    assert beyond_chosen_wait(206.0, 200.0, 0.0) == 206.0
    # Waited less than expected: only what it waited comes off.
    assert beyond_chosen_wait(58.0, 50.0, 300.0) == 8.0
    # No record of the run, no queue figure or no first chunk: nothing comes off, or there is no figure.
    assert beyond_chosen_wait(30.0, 20.0, None) == 30.0
    assert beyond_chosen_wait(30.0, None, 20.0) == 30.0
    assert beyond_chosen_wait(None, 20.0, 20.0) is None


def test_a_simulated_board_holds_what_it_computed_as_the_router_expects_a_board_to():
    """The router expects a board to hold its last prompt in its context and those before in its RAM
    tier: a simulated board that held nothing computed again what it was sent for its context (a
    wait behind its last run, then a cold prefill: 250 ms of queue at fleet-sim's p99)."""
    from dashboard.bench.sim_board import RAM_TIER_BYTES, SimBoard

    board = SimBoard(me=None, rate_ms=1.0)
    third = RAM_TIER_BYTES // 3
    for key in (b"a", b"b", b"c"):
        board.hold(key, third)
    assert list(board.held) == [b"a", b"b", b"c"]  # c in its context, a and b in its RAM tier
    board.hold(b"a", third)  # used again: now the last, in its context
    board.hold(b"d", third)  # over the budget: the least recently held (b) leaves
    assert list(board.held) == [b"c", b"a", b"d"]
    board.hold(b"huge", 2 * RAM_TIER_BYTES)  # over the budget alone: only the context holds it
    assert list(board.held) == [b"huge"]


def test_verdicts_name_each_target_and_a_growing_lag_fails():
    doc = {
        "heartbeat_ingest_lag_ms": {"p99": 400.0, "p99_by_third": [100.0, 150.0, 900.0]},
        "routing_decision_ms": {"p99": 4.0},
        "catalog_sync_lag_ms": {"p99": 1500.0},
        "api_overhead_beyond_chosen_wait_ms": {"p99": 61.0},
        "render_ms": {"/": {"p50": 120.0}, "/devices/": {"p50": 310.0}},
        "lost_runs": 0,
        "errors": {"total": 0},
    }
    assert verdicts(doc) == {
        "routing_decision_p99_le_5ms": True,
        "routing_decision_p99_le_5ms_quiet": None,
        "heartbeat_lag_p99_le_1s": True,
        "heartbeat_lag_not_growing": False,
        "catalog_sync_lag_p99_le_2s": True,
        "api_overhead_p99_le_60ms": False,
        "pages_le_300ms": False,
        "pages_le_300ms_quiet": None,
        "no_lost_runs": True,
        "no_errors": True,
    }


# -- the routing state kept in memory -------------------------------------------------------------
def _keys(*names: str) -> PromptKeys:
    return PromptKeys(tuple(128 * (index + 1) for index in range(len(names))), names)


def _views(index, devices, keys, now):
    from dashboard.router import ram_budget

    return [
        index.view(device.name, keys, online=True, ram_budget_bytes=ram_budget(device), now=now) for device in devices
    ]


def _dispatch(device, keys: PromptKeys, *, ago_s: float, work_ms: float = 900.0):
    from dashboard.models import Dispatch

    row = Dispatch.objects.create(
        request_id=uuid.uuid4(),
        kind="run",
        device=device,
        namespace=device.namespace_id,
        routing={"prompt": keys.as_dict(), "work_ms": work_ms},
    )
    Dispatch.objects.filter(pk=row.pk).update(created=timezone.now() - timedelta(seconds=ago_s))
    return str(row.request_id)


def _report(device, request_id, *, ago_s: float, error: str = "", prompt_tokens=384, matched=0, prefill_ms=1900.0):
    from dashboard.models import InferenceRun

    run = InferenceRun.objects.create(
        request_id=request_id,
        device=device,
        error=error,
        breakdown={
            "prompt_tokens": prompt_tokens,
            "matched_tokens": matched,
            "prefill_ms": prefill_ms,
            "decode_ms": 300.0,
            "generated_tokens": 4,
        },
    )
    InferenceRun.objects.filter(pk=run.pk).update(created=timezone.now() - timedelta(seconds=ago_s))


@pytest.mark.django_db
def test_the_routing_state_kept_in_memory_decides_as_the_history_rebuilt_for_each_request(settings):
    """Dispatches, answers, failures, an expired run and rates too old to use, first read whole,
    then followed row by row: every board's view of a prompt, and so the router's choice, is the
    same as ``fleet_index`` rebuilt from the database."""
    from dashboard.models import Device, Namespace
    from dashboard.router import RoutingState, fleet_index
    from inference.placement import RATE_MAX_AGE_S

    settings.EDGECACHE_TASK_EXPIRES = 600
    Namespace.objects.get_or_create(name="default")
    devices = [
        Device.objects.create(name=f"board-{n}", status={"fingerprint": "ab", "ram_tier": {"budget_bytes": 40 * 2**20}})
        for n in range(5)
    ]
    a, b, c, d, e = devices
    shared = _keys("k1", "k2", "k3")
    other = _keys("x1", "x2")
    # a: answered the shared prompt (fast); b: failed it; c: an expired run and a run under way; d: nothing.
    _report(a, _dispatch(a, shared, ago_s=50), ago_s=45, prefill_ms=1200.0)
    _report(b, _dispatch(b, shared, ago_s=40), ago_s=39, error="the board failed")
    _dispatch(c, other, ago_s=900)
    _dispatch(c, shared, ago_s=2, work_ms=3000.0)
    for index in range(40):  # more than HISTORY dispatches on one board
        _report(d, _dispatch(d, _keys(f"d{index}"), ago_s=300 - index), ago_s=299 - index, prefill_ms=500.0 + index)
    # e: a slow run too long ago to go by (its rate is the prior again), and a recent one that matters.
    _report(e, _dispatch(e, other, ago_s=RATE_MAX_AGE_S + 60), ago_s=RATE_MAX_AGE_S + 50, prefill_ms=384 * 90.0)
    _report(e, _dispatch(e, _keys("e1"), ago_s=20), ago_s=19, prefill_ms=384 * 6.0)

    state = RoutingState()
    now = timezone.now().timestamp()
    assert state.current(now).prefill_rate("board-4") == fleet_index(devices).prefill_rate("board-4") == 6.0
    for prompt in (shared, other, _keys("k1", "zz")):
        expected = _views(fleet_index(devices), devices, prompt, now)
        assert _views(state.current(now), devices, prompt, now) == expected
        assert route(prompt.tokens, _views(state.current(now), devices, prompt, now)) == route(prompt.tokens, expected)

    # Followed: new rows are read by id, not the whole history.
    built = state.built_at
    late = _dispatch(b, other, ago_s=1)
    _report(c, _dispatch(c, other, ago_s=1), ago_s=0.5, prefill_ms=7000.0)
    _report(b, late, ago_s=0.2)
    now = timezone.now().timestamp()
    for prompt in (shared, other):
        assert _views(state.current(now), devices, prompt, now) == _views(fleet_index(devices), devices, prompt, now)
    assert state.built_at == built  # followed, not rebuilt


@pytest.mark.django_db(
    transaction=True, serialized_rollback=True
)  # the rebuild reads from a thread of its own; migrated rows left as found
def test_the_periodic_rebuild_happens_beside_decisions_and_sees_a_run_moved_to_another_board():
    from dashboard.models import Device, Dispatch, Namespace
    from dashboard.router import RoutingState, fleet_index

    Namespace.objects.get_or_create(name="default")
    first, second = (Device.objects.create(name=f"board-{n}", status={"fingerprint": "ab"}) for n in range(2))
    request_id = _dispatch(first, _keys("k1"), ago_s=1, work_ms=5000.0)
    state = RoutingState()
    now = timezone.now().timestamp()
    before = state.current(now)
    assert before.queued_ms("board-0") > 0 and before.queued_ms("board-1") == 0
    Dispatch.objects.filter(request_id=request_id).update(device=second)  # re-sent: changed in place, no new row
    state.built_at -= state.REBUILD_S + 1
    assert state.current(now) is before  # the decision goes on with the index it has
    state._rebuilding.join(30)
    after = state.current(now)
    assert after is not before and state.built_at > now - 5
    devices = [first, second]
    assert _views(after, devices, _keys("k1"), now) == _views(fleet_index(devices), devices, _keys("k1"), now)
    assert after.queued_ms("board-0") == 0 and after.queued_ms("board-1") > 0


@pytest.mark.django_db
def test_a_dispatch_committed_after_a_higher_id_is_followed_within_a_second():
    """PostgreSQL may commit a lower id after a higher one: decisions read only the cursor's row and
    newer ones, and once a second the ids behind it too."""
    from dashboard.models import Device, Dispatch, Namespace
    from dashboard.router import RoutingState

    Namespace.objects.get_or_create(name="default")
    board = Device.objects.create(name="board-late", status={"fingerprint": "ab"})
    _dispatch(board, _keys("k1"), ago_s=1, work_ms=1000.0)
    state = RoutingState()
    assert state.current().queued_ms("board-late") == pytest.approx(1000.0, abs=10.0)
    first = Dispatch.objects.get()
    skipped = first.pk + 1  # its id was taken, its transaction commits later
    newer = Dispatch.objects.create(
        pk=skipped + 1,
        request_id=uuid.uuid4(),
        kind="run",
        device=board,
        namespace="default",
        routing={"prompt": _keys("k2").as_dict(), "work_ms": 2000.0},
    )
    assert state.current().queued_ms("board-late") == pytest.approx(3000.0, abs=10.0)
    Dispatch.objects.create(
        pk=skipped,
        request_id=uuid.uuid4(),
        kind="run",
        device=board,
        namespace="default",
        routing={"prompt": _keys("k3").as_dict(), "work_ms": 4000.0},
    )
    assert newer.pk > skipped
    assert state.current().queued_ms("board-late") == pytest.approx(3000.0, abs=10.0)  # behind the cursor: not yet
    state._looked_back -= state.LOOKBACK_EVERY_S  # a second later
    assert state.current().queued_ms("board-late") == pytest.approx(7000.0, abs=10.0)


@pytest.mark.django_db
def test_a_run_this_process_dispatched_is_in_the_routing_state_at_once_and_counted_once(django_assert_num_queries):
    """The web process feeds its own dispatches into its routing state as it writes them: the next
    decision's follow reads no row back (its two id queries and the mirror's newest row), owes the run's work once, and a
    row another process wrote meanwhile is still read."""
    from dashboard.models import Device, Dispatch, Namespace
    from dashboard.router import RoutingState

    Namespace.objects.get_or_create(name="default")
    board = Device.objects.create(name="board-fed", status={"fingerprint": "ab"})
    state = RoutingState()
    state.current()
    state._looked_back = float("inf")  # no look-back in this test: only the cursor's row and newer
    mine = Dispatch.objects.create(
        request_id=uuid.uuid4(),
        kind="run",
        device=board,
        namespace="default",
        routing={"prompt": _keys("k1").as_dict(), "work_ms": 1000.0},
    )
    state.feed(str(mine.request_id), board.name, mine.routing, mine.created)
    assert state.index.queued_ms("board-fed") == pytest.approx(1000.0)
    with django_assert_num_queries(3):  # the ids of both tables and the mirror's newest row: nothing fetched back
        assert state.current().queued_ms("board-fed") == pytest.approx(1000.0, abs=10.0)
    _dispatch(board, _keys("k2"), ago_s=0, work_ms=2000.0)  # written by another process
    assert state.current().queued_ms("board-fed") == pytest.approx(3000.0, abs=10.0)
    state.feed(str(mine.request_id), board.name, mine.routing, mine.created)  # fed twice: counted once
    assert state.current().queued_ms("board-fed") == pytest.approx(3000.0, abs=10.0)


@pytest.mark.django_db
def test_with_a_fresh_follower_a_decision_reads_memory_only_and_without_one_it_follows_inline(
    django_assert_num_queries,
):
    """A web process's follower reads what other processes wrote (``follow_in_background``), so its
    decisions run no query; once the follower is late, stopped or absent, a decision follows inline
    as every decision did before. The follower's look is driven by hand here, in the test's thread."""
    import threading

    from dashboard.models import Device, Namespace
    from dashboard.router import RoutingState

    Namespace.objects.get_or_create(name="default")
    board = Device.objects.create(name="board-followed", status={"fingerprint": "ab"})
    state = RoutingState()
    state.current()
    state._looked_back = float("inf")  # no look-back in this test: only the cursor's row and newer
    stop = threading.Event()
    state._follower, state._follow_every = (
        threading.Thread(target=stop.wait, daemon=True),
        0.05,
    )  # alive, and idle: looks are made below
    state._follower.start()
    try:
        _dispatch(board, _keys("k1"), ago_s=0, work_ms=1000.0)  # written by another process
        state._follow_once()  # the follower's look
        with django_assert_num_queries(0):
            assert state.current().queued_ms("board-followed") == pytest.approx(1000.0, abs=10.0)
        _dispatch(board, _keys("k2"), ago_s=0, work_ms=2000.0)
        with django_assert_num_queries(0):  # not looked at yet: a decision does not read it
            assert state.current().queued_ms("board-followed") == pytest.approx(1000.0, abs=10.0)
        state._followed_at -= state.FRESH_S  # the follower fell behind
        assert state.current().queued_ms("board-followed") == pytest.approx(3000.0, abs=10.0)  # followed inline
    finally:
        stop.set()
    state._follower.join(5)
    _dispatch(board, _keys("k3"), ago_s=0, work_ms=4000.0)
    state._followed_at = time.monotonic()  # looked a moment ago, but the follower is gone
    assert state.current().queued_ms("board-followed") == pytest.approx(7000.0, abs=10.0)


@pytest.mark.django_db
def test_the_routing_state_starts_over_when_the_rows_it_read_are_gone():
    from dashboard.models import Device, Dispatch, Namespace
    from dashboard.router import RoutingState

    Namespace.objects.get_or_create(name="default")
    board = Device.objects.create(name="board-x", status={"fingerprint": "ab"})
    _dispatch(board, _keys("k1"), ago_s=1)
    state = RoutingState()
    assert state.current().queued_ms("board-x") == pytest.approx(900.0, abs=5.0)
    Dispatch.objects.all().delete()  # a database restored from before those runs
    assert state.current().queued_ms("board-x") == 0.0


@pytest.mark.django_db
def test_weighing_two_boards_of_each_unused_kind_chooses_as_weighing_every_board(monkeypatch):
    """Of the boards routing knows nothing of, two per kind (namespace, model, link) are weighed: the
    choice, runner-up, expected time and saving are those of weighing all of them, the preferred
    board still wins a tie, and the record counts every online candidate."""
    from dashboard import actions, router
    from dashboard.models import Device, Namespace

    Namespace.objects.get_or_create(name="default")
    status = {"model": "m.gguf", "fingerprint": "ab", "heartbeat_s": 5, "ram_tier": {"budget_bytes": 64 * 2**20}}
    devices = [
        Device.objects.create(
            name=f"board-{n:02d}",
            status=status,
            last_seen=timezone.now(),
            link_bandwidth_mbps=20.0 if n % 7 == 0 else None,
        )
        for n in range(30)
    ]
    layouts = {"held": (list(range(300)), ()), "new": (list(range(1000, 1400)), ())}
    monkeypatch.setattr(router, "prompt_tokens", lambda prompt: layouts[prompt.segments[0]])
    held, new = actions.run_request(["held"], max_tokens=4), actions.run_request(["new"], max_tokens=4)
    _dispatch(devices[3], router.keys_for(devices[3], layouts["held"]), ago_s=30, work_ms=500.0)
    _report(devices[3], str(devices[3].dispatches.get().request_id), ago_s=29)
    _dispatch(devices[5], router.keys_for(devices[5], layouts["new"]), ago_s=1, work_ms=4000.0)  # busy
    # Idle boards that learned their rates on other prompts: a fast one and a slow one.
    other = PromptKeys((128,), ("other-prompt",))
    for board, prefill_ms in ((devices[12], 300.0), (devices[13], 5000.0)):
        _report(board, _dispatch(board, other, ago_s=20), ago_s=19, prefill_ms=prefill_ms)

    def weighing_all(prompt, preferred=""):
        index = router.fleet_index(devices)
        now = timezone.now().timestamp()
        keys = {d.name: router.keys_for(d, layouts[prompt.segments[0]]) for d in devices}
        views = [
            index.view(
                d.name,
                keys[d.name],
                link=router.link_of(d),
                ram_budget_bytes=router.ram_budget(d),
                cachebox_tokens=0,
                now=now,
            )
            for d in devices
        ]
        return route(len(layouts[prompt.segments[0]][0]), views, preferred=preferred)

    for prompt, preferred in ((held, ""), (new, ""), (new, "board-26"), (held, "board-26"), (new, "board-13")):
        full = weighing_all(prompt, preferred)
        chosen = router.plan(devices, prompt, preferred=preferred)
        record = full.record()
        assert chosen.device.name == full.board
        for field in ("board", "runner_up", "held_tokens", "source"):
            assert chosen.record[field] == record[field], field
        for field in ("expected_ms", "runner_up_ms", "saving_ms"):
            assert chosen.record[field] == pytest.approx(record[field], abs=50.0), (
                field
            )  # the busy board's queue drains between the two
        assert chosen.record["candidates"] == 30
    assert router.plan(devices, held).device.name == "board-03"  # it holds the prompt
    assert router.plan(devices, new).device.name == "board-12"  # nobody holds it: the fastest idle board
    assert router.plan(devices, new, preferred="board-26").device.name == "board-12"  # a hint wins ties only
    # The API's way: a roster read once (Candidates) and reused by many decisions chooses the same.
    roster = router.Roster(devices)
    for _ in range(2):
        assert router.plan(roster, held).device.name == "board-03"
        via_roster, via_list = (
            router.plan(roster, new, preferred="board-26").record,
            router.plan(devices, new, preferred="board-26").record,
        )
        for field in ("board", "runner_up", "held_tokens", "source", "candidates", "prompt"):
            assert via_roster[field] == via_list[field], field


@pytest.mark.django_db(transaction=True, serialized_rollback=True)  # the rebuild reads from a thread of its own
def test_a_roster_reused_by_many_decisions_follows_the_rates_and_queues_its_boards_report(monkeypatch):
    """The API reads its devices once a second and decides many times on that read: the fastest
    idle boards it keeps ranked follow every report (a board that proves faster wins the next
    decision), a board that becomes busy is weighed with its queue, and one that went silent is not
    chosen, all on the same roster."""
    from dashboard import actions, router
    from dashboard.models import Device, Namespace

    Namespace.objects.get_or_create(name="default")
    devices = [
        Device.objects.create(
            name=f"board-{n:02d}",
            last_seen=timezone.now() - timedelta(seconds=5 if n == 0 else 0),  # board-00 beat last 5 s ago
            status={
                "model": "m.gguf",
                "fingerprint": "ab",
                "heartbeat_s": 5,
                "rates": {"prefill_ms_per_token": 5.0 + n, "decode_ms_per_token": 30.0},
            },
        )
        for n in range(10)
    ]
    layouts = {"new": (list(range(1000, 1400)), ())}
    monkeypatch.setattr(router, "prompt_tokens", lambda prompt: layouts[prompt.segments[0]])
    new = actions.run_request(["new"], max_tokens=4)
    roster = router.Roster(devices)
    assert router.plan(roster, new).device.name == "board-00"  # the fastest it measured
    other = PromptKeys((128,), ("other-prompt",))
    _report(
        devices[7], _dispatch(devices[7], other, ago_s=2), ago_s=1, prompt_tokens=384, prefill_ms=192.0
    )  # 0.5 ms a token
    chosen = router.plan(roster, new)
    assert chosen.device.name == "board-07" and chosen.record["runner_up"] == "board-00"
    _dispatch(devices[7], other, ago_s=0, work_ms=60_000.0)  # now it owes a minute of work
    chosen = router.plan(roster, new)
    assert chosen.device.name == "board-00" and chosen.record["candidates"] == 10
    # Silent since the roster was read (its heartbeats missed as of a later instant): not chosen, not counted.
    later = roster.entries[0].until + 1
    chosen = router.plan(roster, new, online_at=later)
    assert chosen.device.name == "board-01" and chosen.record["candidates"] == 9


@pytest.mark.django_db
def test_a_board_shunned_after_a_slow_spell_is_ranked_first_again_once_its_slow_runs_are_old(monkeypatch):
    """The roster's ranking of idle boards follows their rates as they age: a board whose recent
    runs were slow loses its place while they are recent and takes it back (the rate it measured)
    once they are older than ``RATE_MAX_AGE_S``, on the same roster and routing state."""
    from dashboard import actions, router
    from dashboard.models import Device, Namespace
    from inference.placement import RATE_MAX_AGE_S

    Namespace.objects.get_or_create(name="default")
    devices = [
        Device.objects.create(
            name=f"board-{n:02d}",
            last_seen=timezone.now(),
            status={
                "model": "m.gguf",
                "fingerprint": "ab",
                "heartbeat_s": 5,
                "rates": {"prefill_ms_per_token": 5.0 + n, "decode_ms_per_token": 30.0},
            },
        )
        for n in range(5)
    ]
    layouts = {"new": (list(range(1000, 1400)), ())}
    monkeypatch.setattr(router, "prompt_tokens", lambda prompt: layouts[prompt.segments[0]])
    new = actions.run_request(["new"], max_tokens=4)
    roster = router.Roster(devices)
    started = timezone.now()
    assert router.plan(roster, new).device.name == "board-00"  # the fastest it measured
    other = PromptKeys((128,), ("other-prompt",))
    for n in range(3):  # board-00 slowed down (the machine was loaded): 60 ms a token
        _report(devices[0], _dispatch(devices[0], other, ago_s=30 - n), ago_s=29 - n, prefill_ms=384 * 60.0)
    chosen = router.plan(roster, new)
    assert chosen.device.name == "board-01" and "board-00" not in (chosen.record["board"], chosen.record["runner_up"])

    def later(seconds):  # the clock a decision reads, moved on (liveness judged as read)
        monkeypatch.setattr(router.timezone, "now", lambda: started + timedelta(seconds=seconds))
        router.STATE.built_at = started.timestamp() + seconds  # no periodic rebuild: the followed index ages

    later(RATE_MAX_AGE_S - 60)  # its slow runs are still young enough
    assert router.plan(roster, new, online_at=started.timestamp()).device.name == "board-01"
    later(RATE_MAX_AGE_S + 1)
    chosen = router.plan(roster, new, online_at=started.timestamp())
    assert chosen.device.name == "board-00" and chosen.record["runner_up"] == "board-01"


@pytest.mark.django_db
def test_a_decision_finds_the_entries_the_mirror_holds_in_memory_and_makes_the_cache_box_the_source(
    monkeypatch, django_assert_num_queries
):
    """The routing state follows the entry mirror with the history: a prompt whose first ranges the
    cache box holds is expected from there, and a decision on a followed state asks the database
    nothing about entries."""
    from dashboard import actions, router
    from dashboard.models import CacheEntry, Device, Namespace

    Namespace.objects.get_or_create(name="default")
    device = Device.objects.create(
        name="fetcher", last_seen=timezone.now(), status={"model": "m.gguf", "fingerprint": "ab", "heartbeat_s": 5}
    )
    layout = (list(range(2000, 2400)), ())
    monkeypatch.setattr(router, "prompt_tokens", lambda prompt: layout)
    keys = router.keys_for(device, layout)
    names = list(router._entry_names(device, keys))  # one per range: 128, 256, 384, 400
    assert len(names) == 4
    prompt = actions.run_request(["x"], max_tokens=4)
    assert router.plan([device], prompt).record["source"] != "cachebox"
    for name in names[:3]:
        CacheEntry.objects.create(key=name, model="ab", namespace="default", start=0, end=128, bytes=1)
    CacheEntry.objects.create(key="someone-elses-entry", model="ab", namespace="default", start=0, end=128, bytes=1)
    record = router.plan([device], prompt).record
    assert (record["source"], record["held_tokens"]) == ("cachebox", 384)
    assert 0 <= record["decided_cpu_ms"] <= record["decided_ms"] + 1.0  # thread time: a clock of its own
    state = router.STATE
    with django_assert_num_queries(0):
        assert state.mirrored(set(names)) == set(names[:3])


@pytest.mark.django_db
def test_the_routing_state_follows_entries_added_flushed_and_replaced():
    """New rows are read after the cursor; a flush is seen by the count (compared once a second);
    a newest row replaced by another under the same id (a database restored) reads them all again."""
    from dashboard.models import CacheEntry
    from dashboard.router import RoutingState

    def entry(name):
        return CacheEntry.objects.create(key=name, model="ab", namespace="default", start=0, end=128, bytes=1)

    state = RoutingState()
    state.current()
    assert state.entry_names == set()
    first = [entry(f"e{n}") for n in range(3)]
    state.current()
    assert state.entry_names == {"e0", "e1", "e2"} and state.entry_cursor == first[-1].pk
    CacheEntry.objects.filter(key="e1").delete()  # flushed: only the count shows it
    state._looked_back = float("-inf")
    state.current()
    assert state.entry_names == {"e0", "e2"}
    newest = first[-1].pk
    CacheEntry.objects.filter(key="e2").delete()
    CacheEntry.objects.create(pk=newest, key="other", model="ab", namespace="default", start=0, end=128, bytes=1)
    state.current()
    assert state.entry_names == {"e0", "other"}
    entry("e3")
    entry("e4")
    state.current()
    assert state.entry_names == {"e0", "other", "e3", "e4"}


@pytest.mark.django_db
def test_a_roster_counts_online_and_serving_boards_as_the_devices_do():
    from datetime import timedelta

    from dashboard import router
    from dashboard.api.board_choice import serves
    from dashboard.models import Device, Namespace

    Namespace.objects.get_or_create(name="default")
    now = timezone.now()
    devices = [
        Device.objects.create(
            name="fresh",
            status={"model": "m.gguf", "fingerprint": "ab", "heartbeat_s": 1},
            last_seen=now - timedelta(seconds=3),
        ),
        Device.objects.create(
            name="late", status={"model": "m.gguf", "heartbeat_s": 1}, last_seen=now - timedelta(seconds=5)
        ),
        Device.objects.create(
            name="slow-beats", status={"model": "other.gguf", "heartbeat_s": 30}, last_seen=now - timedelta(seconds=100)
        ),
        Device.objects.create(name="no-status", status={}, last_seen=now),
        Device.objects.create(name="never", status={"model": "m.gguf"}),
        Device.objects.create(name="revoked", status={"model": "m.gguf"}, last_seen=now, revoked_at=now),
    ]
    roster = router.Roster(devices)
    assert (
        [device.name for device in roster.online(now.timestamp()).devices]
        == [device.name for device in devices if device.online_at(now)]
        == ["fresh", "slow-beats", "no-status"]
    )
    for model in ("m.gguf", "ab", "other.gguf", ""):
        assert [device.name for device in roster.serving(model).devices] == [
            device.name for device in devices if serves(device, model)
        ]


# -- pages with many devices ----------------------------------------------------------------------
def _fleet(count=60):
    from dashboard.models import Device, Namespace

    Namespace.objects.get_or_create(name="default")
    Namespace.objects.get_or_create(name="site-b")
    now = timezone.now()
    Device.objects.bulk_create(
        [
            Device(
                name=f"dev-{n:04d}",
                namespace_id="site-b" if n % 3 == 0 else "default",
                status={"heartbeat_s": 5},
                last_seen=now if n < 10 else (now - timedelta(hours=1) if n < 40 else None),
                revoked_at=now if n in (58, 59) else None,
            )
            for n in range(count)
        ]
    )


def _rows(response) -> list[str]:
    import re

    return re.findall(r'<tr data-device="([^"]+)"', response.content.decode())


@pytest.mark.django_db
def test_the_devices_page_lists_a_large_fleet_a_page_at_a_time_and_finds_a_board_by_name_status_or_namespace(
    client, django_user_model, django_assert_max_num_queries
):
    from django.urls import reverse

    _fleet()
    client.force_login(django_user_model.objects.create_user("ops", password="pw-ops-123", is_staff=True))
    with django_assert_max_num_queries(12):  # the same few queries whatever the fleet's size
        page = client.get(reverse("devices"))
    text = page.content.decode()
    assert (
        "<strong>60</strong> devices: 10 online, 30 offline, 18 never seen, 2 revoked" in text and "page 1 of 2" in text
    )
    assert len(_rows(page)) == 50
    assert _rows(client.get(reverse("devices"), {"page": 2})) == [f"dev-{n:04d}" for n in range(50, 60)]
    assert _rows(client.get(reverse("devices"), {"q": "dev-005"})) == [f"dev-{n:04d}" for n in range(50, 60)]
    assert _rows(client.get(reverse("devices"), {"status": "online"})) == [f"dev-{n:04d}" for n in range(10)]
    assert _rows(client.get(reverse("devices"), {"status": "revoked"})) == ["dev-0058", "dev-0059"]
    assert _rows(client.get(reverse("devices"), {"namespace": "site-b", "status": "online"})) == [
        "dev-0000",
        "dev-0003",
        "dev-0006",
        "dev-0009",
    ]
    assert "No device matches." in client.get(reverse("devices"), {"q": "nothing-like-it"}).content.decode()


@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_dashboard_of_a_large_fleet_counts_it_and_shows_cards_for_the_boards_seen_last(
    client, django_user_model, settings, valkey_url
):
    from django.urls import reverse

    settings.REDIS_URL = valkey_url
    _fleet()
    client.force_login(django_user_model.objects.create_user("ops", password="pw-ops-123", is_staff=True))
    text = client.get(reverse("home")).content.decode()
    assert (
        'id="fleet-counts"' in text and "<strong>60</strong> devices: 10 online" in text and 'data-full="true"' in text
    )
    cards = text.count('class="card device-card"')
    assert cards == 24


# -- heartbeats taken in batches ----------------------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.cachebox
def test_heartbeats_recorded_in_a_batch_are_checked_one_by_one_and_the_newest_of_each_board_kept(control_plane):
    """A control worker keeps heartbeats and writes them together: each is still checked (signed by
    its enrolled, unrevoked board, newer than the last one accepted); a board's newest wins."""
    from dashboard import actions
    from dashboard.actions.devices import HeartbeatBatch
    from dashboard.models import Device
    from inference.board.identity import BoardKeys
    from tests.dashboard.test_dashboard import enrolled, heartbeat, register

    boards = {}
    for name in ("hb-a", "hb-b", "hb-c"):
        device, token = register(name)
        boards[name] = (device, enrolled(device, token))
    actions.revoke_device(None, boards["hb-c"][0])
    batch = HeartbeatBatch()
    first = heartbeat(boards["hb-a"][1], {"model": "first"}, device="hb-a")
    newest = heartbeat(boards["hb-a"][1], {"model": "newest"}, device="hb-a")
    for payload in (
        newest,
        first,  # out of order within the batch: the newest is kept
        heartbeat(boards["hb-b"][1], {"model": "b"}, device="hb-b"),
        heartbeat(BoardKeys.generate(), {"model": "forged"}, device="hb-b"),  # not signed by hb-b's board
        heartbeat(boards["hb-c"][1], {"model": "revoked"}, device="hb-c"),
        heartbeat(boards["hb-a"][1], {"model": "ghost"}, device="no-such-board"),
        {"not": "an envelope"},
    ):
        batch.add(payload)
    assert batch.flush() == 2
    status = {device.name: (device.status.get("model"), device.online) for device in Device.objects.all()}
    assert status == {"hb-a": ("newest", True), "hb-b": ("b", True), "hb-c": (None, False)}
    batch.add(first)  # a replay of an older heartbeat
    assert batch.flush() == 0
    assert Device.objects.get(name="hb-a").status["model"] == "newest"


# -- a simulated board's audits ---------------------------------------------------------------------
def test_a_simulated_board_answers_the_control_planes_audit_as_inconclusive_and_refuses_a_forged_one():
    """The control plane audits hits on any board of the model, simulated ones included: a simulated
    board computes nothing, so it answers "inconclusive", sealed and signed as a board's verdict is,
    instead of counting an unexpected task as an error; an audit request it did not get from the
    pinned control plane is refused and answered with nothing."""
    import asyncio
    import json

    from cachebox.signing import control_plane_key
    from dashboard.bench.sim_board import Fleet, SimBoard
    from inference.contract import envelope
    from inference.contract.envelope import CONTROL, Kind
    from inference.contract.messages import AuditReport, AuditRequest, RunRequest, Task
    from tests.inference.test_edge import CONTROL_PLANE, board_identity

    class Broker:
        def __init__(self):
            self.pushed: list[tuple[str, dict]] = []

        async def lpush(self, key: str, raw: str) -> None:
            self.pushed.append((key, json.loads(raw)))

    me = board_identity("sim-audited")
    board = SimBoard(me, rate_ms=1.0)
    fleet = Fleet({"redis_url": "redis://127.0.0.1:1/0"})
    fleet.broker = Broker()
    asked = AuditRequest(
        request_id=str(uuid.uuid4()),
        entry=f"ec:e:default:00ff00ff00ff00ff:{{{'ee' * 16}}}",
        run=RunRequest(request_id=str(uuid.uuid4()), segments=["Once upon a time"], namespace="default"),
    )

    def sealed_by(signer) -> dict:
        return envelope.seal(
            asked.dump(), kind=Kind.AUDIT, sender=CONTROL, to=me.name, signer=signer, ring=me.ring, ttl=60
        )

    asyncio.run(fleet._audit(board, sealed_by(CONTROL_PLANE)))
    [(key, message)] = fleet.broker.pushed
    assert key.endswith(me.name) and message["task"] == Task.RECORD_AUDIT.value
    body, _ = envelope.open_envelope(
        message["body"],
        kind=Kind.AUDITED,
        to=CONTROL,
        signer_public_key=me.keys.signing_public_key,
        ring_for=me.ring_for,
    )
    verdict = AuditReport.parse(body)
    assert (verdict.device, verdict.request_id, verdict.entry, verdict.verdict) == (
        me.name,
        asked.request_id,
        asked.entry,
        "inconclusive",
    )
    assert fleet.counts["audits"] == 1 and fleet.counts["errors"] == 0

    asyncio.run(fleet._audit(board, sealed_by(control_plane_key(b"an attacker's own master secret!"))))
    assert len(fleet.broker.pushed) == 1  # nothing answered
    assert fleet.counts["audits"] == 1 and fleet.counts["refused"] == 1 and fleet.counts["errors"] == 1


# -- a small simulated fleet against a real stack ---------------------------------------------------
@pytest.mark.processes
def test_a_small_simulated_fleet_loses_no_run_and_every_report_is_signed_and_accepted(tmp_path):
    """`bench fleet-sim` with 20 boards: each enrolls its own keys, beats, syncs its catalog and
    answers its runs with signed reports through the real web server, worker, broker and cache box."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "fleet-sim.json"
    done = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "bench",
            "fleet-sim",
            "--boards",
            "20",
            "--seconds",
            "4",
            "--rate",
            "3",
            "--heartbeat",
            "1",
            "--time-scale",
            "0.1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "fleet-sim" and out.with_suffix(".html").exists()
    assert doc["online_at_start"] == 20
    assert doc["lost_runs"] == 0 and doc["errors"]["total"] == 0, doc["errors"]
    assert doc["requests"] == 12 and doc["answered"] == 12
    # Every run a board answered was stored from its signed report (a refused report stores nothing).
    assert doc["board_counts"]["reports"] == doc["board_counts"]["runs"] == doc["runs_stored"] == doc["runs_dispatched"]
    assert doc["board_counts"]["refused"] == 0 and doc["board_counts"]["heartbeats"] >= 20
    assert (
        doc["heartbeat_ingest_lag_ms"]["n"] > 0
        and doc["catalog_sync_lag_ms"]["n"] > 0
        and doc["routing_decision_ms"]["n"] == 12
    )


@pytest.mark.django_db
@pytest.mark.cachebox
def test_each_boards_latest_heartbeat_is_read_once_stale_and_oversized_ones_say_nothing(control_plane):
    import json

    import redis
    from django.conf import settings

    from cachebox.keys import heartbeat_key
    from dashboard.actions import devices as device_actions
    from dashboard.models import Device
    from inference.contract.envelope import CONTROL, Kind, seal
    from inference.contract.messages import MAX_HEARTBEAT_BYTES
    from tests.dashboard.test_dashboard import enrolled, heartbeat, register

    device, token = register("hb-key")
    keys = enrolled(device, token)
    monkey = redis.Redis.from_url(settings.REDIS_URL)
    from cachebox.signing import SIGNATURE_FIELD, sign_document

    old = seal(
        {"device": "hb-key", "status": {"model": "old", "heartbeat_s": 5}},
        kind=Kind.HEARTBEAT,
        sender="hb-key",
        to=CONTROL,
        signer=keys.signing,
    )
    old["ts"] -= 600  # a heartbeat sent ten minutes ago (the control plane was down), signed as such
    old = sign_document(keys.signing, {k: v for k, v in old.items() if k != SIGNATURE_FIELD})
    monkey.set(heartbeat_key("hb-key"), json.dumps(old))
    batch = device_actions.HeartbeatBatch()
    assert batch.take() == 1 and batch.flush() == 0  # too old to say the board lives now
    assert batch.take() == 0  # the same beat is not read twice
    assert not Device.objects.get(name="hb-key").online
    monkey.set(heartbeat_key("hb-key"), b"x" * (MAX_HEARTBEAT_BYTES + 1))
    assert batch.take() == 0 and batch.flush() == 0  # larger than a heartbeat may be: refused unread
    monkey.set(heartbeat_key("hb-key"), b"not json")
    assert batch.take() == 0
    monkey.set(
        heartbeat_key("hb-key"), json.dumps(heartbeat(keys, {"model": "now", "heartbeat_s": 5}, device="hb-key"))
    )
    assert batch.take() == 1 and batch.flush() == 1
    device = Device.objects.get(name="hb-key")
    assert device.online and device.status["model"] == "now"
    assert batch.take() == 0 and batch.flush() == 0  # latest wins: nothing new until the board beats again


@pytest.mark.django_db
def test_a_board_another_process_saw_come_online_serves_a_request_this_process_read_it_offline(monkeypatch):
    """Each web process reads the devices at most once a second: a board whose first heartbeat a
    control worker recorded since is weighed again before a request is refused for want of it."""
    from dashboard import actions, router
    from dashboard.actions.api_keys import create_key
    from dashboard.api.board_choice import choose_route
    from dashboard.api.requests import parse_request
    from dashboard.models import Device, Namespace

    monkeypatch.setattr(router, "prompt_tokens", lambda prompt: None)
    monkeypatch.setattr(router.Candidates, "TTL_S", 3600.0)
    router.CANDIDATES.forget()
    Namespace.objects.get_or_create(name="default")
    Device.objects.create(name="late-board", status={"model": "m.gguf", "fingerprint": "ab", "heartbeat_s": 1})
    key, _ = create_key(None, "default")
    request = parse_request({"model": "m.gguf", "messages": [{"role": "user", "content": "hi"}]}, "chat")
    run = actions.run_request(["hi"], max_tokens=4)
    assert not router.CANDIDATES.roster("default").online()  # read while the board was silent
    Device.objects.filter(name="late-board").update(last_seen=timezone.now())  # a worker records its heartbeat
    device, routed, online = choose_route(key, request, run)
    assert device.name == "late-board" and routed.device.name == "late-board" and online == 1


def test_the_router_tokenizes_a_repeated_text_once_and_hands_out_copies():
    from dashboard.router import _RememberedTokens

    class Words:
        calls = 0
        bos = 1

        def tokenize(self, text, add_bos=True, special=False):
            Words.calls += 1
            return ([self.bos] if add_bos else []) + [len(word) for word in text.split()]

    vocabulary = _RememberedTokens(Words())
    first = vocabulary.tokenize("a shared system prompt", add_bos=False)
    first.append(99)  # a caller extends what it got
    assert vocabulary.tokenize("a shared system prompt", add_bos=False) == [1, 6, 6, 6]
    assert Words.calls == 1
    assert (
        vocabulary.tokenize("a shared system prompt") == [1, 1, 6, 6, 6] and Words.calls == 2
    )  # other arguments, other tokens
    assert vocabulary.bos == 1  # everything else is the vocabulary's own


def test_a_roster_read_again_keeps_what_the_router_was_told_of_unchanged_rates():
    from dashboard.models import Device, Namespace
    from dashboard.router import Roster

    namespace = Namespace(name="default")

    def read(prefill):
        return Roster(
            [
                Device(
                    name=f"b{n}",
                    namespace=namespace,
                    status={"rates": {"prefill_ms_per_token": prefill if n == 0 else 3.0, "decode_ms_per_token": 20.0}},
                )
                for n in range(3)
            ]
        )

    index = object()  # the router's index the rates were given to
    earlier = read(3.0)
    for entry in earlier.entries:
        entry.applied = index
    again = read(3.0)
    again.carry(earlier)
    assert [entry.applied for entry in again.entries] == [index, index, index]
    changed = read(40.0)  # b0 measured itself again: its new rates must reach the router
    changed.carry(earlier)
    assert [entry.applied for entry in changed.entries] == [None, index, index]

"""Cache-aware routing: the pure cost function and the fleet index (milliseconds, no I/O)."""

from __future__ import annotations

from cachebox.link import LINK_PRESETS
from inference.routing import BoardView, FleetIndex, PromptKeys, estimate, prompt_keys, route

GRID = 128


def keys_of(tokens):
    return prompt_keys("default", "00ff00ff00ff00ff", tokens, grid=GRID)


def test_the_board_with_the_lowest_expected_time_wins():
    boards = [BoardView("cold", context_tokens=0), BoardView("warm", context_tokens=384), BoardView("half", ram_tokens=256)]
    chosen = route(450, boards)
    assert chosen.board == "warm"
    assert chosen.chosen.source == "context" and chosen.chosen.held_tokens == 384
    assert [e.board for e in chosen.estimates] == ["warm", "half", "cold"]
    assert chosen.saving_ms == 384 * 3.0  # against the cache-blind choice: the whole prompt computed


def test_a_boards_queued_work_counts():
    boards = [BoardView("warm-but-busy", context_tokens=384, queued_ms=5000.0), BoardView("idle", context_tokens=0)]
    assert route(450, boards).board == "idle"
    assert route(450, [BoardView("warm-but-busy", context_tokens=384, queued_ms=100.0), BoardView("idle")]).board == "warm-but-busy"


def test_a_faster_board_wins_when_neither_holds_anything():
    assert route(450, [BoardView("slow", prefill_ms_per_token=20.0), BoardView("fast", prefill_ms_per_token=2.0)]).board == "fast"


def test_offline_boards_are_never_chosen_and_none_online_is_no_route():
    boards = [BoardView("gone", online=False, context_tokens=450), BoardView("here")]
    chosen = route(450, boards)
    assert chosen.board == "here" and [e.board for e in chosen.estimates] == ["here"]
    assert route(450, [BoardView("gone", online=False)]) is None
    assert route(450, []) is None


def test_ties_are_broken_stably_by_the_hint_then_by_order():
    boards = [BoardView("b"), BoardView("a"), BoardView("c")]
    assert route(450, boards).board == "b"  # the earlier board, not the first by name or at random
    assert route(450, boards).board == "b"
    assert route(450, boards, preferred="c").board == "c"


def test_a_dear_link_makes_the_cache_box_lose_to_computing():
    wifi = BoardView("wifi", cachebox_tokens=384, link=LINK_PRESETS["wifi4"], prefill_ms_per_token=1.5)
    assert estimate(450, wifi).source == ""  # 7 MB over Wi-Fi 4 costs more than 384 tokens of prefill
    loopback = BoardView("lan", cachebox_tokens=384, prefill_ms_per_token=1.5)
    assert estimate(450, loopback).source == "cachebox" and estimate(450, loopback).held_tokens == 384


def test_the_index_knows_context_ram_and_queue_from_dispatches():
    index = FleetIndex(prefill_prior=2.0)
    topic = list(range(1, 400))
    first, second, other = keys_of(topic + [500, 501]), keys_of(topic + [600, 601, 602]), keys_of(list(range(1000, 1300)))
    index.dispatched("a", "r1", first, work_ms=900.0)
    view = index.view("a", second)
    assert view.context_tokens == 384 and view.queued_ms == 900.0  # shares the prompt up to its last grid point
    index.reported("a", "r1", prompt_tokens=401, matched_tokens=0, prefill_ms=802.0, stored_keys=first.keys)
    view = index.view("a", second)
    assert view.queued_ms == 0.0 and view.prefill_ms_per_token == 2.0 and view.cachebox_tokens == 384
    index.dispatched("a", "r2", other, work_ms=600.0)
    view = index.view("a", second, ram_budget_bytes=64 * 1024 * 1024)
    assert view.context_tokens == 0 and view.ram_tokens == 384  # another prompt in between: RAM, not context
    assert index.view("a", second, ram_budget_bytes=0).ram_tokens == 0
    assert index.view("b", second).context_tokens == 0  # a board it never went to holds nothing


def test_a_board_owes_less_the_longer_it_has_worked_on_its_current_run():
    index = FleetIndex(prefill_prior=2.0)
    topic = keys_of(list(range(1, 400)))
    index.dispatched("a", "r1", topic, work_ms=1200.0, at=100.0)
    index.dispatched("a", "r2", topic, work_ms=1000.0, at=100.5)
    assert index.view("a", topic).queued_ms == 2200.0  # no clock: every run's whole work
    assert index.queued_ms("a", now=100.9) == 1300.0  # 0.9 s into r1: 0.3 s of it left, then r2
    assert index.queued_ms("a", now=105.0) == 1000.0  # r1 overran its estimate: about done; r2 not begun
    index.reported("a", "r1", at=101.5)
    assert index.queued_ms("a", now=101.6) == 900.0  # r2 began when r1 was answered, not when it was sent
    # The topic's next prompt: board a holds it and is 0.25 s into r2; board b is idle and holds nothing.
    index.dispatched("b", "r3", keys_of(list(range(2000, 2100))), work_ms=100.0, at=101.6)
    index.reported("b", "r3", at=101.7)
    assert route(399, [index.view(name, topic, now=101.75) for name in ("a", "b")]).board == "a"  # 750 ms left vs 798 ms cold
    assert route(399, [index.view(name, topic) for name in ("a", "b")]).board == "b"  # counting r2 whole, a looked dearer


def test_the_same_prompt_again_is_held_whole_and_a_failed_run_is_forgotten():
    index = FleetIndex()
    keys = keys_of(list(range(1, 300)))
    index.dispatched("a", "r1", keys, 100.0)
    assert index.view("a", keys).context_tokens == 299
    index.reported("a", "r1", failed=True)
    assert index.view("a", keys).context_tokens == 0


def test_prompt_keys_travel_as_json():
    keys = keys_of(list(range(1, 300)))
    assert PromptKeys.from_dict(keys.as_dict()) == keys and keys.boundaries == (128, 256, 299)
    assert PromptKeys.from_dict({"boundaries": [1], "keys": []}) == PromptKeys()

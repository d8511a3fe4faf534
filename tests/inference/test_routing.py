"""Cache-aware routing: the pure cost function and the fleet index (milliseconds, no I/O)."""

from __future__ import annotations

from cachebox.link import LINK_PRESETS
from inference.placement import BoardView, FleetIndex, PromptKeys, estimate, prompt_keys, route

GRID = 128


def keys_of(tokens):
    return prompt_keys("default", "00ff00ff00ff00ff", tokens, grid=GRID)


def test_the_board_with_the_lowest_expected_time_wins():
    boards = [
        BoardView("cold", context_tokens=0),
        BoardView("warm", context_tokens=384),
        BoardView("half", ram_tokens=256),
    ]
    chosen = route(450, boards)
    assert chosen.board == "warm"
    assert chosen.chosen.source == "context" and chosen.chosen.held_tokens == 384
    assert [e.board for e in chosen.estimates] == ["warm", "half", "cold"]
    assert chosen.saving_ms == 384 * 3.0  # against the cache-blind choice: the whole prompt computed


def test_a_boards_queued_work_counts():
    boards = [BoardView("warm-but-busy", context_tokens=384, queued_ms=5000.0), BoardView("idle", context_tokens=0)]
    assert route(450, boards).board == "idle"
    assert (
        route(450, [BoardView("warm-but-busy", context_tokens=384, queued_ms=100.0), BoardView("idle")]).board
        == "warm-but-busy"
    )


def test_a_faster_board_wins_when_neither_holds_anything():
    assert (
        route(450, [BoardView("slow", prefill_ms_per_token=20.0), BoardView("fast", prefill_ms_per_token=2.0)]).board
        == "fast"
    )


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
    first, second, other = (
        keys_of(topic + [500, 501]),
        keys_of(topic + [600, 601, 602]),
        keys_of(list(range(1000, 1300))),
    )
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
    assert (
        route(399, [index.view(name, topic, now=101.75) for name in ("a", "b")]).board == "a"
    )  # 750 ms left vs 798 ms cold
    assert (
        route(399, [index.view(name, topic) for name in ("a", "b")]).board == "b"
    )  # counting r2 whole, a looked dearer


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


# -- measured rates: right from the first request (issue 24, item 3) --------------------------------
ZERO_MS_PER_TOKEN = 39.56  # inference.engine.compute_profile.PI_ZERO_2W, as `make run`'s zero board measures itself
PI5_MS_PER_TOKEN = 1.5  # this machine's own speed, as the unpaced pi5 board measures itself


def test_a_repeat_goes_to_the_board_that_holds_it_not_to_a_slow_board_without_history():
    index = FleetIndex()  # the fleet-wide prior (3 ms per token) is what misled the router before
    index.measured("zero", prefill_ms_per_token=ZERO_MS_PER_TOKEN, decode_ms_per_token=400.0)
    index.measured("pi5", prefill_ms_per_token=PI5_MS_PER_TOKEN, decode_ms_per_token=12.0)
    prompt = keys_of(list(range(1, 479)))  # ~460 tokens of system prompt and a question
    assert index.view("zero", prompt).prefill_ms_per_token == ZERO_MS_PER_TOKEN  # never the prior once measured
    first = route(prompt.tokens, [index.view(name, prompt) for name in ("zero", "pi5")])
    assert first.board == "pi5"  # neither holds anything: the faster one
    index.dispatched("pi5", "r1", prompt, index.work_ms("pi5", prompt, 1, estimate=first.chosen), at=10.0)
    index.reported("pi5", "r1", prompt_tokens=478, prefill_ms=478 * PI5_MS_PER_TOKEN, at=10.8)
    repeat = route(prompt.tokens, [index.view(name, prompt, now=11.0) for name in ("zero", "pi5")])
    assert repeat.board == "pi5" and repeat.chosen.held_tokens == 478 and repeat.chosen.source == "context"
    zero = next(e for e in repeat.estimates if e.board == "zero")
    assert zero.expected_ms == round(478 * ZERO_MS_PER_TOKEN, 3)  # ~18.9 s cold, as it took
    # The next question under the same system prompt: pi5 holds all but its last range.
    follow = keys_of(list(range(1, 460)) + list(range(900, 920)))
    assert route(follow.tokens, [index.view(name, follow, now=11.0) for name in ("zero", "pi5")]).board == "pi5"


def test_a_board_that_decodes_far_slower_loses_a_long_answer_though_its_first_token_comes_sooner():
    # As bench api saw it on make run: zero held a short chat prompt in its context (first token at
    # once), pi5 in its RAM tier (a restore first), pi5 still owing a moment of its last run.
    # The first token came sooner from zero, and the 32-token answer took 12 s there, 0.8 s on pi5.
    index = FleetIndex()
    index.measured("zero", prefill_ms_per_token=ZERO_MS_PER_TOKEN, decode_ms_per_token=380.0)
    index.measured("pi5", prefill_ms_per_token=PI5_MS_PER_TOKEN, decode_ms_per_token=25.0)
    prompt = keys_of(list(range(1, 17)))
    views = [
        BoardView("zero", prefill_ms_per_token=ZERO_MS_PER_TOKEN, decode_ms_per_token=380.0, context_tokens=16),
        BoardView(
            "pi5", prefill_ms_per_token=PI5_MS_PER_TOKEN, decode_ms_per_token=25.0, ram_tokens=16, queued_ms=40.0
        ),
    ]
    long = route(prompt.tokens, views, answer_tokens=32)
    assert long.board == "pi5" and long.chosen.answer_ms == 31 * 25.0 and long.chosen.finished_ms < 1000
    zero = next(e for e in long.estimates if e.board == "zero")
    assert (
        zero.expected_ms < long.chosen.expected_ms and zero.finished_ms == 31 * 380.0
    )  # sooner first token, later answer
    # One token asked for: only the first token counts, and it comes sooner from zero.
    assert route(prompt.tokens, views, answer_tokens=1).board == "zero"
    assert route(prompt.tokens, views).board == "zero"  # no answer length given: the first token, as before
    # Measured rates reach the view, so the control plane's router weighs answers too.
    assert index.view("zero", prompt).decode_ms_per_token == 380.0


def test_with_the_global_prior_the_slow_board_looked_as_fast_as_any():
    # What the router did before boards reported their rates: zero and pi5 both at 3 ms per token.
    index = FleetIndex()
    prompt = keys_of(list(range(1, 479)))
    assert index.view("zero", prompt).prefill_ms_per_token == index.view("pi5", prompt).prefill_ms_per_token == 3.0


def test_a_boards_own_runs_outweigh_what_it_measured_at_start():
    index = FleetIndex()
    index.measured("a", prefill_ms_per_token=5.0, decode_ms_per_token=20.0)
    assert (index.prefill_rate("a"), index.decode_rate("a")) == (5.0, 20.0)
    index.dispatched("a", "r1", keys_of(list(range(1, 200))), 100.0)
    index.reported("a", "r1", prompt_tokens=199, prefill_ms=199 * 4.0, decode_ms=3 * 15.0, generated_tokens=4)
    assert (index.prefill_rate("a"), index.decode_rate("a")) == (4.0, 15.0)
    index.measured("b", prefill_ms_per_token=0.0, decode_ms_per_token=None)  # nothing usable: the priors
    assert (index.prefill_rate("b"), index.decode_rate("b")) == (index.prefill_prior, index.decode_prior)


def test_a_busy_board_that_holds_the_prompt_is_weighed_by_its_remaining_work():
    index = FleetIndex()
    index.measured("zero", prefill_ms_per_token=ZERO_MS_PER_TOKEN, decode_ms_per_token=400.0)
    index.measured("pi5", prefill_ms_per_token=PI5_MS_PER_TOKEN, decode_ms_per_token=12.0)
    prompt = keys_of(list(range(1, 479)))
    # pi5 took a long answer 20 s ago (its whole run: 478 tokens of prefill and 2,000 of answer, ~24.7 s).
    work = index.work_ms("pi5", prompt, 2000)
    assert work == round(478 * PI5_MS_PER_TOKEN + 1999 * 12.0, 3)
    index.dispatched("pi5", "long", prompt, work, at=100.0)
    chosen = route(prompt.tokens, [index.view(name, prompt, now=120.0) for name in ("zero", "pi5")])
    assert chosen.board == "pi5" and chosen.chosen.queued_ms == round(
        work - 20_000.0, 3
    )  # ~4.7 s left, vs ~18.9 s cold on zero
    # Weighed by its whole run, pi5 would have lost the prompt it holds to zero.
    assert route(prompt.tokens, [index.view(name, prompt) for name in ("zero", "pi5")]).board == "zero"


def test_a_hit_occupies_its_board_for_its_answer_not_for_a_cold_prefill():
    index = FleetIndex()
    index.measured("pi5", prefill_ms_per_token=PI5_MS_PER_TOKEN, decode_ms_per_token=12.0)
    prompt = keys_of(list(range(1, 479)))
    index.dispatched("pi5", "r1", prompt, 1000.0)
    held = route(prompt.tokens, [index.view("pi5", prompt)])
    assert (
        index.work_ms("pi5", prompt, 4, LINK_PRESETS["wifi4"], estimate=held.chosen) == 3 * 12.0
    )  # nothing computed: nothing to upload either
    assert (
        index.work_ms("pi5", prompt, 4, LINK_PRESETS["wifi4"]) > 478 * PI5_MS_PER_TOKEN + 1000
    )  # counted cold, it uploads 8.8 MB over Wi-Fi 4
    assert held.chosen.prefill_ms == 0.0  # its context holds it whole


def test_the_index_keeps_which_boards_hold_each_key_and_which_owe_work_as_their_histories_change():
    """What a decision reads instead of every board's history: the boards whose remembered prompts
    share a key with a prompt, and the boards with unreported runs, through dispatches, a history
    window that forgets its oldest prompt, failed runs and answers."""
    import random

    from inference.placement import HISTORY

    rnd = random.Random(7)
    prompts = [keys_of(list(range(start, start + 300))) for start in range(0, 6000, 1000)]
    index = FleetIndex()
    outstanding: dict[str, str] = {}
    for step in range(400):
        board = f"b{rnd.randrange(5)}"
        if outstanding and rnd.random() < 0.5:
            request_id = rnd.choice(sorted(outstanding))
            index.reported(
                outstanding.pop(request_id), request_id, prompt_tokens=300, prefill_ms=600.0, failed=rnd.random() < 0.2
            )
        else:
            request_id = f"r{step}"
            index.dispatched(board, request_id, rnd.choice(prompts), 500.0)
            outstanding[request_id] = board
        for prompt in prompts:
            walked = {
                name
                for name, history in index.boards.items()
                if any(set(item.keys.keys) & set(prompt.keys) for item in history.recent)
            }
            assert index.holding(prompt) == walked
        assert index.busy == {name for name, history in index.boards.items() if history.outstanding}
    assert any(len(history.recent) == HISTORY for history in index.boards.values())  # the window did forget
    assert index.holding(PromptKeys((128,), ("nobody-has-this",))) == set()


def test_a_boards_rate_is_worked_out_again_when_it_changes_and_each_change_is_logged():
    index = FleetIndex(prefill_prior=3.0)
    assert index.prefill_rate("b") == 3.0
    index.measured("b", prefill_ms_per_token=40.0, decode_ms_per_token=90.0)
    assert index.prefill_rate("b") == 40.0
    index.measured("b", prefill_ms_per_token=40.0, decode_ms_per_token=90.0)  # the same: nothing to log
    index.dispatched("b", "r1", keys_of(list(range(300))), 100.0)
    index.reported("b", "r1", prompt_tokens=300, prefill_ms=300.0)
    assert index.prefill_rate("b") == 1.0  # its own run outweighs what it measured
    assert index.rate_changes == ["b", "b"]


# -- kernel classes (issue 40): a state is reused exactly only by the class that computed it -----------
def test_a_board_of_another_kernel_class_gets_no_credit_for_the_cached_tokens():
    from cachebox.keys import ModelIdentity
    from inference.engine.kernels import KernelClass

    def fingerprint(info):
        kernels = KernelClass.from_report(
            "x86_64", f"CPU : AVX = 1 | AVX2 = 1 | {info}FMA = 1 | ", "llama-cpp-python 0.3.36 ggml 0.25.3"
        )
        return ModelIdentity("ab" * 32, "f16", "llama-cpp-python 0.3.36", kernels=kernels.identity).fingerprint()

    avx2, avx512 = fingerprint(""), fingerprint("AVX512 = 1 | ")
    boards = {"avx2-a": avx2, "avx2-b": avx2, "avx512": avx512}
    tokens = list(range(1, 479))
    keys = {name: prompt_keys("default", fp, tokens, grid=GRID) for name, fp in boards.items()}
    index = FleetIndex()
    index.measured("avx2-a", prefill_ms_per_token=3.0, decode_ms_per_token=12.0)
    index.measured("avx2-b", prefill_ms_per_token=3.0, decode_ms_per_token=12.0)
    index.measured("avx512", prefill_ms_per_token=1.0, decode_ms_per_token=8.0)  # the fastest board
    # avx2-a computed the prompt and stored its ranges in the cache box, then was given other work.
    index.dispatched("avx2-a", "r1", keys["avx2-a"], 0.0)
    index.reported("avx2-a", "r1", prompt_tokens=478, prefill_ms=1434.0, stored_keys=keys["avx2-a"].keys)
    index.dispatched("avx2-a", "r2", keys_of(list(range(5000, 5300))), 5000.0)

    chosen = route(478, [index.view(name, keys[name]) for name in boards])
    by_board = {estimate.board: estimate for estimate in chosen.estimates}
    assert (
        by_board["avx512"].held_tokens == 0 and by_board["avx512"].source == ""
    )  # the other class's entries: no credit
    assert by_board["avx2-b"].held_tokens == 478 and by_board["avx2-b"].source == "cachebox"  # its class's: all of them
    assert chosen.board == "avx2-b"  # though the AVX-512 board computes three times as fast


# -- learned rates age: a board shunned after a slow spell is tried again ------------------------------
PI5_DECODE_MS_PER_TOKEN = 17.6  # as `make run`'s pi5 board measured itself at start


def _slow_spell(index, board, *, start: float, runs: int = 16, prefill: float = 40.0, decode: float = 500.0):
    """``runs`` runs of ``board`` reported one a second from ``start`` at these rates (ms per token)."""
    for n in range(runs):
        request_id = f"{board}-slow-{n}"
        index.dispatched(board, request_id, keys_of(list(range(n * 1000, n * 1000 + 200))), 100.0, at=start + n - 1)
        index.reported(
            board,
            request_id,
            prompt_tokens=200,
            prefill_ms=200 * prefill,
            decode_ms=2 * decode,
            generated_tokens=3,
            at=start + n,
        )


def test_a_board_shunned_after_a_slow_spell_is_chosen_again_once_its_slow_runs_are_old_then_learns_anew():
    from inference.placement import RATE_MAX_AGE_S

    index = FleetIndex()
    index.measured("zero", prefill_ms_per_token=ZERO_MS_PER_TOKEN, decode_ms_per_token=400.0)
    index.measured("pi5", prefill_ms_per_token=PI5_MS_PER_TOKEN, decode_ms_per_token=PI5_DECODE_MS_PER_TOKEN)
    # The machine was loaded by compile jobs: 16 runs of pi5 decoded at ~500 ms a token.
    _slow_spell(index, "pi5", start=1000.0)
    last = 1015.0  # its last slow run's report
    prompt = keys_of(list(range(50_000, 50_100)))

    def chosen(now):
        index.age(now)
        views = [index.view(name, prompt, now=now) for name in ("zero", "pi5")]
        return route(prompt.tokens, views, answer_tokens=32).board

    assert chosen(last + 60) == "zero" and index.decode_rate("pi5") == 500.0  # while the slow runs are recent
    assert chosen(last + RATE_MAX_AGE_S - 1) == "zero"  # the newest is still young enough
    changes = len(index.rate_changes)
    assert chosen(last + RATE_MAX_AGE_S) == "pi5"  # all of them too old: what it measured at start
    assert (index.prefill_rate("pi5"), index.decode_rate("pi5")) == (PI5_MS_PER_TOKEN, PI5_DECODE_MS_PER_TOKEN)
    assert index.rate_changes[changes:] == ["pi5"]  # the prefill ranking hears of it, once
    # It is tried again and learns from its new runs: its own rate again, not the one it measured.
    now = last + RATE_MAX_AGE_S + 5
    index.dispatched("pi5", "fast", prompt, 100.0, at=now - 1)
    index.reported(
        "pi5", "fast", prompt_tokens=100, prefill_ms=100 * 2.0, decode_ms=2 * 20.0, generated_tokens=3, at=now
    )
    assert (index.prefill_rate("pi5"), index.decode_rate("pi5")) == (2.0, 20.0)
    assert chosen(now + 1) == "pi5"
    assert (index.prefill_rate("pi5"), index.decode_rate("pi5")) == (2.0, 20.0)  # young: kept


def test_rate_samples_age_one_by_one_and_only_the_boards_due_are_worked_out_again():
    from inference.placement import RATE_MAX_AGE_S

    index = FleetIndex(prefill_prior=3.0, decode_prior=10.0)
    _slow_spell(index, "a", start=0.0, runs=3, prefill=40.0)  # reported at 0, 1, 2
    _slow_spell(index, "a", start=100.0, runs=2, prefill=4.0)  # ... at 100, 101
    _slow_spell(index, "b", start=50.0, runs=1, prefill=7.0)
    index.reported("c", "undated", prompt_tokens=200, prefill_ms=200 * 9.0)  # no time: never ages
    assert index.prefill_rate("a") == 40.0  # the median of five
    changes = len(index.rate_changes)
    index.age(RATE_MAX_AGE_S + 0.5)  # a's first is too old
    assert index.rate_changes[changes:] == ["a"] and index.prefill_rate("a") == (40.0 + 4.0) / 2
    index.age(RATE_MAX_AGE_S + 0.7)  # nothing more due: nothing worked out again
    assert index.rate_changes[changes:] == ["a"]
    index.age(RATE_MAX_AGE_S + 60)  # a's slow runs and b's one run are too old
    assert index.rate_changes[changes:] == ["a", "a", "b"]
    assert (index.prefill_rate("a"), index.prefill_rate("b")) == (4.0, 3.0)  # b: the prior, it measured nothing
    index.age(10 * RATE_MAX_AGE_S)
    assert (index.prefill_rate("a"), index.decode_rate("a")) == (3.0, 10.0)
    assert index.prefill_rate("c") == 9.0
    assert index.aging == []  # nothing dated left to age
    # A sample older than the one queued (reports fed out of order) is aged at its own time.
    index.reported("a", "late", prompt_tokens=200, prefill_ms=200 * 5.0, at=20 * RATE_MAX_AGE_S)
    index.reported("a", "early", prompt_tokens=200, prefill_ms=200 * 50.0, at=19 * RATE_MAX_AGE_S)
    index.age(20 * RATE_MAX_AGE_S)
    assert index.prefill_rate("a") == 5.0
    index.age(21 * RATE_MAX_AGE_S)
    assert index.prefill_rate("a") == 3.0 and index.aging == []

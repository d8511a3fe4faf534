"""Break-even arithmetic and link profiles: pure, millisecond tests."""

import pytest

from cachebox.link import LINK_PRESETS, LinkProfile
from inference.serving.breakeven import LinearFit, crossover, fit_line, points_from_breakdowns


def test_fit_line_recovers_a_known_line():
    fit = fit_line([100, 200, 300, 400], [250, 450, 650, 850])
    assert fit.slope == pytest.approx(2.0) and fit.intercept == pytest.approx(50.0) and fit.points == 4
    assert fit.predict(1000) == pytest.approx(2050)


def test_fit_line_needs_two_distinct_lengths():
    assert fit_line([100, 100], [1, 2]) is None
    assert fit_line([], []) is None


def test_crossover_where_fetching_starts_to_win():
    prefill = LinearFit(slope=2.7, intercept=10, points=5)  # a slow board: 2.7 ms a token
    fetch = LinearFit(slope=0.4, intercept=240, points=5)  # a slow link: a big fixed cost
    result = crossover(prefill, fetch)
    assert result.fetch_wins_above and result.tokens == pytest.approx(100.0)
    assert "from 100 tokens" in result.describe()


def test_crossover_when_one_side_always_wins():
    assert crossover(LinearFit(2.0, 50, 3), LinearFit(0.1, 5, 3)).describe() == "fetching always wins"
    never = crossover(LinearFit(0.05, 5, 3), LinearFit(0.3, 20, 3))
    assert never.tokens is None and not never.fetch_wins_above
    assert "recomputing always wins" in never.describe()


def test_points_from_breakdowns_split_prefill_and_fetch():
    points = points_from_breakdowns(
        [
            {"prompt_tokens": 400, "matched_tokens": 0, "prefill_ms": 900.0, "redis_ms": 0},
            {"prompt_tokens": 400, "matched_tokens": 300, "prefill_ms": 200.0, "redis_ms": 30.0},
            {"prompt_tokens": 400, "matched_tokens": 400, "prefill_ms": 0.0, "redis_ms": 40.0},
        ]
    )
    assert points.prefill == [(400, 900.0), (100, 200.0)]
    assert points.fetch == [(300, 30.0), (400, 40.0)]


def test_link_profile_transfer_time_matches_the_papers_wifi():
    wifi = LINK_PRESETS["wifi4"]
    assert wifi.transfer_ms(2.25e6, round_trips=0) == pytest.approx(861, rel=0.01)  # paper: 0.86 s
    assert LinkProfile(8.0, 10.0).transfer_ms(1e6) == pytest.approx(1010.0)
    assert LINK_PRESETS["none"] is None


# -- the per-request policy -------------------------------------------------------------------
from inference.serving.breakeven import BreakEvenPolicy, OnlineFit  # noqa: E402


def test_online_fit_keeps_a_bounded_window_and_learns_a_rate():
    fit = OnlineFit(window=3)
    assert fit.fit() is None
    for x, y in [(1, 100), (100, 2), (200, 4), (300, 6)]:
        fit.add(x, y)
    assert len(fit.points) == 3 and fit.fit().slope == pytest.approx(0.02)
    with_fixed = OnlineFit(fixed_ms=10.0)
    for x in (100, 200, 400):
        with_fixed.add(x, 10.0 + 0.5 * x)
    line = with_fixed.fit()
    assert (line.slope, line.intercept) == (pytest.approx(0.5), 10.0)
    nonsense = OnlineFit(fixed_ms=50.0)
    nonsense.add(100, 10)
    nonsense.add(200, 20)
    assert nonsense.fit() is None  # faster than the fixed cost: noise, not a cost model


def test_prompts_of_similar_length_do_not_make_short_ranges_look_free():
    policy = BreakEvenPolicy(prefill_ms_per_token=2.7, link=None)
    for tokens, ms in [(447, 1250.0), (432, 1150.0), (440, 1230.0)]:  # a free intercept would go below zero at 80
        policy.observe_prefill(tokens, ms)
    assert policy.predict_prefill_ms(80) == pytest.approx(80 * 2.73, rel=0.05)
    policy.observe_fetch(277_500, 1.5)
    policy.observe_fetch(8_300_000, 9.0)
    assert policy.decide(80, 80 * 18_500).fetch


def test_policy_uses_priors_until_the_board_has_measured():
    slow_link = LINK_PRESETS["wifi4"]  # about 2.6 MB/s
    policy = BreakEvenPolicy(prefill_ms_per_token=2.7, link=slow_link)
    # 400 tokens of 18.5 KB: 7.4 MB over Wi-Fi ~2.8 s, prefill ~1.1 s: recompute.
    decision = policy.decide(400, 400 * 18_500)
    assert not decision.fetch and decision.predicted_fetch_ms > decision.predicted_prefill_ms
    # A Pi Zero prefills ~31 ms a token (paper: 12.58 s for 405): fetching wins.
    assert BreakEvenPolicy(prefill_ms_per_token=31, link=slow_link).decide(400, 400 * 18_500).fetch
    # Unshaped loopback: fetching wins even for a short prefix.
    assert BreakEvenPolicy(prefill_ms_per_token=2.7).decide(64, 64 * 18_500).fetch


def test_policy_learns_from_measurements():
    policy = BreakEvenPolicy(prefill_ms_per_token=30.0, link=None)
    for tokens in (100, 200, 300, 400):
        policy.observe_prefill(tokens, 0.5 * tokens)  # actually a fast board
    for size in (1e6, 2e6, 4e6, 8e6):
        policy.observe_fetch(size, 5 + size / 1e4)  # and a slow-ish link: 100 ms per MB
    assert policy.predict_prefill_ms(400) == pytest.approx(200)
    assert policy.predict_fetch_ms(4e6) == pytest.approx(405, rel=0.02)
    assert not policy.decide(400, 4e6).fetch


def test_policy_margin_and_forced_modes():
    policy = BreakEvenPolicy(prefill_ms_per_token=1.0, link=None, margin=0.5, margin_ms=0.0, restore_bytes_per_ms=1.0)
    # fetch 100 ms vs prefill 120 ms: wins, but not by the 50% margin.
    assert not policy.decide(120, 99).fetch
    assert BreakEvenPolicy(mode="always", prefill_ms_per_token=0.001).decide(10, 10**9).fetch
    assert not BreakEvenPolicy(mode="never").decide(10**6, 1).fetch
    with pytest.raises(ValueError):
        BreakEvenPolicy(mode="sometimes")

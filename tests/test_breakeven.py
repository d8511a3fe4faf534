"""Break-even arithmetic and link profiles: pure, millisecond tests."""

import pytest

from cachebox.link import LINK_PRESETS, LinkProfile
from inference.breakeven import LinearFit, crossover, fit_line, points_from_breakdowns


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

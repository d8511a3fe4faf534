"""The dashboard's figures are built as plain dicts, without plotly's validation on the request path
(``dashboard.pages.charts``): here plotly's own classes validate each one, and what they make of it is what
the page gets."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import plotly.graph_objects as go
import pytest

from cachebox.link import LINK_PRESETS
from dashboard.pages import charts
from dashboard.pages.chart_series import ChartPoint

T0 = datetime(2026, 11, 27, tzinfo=timezone.utc)
POINTS = [
    ChartPoint(
        T0 + timedelta(seconds=i),
        f"d{i % 3}",
        10.0 + i,
        20.0 + i,
        1.0 + i,
        2.0 + i,
        1e6 * i,
        1,
        context_hits=i % 2,
        cachebox_hits=(i + 1) % 2,
    )
    for i in range(30)
]
DEVICES, COLORS = ["d0", "d1", "d2"], {"d0": "#111111"}  # d1 and d2 without a colour: plotly picks
RUNS = [
    SimpleNamespace(pk=i, device=SimpleNamespace(name="d0"), breakdown={"token_ms": 1.0 * i, "redis_ms": 2.0})
    for i in range(5)
]
BREAKDOWNS = [
    {"case": "miss", "prompt_tokens": 100 + i * 10, "prefill_ms": 50.0 + i * 5, "ttft_ms": 60.0 + i} for i in range(10)
] + [
    {
        "case": "full",
        "matched_tokens": 100 + i * 10,
        "redis_ms": 5.0 + i,
        "restore_ms": 1.0,
        "ttft_ms": 8.0,
        "decision": "fetch",
        "candidate_tokens": 100,
        "predicted_fetch_ms": 5.0,
    }
    for i in range(10)
]
LINK = next(profile for profile in LINK_PRESETS.values() if profile)

FIGURES = {
    "timeline": lambda: charts.timeline_figure(POINTS, DEVICES, COLORS),
    "timeline, no runs": lambda: charts.timeline_figure([], DEVICES, COLORS),
    "tbt": lambda: charts.tbt_figure(POINTS, DEVICES, COLORS),
    "hit ratio": lambda: charts.hit_ratio_figure(POINTS, DEVICES, COLORS),
    "bytes": lambda: charts.bytes_figure(POINTS, DEVICES, COLORS),
    "breakdown": lambda: charts.breakdown_figure(RUNS),
    "breakdown, no runs": lambda: charts.breakdown_figure([]),
    "break-even": lambda: charts.breakeven_figure(BREAKDOWNS, LINK, "Wi-Fi 4"),
    "break-even, no runs": lambda: charts.breakeven_figure([], None, "no link"),
}


def _without_template(layout: dict) -> dict:
    return {key: value for key, value in layout.items() if key != "template"}


@pytest.mark.parametrize("name", FIGURES)
def test_each_figure_is_what_plotly_makes_of_it(name):
    figure = FIGURES[name]()
    checked = go.Figure(
        {"data": figure["data"], "layout": figure["layout"]}
    ).to_plotly_json()  # raises on any property plotly does not know
    assert checked["data"] == figure["data"]
    assert _without_template(checked["layout"]) == _without_template(figure["layout"])
    assert figure["layout"]["template"] == charts._template("plotly_white")


def test_plotly_refuses_what_the_check_above_relies_on_it_refusing():
    """The check is only worth its name if plotly rejects a misspelt property in a dict."""
    with pytest.raises(ValueError):
        go.Figure({"data": [{"type": "scatter", "colour": "red"}], "layout": {}})
    with pytest.raises(ValueError):
        go.Figure({"data": [], "layout": {"yaxis": {"titel": {"text": "ms"}}}})


def test_layout_spells_out_plotly_shorthand():
    assert charts._layout(yaxis_title="ms", yaxis=dict(range=[0, 1]), shapes=[], meta=None) == {
        "yaxis": {"title": {"text": "ms"}, "range": [0, 1]}
    }
    assert charts._trace("scatter", name="a", x=[], marker=dict(color=None)) == {
        "type": "scatter",
        "name": "a",
        "x": [],
    }

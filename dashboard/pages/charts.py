"""Plotly figures of the dashboard, built server-side; the page extends them live.

Every figure is a plain dict handed to Plotly.js; trace names are what the page's script uses to
find the trace a new run extends. The dashboard's own figures are built as dicts (``_trace``,
``_figure``): plotly's graph objects validate every property and copy every point on the way
(~45 ms for a chart of 24 traces of 200 points; the Dashboard draws five). The tests validate each
figure with plotly's classes instead (``tests/dashboard/test_charts_plain.py``).
"""

from __future__ import annotations

import copy
import functools
from typing import Iterable

import plotly.io

from cachebox.link import LinkProfile
from dashboard.pages.chart_series import HIT_TIERS, ChartPoint
from dashboard.pages.explain import human_ms
from inference.serving.breakdown import OTHER, TIER_WORDS, TIME_LABELS, time_sums
from inference.serving.breakeven import LinearFit, crossover, fit_line, overlap_ms, points_from_breakdowns

# The stacked parts of a run's TTLT: the paper's table-3 groups in its order and words, then
# "other" (one source for the chart and live.js, which finds each run's values in ``time_sums``).
COMPONENTS = (*TIME_LABELS, OTHER)
WINDOW = 5000  # points a trace keeps while live points arrive (the range's points come from the database)
BREAKEVEN_RUNS = 200  # a board's newest runs its break-even chart fits lines to

# The top margin leaves the band above the title to Plotly's toolbar (shown on hover, top right):
# the title sits just above the plot area, left-aligned, so the toolbar never covers it. The
# page's script wraps a long title to the chart's width and grows the margin to match.
_TOP_MARGIN = 56
_LAYOUT = dict(
    margin=dict(l=55, r=15, t=_TOP_MARGIN, b=45),
    height=320,
    legend=dict(orientation="h", y=-0.25),
    template="plotly_white",
    autosize=True,
)


EMPTY_TEXT = "No runs in this time range yet"


def _set(value, *, lists: bool = False):
    """``value`` without the properties left unset, as plotly leaves them out: None, an empty
    dict, and with ``lists`` an empty list (a layout's shapes; a trace's empty points stay, for the
    page to extend)."""
    if isinstance(value, dict):
        kept = {key: _set(item, lists=lists) for key, item in value.items()}
        return {
            key: item
            for key, item in kept.items()
            if item is not None and item != {} and not (lists and isinstance(item, list) and not item)
        }
    return value


def _trace(kind: str, **props) -> dict:
    """A trace as Plotly.js takes it (``kind``: ``scatter``, ``bar``...)."""
    return _set({"type": kind, **props})


def _plain(trace) -> dict:
    """A trace as a dict: ours are; the lab's charts still build plotly's graph objects."""
    return trace if isinstance(trace, dict) else trace.to_plotly_json()


def _merged(into: dict, more: dict) -> dict:
    for key, value in more.items():
        into[key] = (
            _merged(dict(into[key]), value) if isinstance(value, dict) and isinstance(into.get(key), dict) else value
        )
    return into


def _titled(value):
    """Plotly's shorthand for a title, a string, spelled out (``{"text": ...}``), at any depth."""
    if isinstance(value, dict):
        return {
            key: {"text": item} if key == "title" and isinstance(item, str) else _titled(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_titled(item) for item in value]
    return value


def _layout(**props) -> dict:
    """Layout properties as Plotly.js takes them, from ``update_layout``'s spelling: ``yaxis_title``
    is ``yaxis.title``, and a title given as a string is its text."""
    layout: dict = {}
    for key, value in props.items():
        *path, leaf = key.split("_")
        node = layout
        for part in path:
            node = node.setdefault(part, {})
        _merged(node, {leaf: value})
    return _set(_titled(layout), lists=True)


def _has_points(traces) -> bool:
    return any(len(trace.get("x") or ()) for trace in traces)


@functools.lru_cache(maxsize=4)
def _template(name: str) -> dict:
    return plotly.io.templates[name].to_plotly_json()


def _figure(traces, title: str, *, empty_text: str | None = EMPTY_TEXT, **layout) -> dict:
    """A figure as Plotly.js takes it. Without a single point it says so (``empty_text``) instead
    of drawing empty axes (Plotly's -1..6); ``layout.meta.empty`` tells the page to show the axes
    again when live points arrive.

    The template's JSON is made once and put in each figure's layout: set through ``update_layout``
    Plotly validates and copies the whole template every time (~100 ms a figure; the dashboard has five).
    ``traces`` may be plotly's graph objects (the lab's charts): they become their dicts."""
    traces = [_plain(trace) for trace in traces]
    layout = {**_LAYOUT, **layout}
    template = layout.pop("template", None)
    title = dict(
        text=title,
        font=dict(size=14),
        x=0,
        xref="paper",
        xanchor="left",
        y=1,
        yref="paper",
        yanchor="bottom",
        pad=dict(b=8),
    )
    figure = {"data": traces, "layout": _layout(title=title, **layout)}
    if empty_text and not _has_points(traces):
        _merged(
            figure["layout"],
            _layout(
                meta={"empty": True},
                xaxis=dict(visible=False),
                yaxis=dict(visible=False),
                annotations=[
                    dict(
                        text=empty_text,
                        xref="paper",
                        yref="paper",
                        x=0.5,
                        y=0.5,
                        showarrow=False,
                        font=dict(size=15, color="#667085"),
                    )
                ],
            ),
        )
    if template is not None:
        figure["layout"]["template"] = copy.deepcopy(_template(template))
    return figure


def run_label(run) -> str:
    return f"{run.device.name} #{run.pk}"


def breakdown_figure(runs: list) -> dict:
    """Stacked per-run TTLT, oldest first: the paper's table-3 groups (Token, Bloom, P-decode, Redis,
    R-decode, Sample) and "other" (``inference.serving.breakdown.time_sums``), so each bar is the run's
    TTLT. An "other" below zero says the named parts exceed it (steps that ran at the same time)."""
    labels = [run_label(run) for run in runs]
    sums = [time_sums(run.breakdown or {})["ttlt"] for run in runs]
    traces = [
        _trace("bar", name=name, x=labels, y=[total.parts[index].ms for total in sums])
        for index, name in enumerate(COMPONENTS)
    ]
    return _figure(
        traces,
        "Time to last token per run: its parts (ms)",
        barmode="relative",
        yaxis_title="ms",
        legend=dict(orientation="h", y=-0.25, traceorder="normal"),
    )


def _mine(points: list[ChartPoint], device: str) -> list[ChartPoint]:
    return [point for point in points if point.device == device]


def _when(point: ChartPoint) -> str:
    return point.created.isoformat()


def _color(colors: dict[str, str] | None, device: str) -> str | None:
    return (colors or {}).get(device)


def _paired_traces(points: list[ChartPoint], devices: Iterable[str], colors, pair, keep=lambda point: True) -> list:
    """Two lines per device in its colour: ``pair`` = ((field, label) solid, (field, label) dotted)."""
    traces = []
    for device in devices:
        mine = [point for point in _mine(points, device) if keep(point)]
        for (field, metric), dash in zip(pair, ("solid", "dot")):
            traces.append(
                _trace(
                    "scatter",
                    name=f"{device} {metric}",
                    x=[_when(point) for point in mine],
                    y=[getattr(point, field) for point in mine],
                    mode="lines+markers",
                    line=dict(dash=dash, color=_color(colors, device)),
                )
            )
    return traces


def timeline_figure(points: list[ChartPoint], devices: Iterable[str], colors: dict[str, str] | None = None) -> dict:
    traces = _paired_traces(points, devices, colors, (("ttft_ms", "TTFT"), ("ttlt_ms", "TTLT")))
    return _figure(traces, "TTFT and TTLT over time (ms)", yaxis_title="ms")


def tbt_figure(points: list[ChartPoint], devices: Iterable[str], colors: dict[str, str] | None = None) -> dict:
    """Time between answer tokens of each run (p50 solid, p99 dotted): what a streaming reader feels."""
    # One-token answers have no time between tokens: left out.
    traces = _paired_traces(
        points,
        devices,
        colors,
        (("tbt_p50_ms", "TBT p50"), ("tbt_p99_ms", "TBT p99")),
        keep=lambda point: point.tbt_p50_ms > 0,
    )
    return _figure(traces, "Time between tokens, p50 and p99 per run (ms)", yaxis_title="ms")


def hit_counts(points: list[ChartPoint]) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {}
    for point in points:
        hits, total = counts.setdefault(point.device, [0, 0])
        counts[point.device] = [hits + point.hits, total + point.runs]
    return counts


# Each tier of the hit-ratio chart: its label and dash (every device keeps its own colour), nearest
# first. The page's script draws live runs with the same (``hit_tiers``).
DASHES = {"context": "dot", "local": "dash", "flash": "dashdot", "cachebox": "solid"}
DASH_WORDS = {"dot": "dotted", "dash": "dashed", "dashdot": "dash-dotted", "solid": "solid"}
TIER_STYLES = {tier.value: (label, DASHES[tier.value], where) for tier, (label, where) in TIER_WORDS.items()}


def hit_tiers() -> list[dict]:
    """The hit-ratio chart's tiers as the page's script extends them: trace label, dash, hover text."""
    return [
        {
            "tier": tier,
            "label": label,
            "dash": dash,
            "hovertemplate": f"%{{y:.2f}} of runs hit from {where}<extra>%{{fullData.name}}</extra>",
        }
        for tier, (label, dash, where) in ((tier, TIER_STYLES[tier]) for tier in HIT_TIERS)
    ]


def tier_counts(points: list[ChartPoint]) -> dict[str, dict[str, int]]:
    """Per device, its runs and its hits by tier within the range (where live runs carry on from)."""
    counts: dict[str, dict[str, int]] = {}
    for point in points:
        mine = counts.setdefault(point.device, {"runs": 0, **{tier: 0 for tier in HIT_TIERS}})
        mine["runs"] += point.runs
        for tier in HIT_TIERS:
            mine[tier] += point.tier_hits(tier)
    return counts


def hit_ratio_figure(points: list[ChartPoint], devices: Iterable[str], colors: dict[str, str] | None = None) -> dict:
    """Per device and tier, the cumulative fraction of its runs (within the range) whose hit came
    from that tier: the board's context, its RAM tier or the cache box. A device's tiers add up
    to its hit ratio (runs that restored at least one cached range)."""
    traces = []
    for device in devices:
        mine = _mine(points, device)
        total, hits = 0, {tier: 0 for tier in HIT_TIERS}
        ys: dict[str, list[float]] = {tier: [] for tier in HIT_TIERS}
        for point in mine:
            total += point.runs
            for tier in HIT_TIERS:
                hits[tier] += point.tier_hits(tier)
                ys[tier].append(hits[tier] / total)
        for style in hit_tiers():
            traces.append(
                _trace(
                    "scatter",
                    name=f"{device} {style['label']}",
                    x=[_when(point) for point in mine],
                    y=ys[style["tier"]],
                    mode="lines+markers",
                    line=dict(color=_color(colors, device), dash=style["dash"]),
                    legendgroup=device,
                    hovertemplate=style["hovertemplate"],
                )
            )
    return _figure(
        traces,
        "Cache hit ratio by tier: "
        + ", ".join(f"{label} ({DASH_WORDS[dash]})" for label, dash, _ in (TIER_STYLES[tier] for tier in HIT_TIERS)),
        yaxis=dict(range=[0, 1.05], title="share of runs"),
    )


def bytes_figure(points: list[ChartPoint], devices: Iterable[str], colors: dict[str, str] | None = None) -> dict:
    traces = []
    for device in devices:
        mine = _mine(points, device)
        traces.append(
            _trace(
                "scatter",
                name=device,
                x=[_when(point) for point in mine],
                y=[point.state_bytes / 1e6 for point in mine],
                mode="markers",
                marker=dict(color=_color(colors, device)),
            )
        )
    return _figure(traces, "Prompt state moved per run (MB, fetched + uploaded)", yaxis_title="MB")


def overlap_words(tokens: float, computing_ms: float, fetching_ms: float, together_ms: float) -> str:
    """The verdict's second half, in plain words: for a prompt of ``tokens``, what computing it all,
    fetching it all, and computing the front while the back loads each take (the fitted lines)."""
    if computing_ms <= 0 or fetching_ms <= 0:
        return ""
    better, best_ms = (
        ("fetching it all", fetching_ms) if fetching_ms < computing_ms else ("computing it all", computing_ms)
    )
    sentence = (
        f". For a {tokens:.0f}-token prompt, computing it all takes about {human_ms(computing_ms)}, fetching it all {human_ms(fetching_ms)}, "
        f"and computing the front while the back loads {human_ms(together_ms)}"
    )
    saved = 1 - together_ms / best_ms
    if saved >= 0.01:
        return sentence + f": {saved:.0%} less than {better}"
    return sentence + f": no faster than {better}"


def breakeven_figure(
    breakdowns: list[dict], link: LinkProfile | None, link_label: str, bytes_per_token: float = 18_500
) -> dict:
    """Prefill vs fetch+restore time against tokens, fitted lines and where they cross."""
    points = points_from_breakdowns(breakdowns)
    prefill_fit = fit_line(*zip(*points.prefill)) if len(points.prefill) >= 2 else None
    fetch_fit = fit_line(*zip(*points.fetch)) if len(points.fetch) >= 2 else None
    longest = max([t for t, _ in points.prefill + points.fetch] + [512])
    xs = [0, longest * 1.1]
    traces = [
        _trace(
            "scatter",
            name="prefill (measured)",
            x=[t for t, _ in points.prefill],
            y=[ms for _, ms in points.prefill],
            mode="markers",
            marker=dict(color="#d62728"),
        ),
        _trace(
            "scatter",
            name="fetch + restore (measured)",
            x=[t for t, _ in points.fetch],
            y=[ms for _, ms in points.fetch],
            mode="markers",
            marker=dict(color="#1f77b4"),
        ),
    ]
    if prefill_fit:
        traces.append(
            _trace(
                "scatter",
                name=f"prefill fit: {prefill_fit.slope:.2f} ms/token",
                x=xs,
                y=[prefill_fit.predict(x) for x in xs],
                mode="lines",
                line=dict(color="#d62728"),
            )
        )
    if fetch_fit:
        traces.append(
            _trace(
                "scatter",
                name=f"fetch fit: {fetch_fit.slope:.3f} ms/token",
                x=xs,
                y=[fetch_fit.predict(x) for x in xs],
                mode="lines",
                line=dict(color="#1f77b4"),
            )
        )
    if link is not None:
        traces.append(
            _trace(
                "scatter",
                name=f"link model ({link_label})",
                x=xs,
                y=[link.transfer_ms(x * bytes_per_token) for x in xs],
                mode="lines",
                line=dict(color="#1f77b4", dash="dash"),
            )
        )
    # The policy's decisions: where it was offered a cached range, what it forecast, what it chose.
    for decision, symbol, label in (
        ("fetch", "circle-open", "policy chose to fetch (forecast)"),
        ("policy-skip", "x", "policy chose to recompute (forecast)"),
    ):
        chosen = [b for b in breakdowns if b.get("decision") == decision and b.get("candidate_tokens")]
        if chosen:
            traces.append(
                _trace(
                    "scatter",
                    name=label,
                    x=[b["candidate_tokens"] for b in chosen],
                    y=[b.get("predicted_fetch_ms", 0) for b in chosen],
                    mode="markers",
                    marker=dict(symbol=symbol, size=9, color="#2ca02c" if decision == "fetch" else "#ff7f0e"),
                    customdata=[[b.get("predicted_prefill_ms", 0), b.get("redis_ms", 0)] for b in chosen],
                    hovertemplate="%{x} tokens: fetch forecast %{y:.0f} ms, prefill forecast %{customdata[0]:.0f} ms, measured fetch %{customdata[1]:.0f} ms",
                )
            )
    shapes, annotations, verdict = [], [], "not enough runs yet: run prompts with and without hits"
    if prefill_fit and not fetch_fit and link is not None:
        # No fetch measured yet (the policy may never have fetched on a slow link): judge by the link model.
        fetch_fit = LinearFit(link.transfer_ms(bytes_per_token, round_trips=0), link.transfer_ms(0), 0)
    if prefill_fit and fetch_fit:
        cross = crossover(prefill_fit, fetch_fit)
        verdict = cross.describe() + (" (by the link model)" if fetch_fit.points == 0 else "")
        # Loading while computing: the front computed while the back loads, meeting where both finish.
        through_origin = LinearFit(max(prefill_fit.slope, 0.0), 0.0, prefill_fit.points)
        dense = [xs[-1] * step / 40 for step in range(41)]
        overlapped = [overlap_ms(x, through_origin, fetch_fit) for x in dense]
        traces.append(
            _trace(
                "scatter",
                name="compute the front while the back loads",
                x=dense,
                y=overlapped,
                mode="lines",
                line=dict(color="#2ca02c", width=3),
            )
        )
        at = min(longest, 512)
        verdict += overlap_words(
            at, through_origin.predict(at), fetch_fit.predict(at), overlap_ms(at, through_origin, fetch_fit)
        )
        if cross.tokens is not None:
            shapes.append(
                dict(
                    type="line",
                    x0=cross.tokens,
                    x1=cross.tokens,
                    yref="paper",
                    y0=0,
                    y1=1,
                    line=dict(color="#2ca02c", dash="dot"),
                )
            )
            annotations.append(
                dict(
                    x=cross.tokens,
                    yref="paper",
                    y=1.0,
                    yanchor="top",
                    text=f"break-even ≈ {cross.tokens:.0f} tokens",
                    showarrow=False,
                    xanchor="left",
                )
            )
    profiles = sorted({b.get("compute_profile") for b in breakdowns if b.get("compute_profile")})
    if profiles:
        link_label += f", compute {' / '.join(profiles)}"
    figure = _figure(
        traces,
        f"Break-even on {link_label}",  # short: the verdict is a sentence of its own under the chart
        empty_text="No runs on this board yet",
        xaxis_title="prompt tokens (prefilled or fetched)",
        yaxis_title="ms",
        shapes=shapes,
        annotations=annotations,
        height=380,
    )
    figure["verdict"] = verdict[:1].upper() + verdict[1:] + "."
    return figure

"""The home page: every board at a glance and the live charts; the favicon and plotly.js it loads."""

from __future__ import annotations

import functools
from collections import Counter

import plotly.offline
from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.templatetags.static import static

from dashboard import actions
from dashboard.pages import board_start, charts
from dashboard.pages.chart_series import RANGE_LABELS, chart_series, parse_range
from dashboard.pages.colors import device_colors
from dashboard.pages.stats import (
    device_summaries,
    explained,
    fleet_counts,
    recent_runs,
    run_counts,
    runs_label,
    visible_devices,
    visible_runs,
)

from .auth import login_required

BREAKDOWN_BARS = 50  # runs the stacked breakdown chart shows (the newest of the range)
HOME_CARDS = 24  # device cards the dashboard shows; a larger fleet is counted, and found on the Devices page
CHART_DEVICES = 12  # devices the per-device charts draw a trace for (the busiest in the range)


def home_charts(viewer, range_name: str) -> dict:
    """The dashboard's figures for a time range (``chart_series.RANGES``), as the page draws them:
    a trace per device that ran in it (and per device when the fleet is small)."""
    runs = visible_runs(viewer)
    series = chart_series(runs, range_name)
    busiest = Counter(point.device for point in series.points)
    shown_devices = len(busiest)
    if len(busiest) > CHART_DEVICES:  # hundreds of boards ran: a trace each would draw nothing readable, slowly
        kept = {name for name, _ in busiest.most_common(CHART_DEVICES)}
        series.points = [point for point in series.points if point.device in kept]
    ran = {point.device for point in series.points}
    visible = visible_devices(viewer)
    devices = list(visible if visible.count() <= HOME_CARDS else visible.filter(name__in=ran))
    names = sorted(ran | {device.name for device in devices})
    colors = device_colors(devices)
    in_range = runs if series.since is None else runs.filter(created__gte=series.since)
    counts = run_counts(in_range)  # every run in the range, failed and cancelled ones too, as the cards count them
    bars = list(reversed(in_range.filter(error="")[:BREAKDOWN_BARS]))
    return {
        "breakdown": charts.breakdown_figure(bars),
        "timeline": charts.timeline_figure(series.points, names, colors),
        "tbt": charts.tbt_figure(series.points, names, colors),
        "hits": charts.hit_ratio_figure(series.points, names, colors),
        "bytes": charts.bytes_figure(series.points, names, colors),
        "hitCounts": charts.hit_counts(series.points),
        "tierCounts": charts.tier_counts(series.points),  # live runs carry the hit-ratio chart on from these
        "hitTiers": charts.hit_tiers(),
        "colors": colors,
        "range": series.range,
        "granularity": series.granularity,
        "runs": series.runs,  # answered runs: what the charts draw
        "counts": counts,
        "rangeWords": RANGE_WORDS[series.range],
        "devices_ran": shown_devices,
        "devices_drawn": len(ran),
        "status": chart_status(counts, RANGE_WORDS[series.range], series.granularity, len(ran), shown_devices),
        "window": charts.WINDOW,
    }


# How the status line beside Pause names a range ("" for every run: the cards' count).
RANGE_WORDS = {"15m": "in the last 15 min", "1h": "in the last hour", "24h": "in the last 24 h", "all": ""}


def chart_status(counts: dict, range_words: str, granularity: str, drawn: int, ran: int) -> str:
    """The line beside Pause: every run in the range, counted as the cards count them, and what the
    charts draw of them ("38 runs in the last 24 h (3 failed, 1 cancelled); the charts draw the 34
    answered"). ``live.js`` (``describe``) says it the same way as runs arrive."""
    text = runs_label(counts) + (f" {range_words}" if range_words else "")
    if counts.get("failed") or counts.get("cancelled"):
        text += f"; the charts draw the {counts.get('answered', 0)} answered"
    if granularity != "run":
        text += f", averaged per {granularity}"
    if drawn < ran:
        text += f"; the {drawn} busiest of {ran} boards drawn"
    return text


@login_required
def home(request):
    visible = visible_devices(request.user)
    counts = fleet_counts(visible)
    # A small fleet: a card each. A large one: its counts, and cards for the boards seen last.
    devices = list(
        visible
        if counts["total"] <= HOME_CARDS
        else visible.exclude(last_seen=None).order_by("-last_seen")[:HOME_CARDS]
    )
    chart_data = home_charts(request.user, parse_range(request.GET.get("range")))
    store = actions.cachebox()
    return render(
        request,
        "dashboard/home.html",
        {
            "summaries": device_summaries(devices),
            "counts": counts,
            "all_cards": counts["total"] <= HOME_CARDS,
            "chart_data": chart_data,
            "ranges": RANGE_LABELS,
            # The table lists failed runs too (the charts draw successful ones only).
            "runs": explained(recent_runs(request.user, 20, failed=True)[::-1]),
            "cachebox_up": store.ping(),
            "cachebox_url": store.safe_url if request.user.is_staff else "",  # an internal address: staff only
            "embedded": settings.REDIS_URL_IS_EMBEDDED,
            "start": board_start.shown_to(request.user, "NAME", "TOKEN")
            if request.user.is_staff and not devices
            else None,
        },
    )


@login_required
def home_charts_json(request):
    """The dashboard's figures for ``?range=`` (15m, 1h, 24h, all): the page's range buttons."""
    return JsonResponse(home_charts(request.user, parse_range(request.GET.get("range"))))


def favicon(request):
    return redirect(static("favicon.svg"), permanent=True)


@functools.lru_cache(maxsize=1)
def _plotly_js() -> str:
    return plotly.offline.get_plotlyjs()


def plotly_js(request):
    """Plotly.js from the plotly package itself: no CDN, works offline."""
    response = HttpResponse(_plotly_js(), content_type="application/javascript")
    response["Cache-Control"] = "public, max-age=86400"
    return response

"""Issue 42, item 5: numbers on the pages that add up. TTFT and TTLT as the sums of their parts,
one count of runs per page (failed and cancelled runs counted one way), cancelled runs with their
measured TTFT, a slow hit only when it was slower than computing, a catalog line that reconciles,
the break-even verdict in plain words, advice for a board over its memory budget.

Django renders the pages from rows as boards store them (``InferenceRun``, heartbeats' status);
what a real run measures is checked in ``tests/inference/test_tiers.py`` (the real model, every tier).
"""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from html.parser import HTMLParser

import pytest
from django.urls import reverse
from django.utils import timezone

from dashboard import actions
from dashboard.models import InferenceRun
from inference.contract.messages import CANCELLED
from tests.dashboard.test_dashboard import control_plane, enrolled, heartbeat, register, staff_client  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]

# The run of issue 42's walk: parts that sum to 259 ms against a TTFT of 266.8 ms.
WALKED = {
    "case": "partial",
    "tier": "cachebox",
    "decision": "fetch",
    "cachebox": "ok",
    "token_ms": 2.31,
    "bloom_ms": 0.12,
    "prefill_ms": 188.46,
    "redis_ms": 67.83,
    "fetch_ms": 60.1,
    "restore_ms": 7.73,
    "local_ms": 0.0,
    "first_sample_ms": 0.31,
    "sample_ms": 4.9,
    "decode_ms": 792.4,
    "ttft_ms": 266.84,
    "ttlt_ms": 1082.26,
    "prompt_tokens": 400,
    "matched_tokens": 256,
    "fetched_tokens": 256,
    "generated_tokens": 16,
    "state_bytes": 4_700_000,
    "fetched_bytes": 4_700_000,
    "link": "unshaped",
    "candidate_tokens": 256,
    "predicted_fetch_ms": 70.0,
    "predicted_prefill_ms": 330.0,
}


def make_run(device, breakdown=None, *, error="", text="an answer", ago=timedelta(minutes=1)) -> InferenceRun:
    b = dict(WALKED if breakdown is None else breakdown)
    run = InferenceRun.objects.create(
        device=device,
        title="t",
        prompt="p",
        text=text,
        error=error,
        case="" if error and error != CANCELLED else b.get("case", "miss"),
        ttft_ms=b.get("ttft_ms", 0.0),
        ttlt_ms=b.get("ttlt_ms", 0.0),
        prompt_tokens=b.get("prompt_tokens", 0),
        matched_tokens=b.get("matched_tokens", 0),
        breakdown=b,
    )
    InferenceRun.objects.filter(pk=run.pk).update(created=timezone.now() - ago)
    return run


class _Table(HTMLParser):
    """The rows of the table with ``id``: each row's cells' text."""

    def __init__(self, table_id: str):
        super().__init__()
        self.table_id, self.depth, self.rows, self.cell = table_id, 0, [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and (dict(attrs).get("id") == self.table_id or self.depth):
            self.depth += 1
        elif self.depth and tag == "tr":
            self.rows.append([])
        elif self.depth and tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if tag == "table" and self.depth:
            self.depth -= 1
        elif self.depth and tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append(" ".join("".join(self.cell).split()))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def table(html: str, table_id: str) -> list[list[str]]:
    parser = _Table(table_id)
    parser.feed(html)
    assert parser.rows, f"no table #{table_id} on the page"
    return parser.rows


# -- TTFT and TTLT as the sums they are ------------------------------------------------------------
def test_the_run_page_shows_ttft_and_ttlt_as_the_sums_of_their_parts(staff_client, control_plane):
    device, _ = register("zero")
    run = make_run(device)
    html = staff_client.get(reverse("run-detail", args=[run.pk])).content.decode()
    for table_id, whole, labels in (
        ("run-ttft-sum", "266.8", ["Token", "Bloom", "P-decode", "Redis", "Sample", "other"]),
        ("run-ttlt-sum", "1082.3", ["Token", "Bloom", "P-decode", "Redis", "R-decode", "Sample", "other"]),
    ):
        rows = table(html, table_id)
        parts, total = rows[:-1], rows[-1]
        assert [row[0] for row in parts] == labels
        assert total[1] == whole
        # The parts as shown add up to the whole as shown; "other" is what the named parts leave.
        assert sum(Decimal(row[1]) for row in parts) == Decimal(whole)
    ttft = dict((row[0], row[1]) for row in table(html, "run-ttft-sum"))
    assert ttft["other"] == "7.8" and ttft["Sample"] == "0.3" and ttft["Redis"] == "67.8"
    # The ~50 raw fields under headings, each once.
    headings = re.findall(r"<summary>([^<]+)</summary>", html)
    assert headings[:3] == ["Time to first token (ms)", "The answer", "Where the prompt came from (tokens)"]
    fields = re.findall(r'<th scope="row"><code>(\w+)</code></th>', html)
    assert sorted(fields) == sorted(WALKED) and len(fields) == len(set(fields))


def test_parts_that_exceed_the_whole_are_said_not_hidden(staff_client, control_plane):
    device, _ = register("zero")
    overlapped = {
        **WALKED,
        "prefill_ms": 230.0,
        "redis_ms": 90.0,
        "planned_split": 128,
        "met_at": 128,
    }  # loaded while computing
    html = staff_client.get(reverse("run-detail", args=[make_run(device, overlapped).pk])).content.decode()
    ttft = dict((row[0], row[1]) for row in table(html, "run-ttft-sum")[:-1])
    assert Decimal(ttft["other"]) < 0 and sum(Decimal(value) for value in ttft.values()) == Decimal("266.8")
    assert f"the named parts exceed TTFT by {-Decimal(ttft['other'])} ms" in html


def test_the_stacked_chart_and_live_runs_carry_the_same_sums(staff_client, control_plane):
    device, _ = register("zero")
    run = make_run(device)
    data = staff_client.get(reverse("home-charts"), {"range": "1h"}).json()
    bars = {trace["name"]: trace["y"][0] for trace in data["breakdown"]["data"]}
    assert list(bars) == ["Token", "Bloom", "P-decode", "Redis", "R-decode", "Sample", "other"]
    assert sum(Decimal(repr(value)) for value in bars.values()) == Decimal("1082.3")  # each bar is the run's TTLT
    live = actions.run_json(run)
    assert (
        live["time_sums"]["ttft"]["sentence"]
        == "TTFT 266.8 ms = Token 2.3 + Bloom 0.1 + P-decode 188.5 + Redis 67.8 + Sample 0.3 + other 7.8"
    )
    page = staff_client.get(reverse("home")).content.decode()
    assert '"other"' in re.search(r'<script id="chart-stack"[^>]*>(.*?)</script>', page, re.S).group(1)


# -- one count of runs per page --------------------------------------------------------------------
def test_every_count_of_runs_counts_failed_and_cancelled_runs_one_way(staff_client, control_plane):
    device, _ = register("zero")
    for minutes in (1, 2, 3):
        make_run(device, ago=timedelta(minutes=minutes))
    make_run(device, {}, error="the board failed: RuntimeError: boom", text="")
    make_run(device, {**WALKED, "generated_tokens": 3}, error=CANCELLED, text=" Lisbon, Porto")
    said = "5 runs (1 failed, 1 cancelled)"
    home = staff_client.get(reverse("home"), {"range": "24h"}).content.decode()
    card = re.search(r'<a class="card device-card"[^>]*data-device="zero">.*?</a>', home, re.S).group(0)
    assert f'<span data-role="runs">{said}</span>' in card
    status = re.search(r'id="chart-status"[^>]*>([^<]*)<', home).group(1)
    assert status == f"{said} in the last 24 h; the charts draw the 3 answered"
    for name, args in (("devices", []), ("device-detail", ["zero"])):
        assert f'<span data-role="runs">{said}</span>' in staff_client.get(reverse(name, args=args)).content.decode(), (
            name
        )
    assert f'id="runs-count">{said}' in staff_client.get(reverse("runs")).content.decode()
    # The Runs page's outcome filter: a cancelled run is no failed one.
    for value, count in (("yes", 1), ("cancelled", 1), ("no", 3), ("", 5)):
        assert staff_client.get(reverse("runs"), {"error": value}).context["total"] == count, value
    # A run arriving live moves the cards' count the same way (the server's words, live.js shows them).
    assert actions.run_json(InferenceRun.objects.get(error=CANCELLED))["device_figures"]["runs_label"] == said


def test_a_cancelled_run_shows_its_measured_ttft(staff_client, control_plane):
    device, _ = register("zero")
    run = make_run(device, {**WALKED, "generated_tokens": 3}, error=CANCELLED, text=" Lisbon, Porto")
    for name in ("home", "runs"):
        html = staff_client.get(reverse(name)).content.decode()
        row = re.search(r'<tr data-(?:request|run)="[^"]+" class="cancelled">.*?</tr>', html, re.S).group(0)
        assert "266.8" in row and "cancelled" in row and "–" not in row, name
    page = staff_client.get(reverse("run-detail", args=[run.pk])).content.decode()
    assert 'id="run-error"' not in page and "TTFT 266.8 ms" in page and 'id="run-ttft-sum"' in page


# -- a slow hit is one slower than computing --------------------------------------------------------
def test_a_hit_faster_than_computing_is_not_called_slow():
    from dashboard.pages.explain import why

    # The walk's hit: the link took most of the TTFT, and computing was forecast five times longer.
    hit = {
        "case": "full",
        "tier": "cachebox",
        "fetch_ms": 3400.0,
        "redis_ms": 3460.0,
        "ttft_ms": 3600.0,
        "fetched_bytes": 8_400_000,
        "fetched_tokens": 456,
        "link": "Wi-Fi 4 (20.9 Mbit/s, 4 ms)",
        "predicted_fetch_ms": 3300.0,
        "predicted_prefill_ms": 17_300.0,
    }
    (sentence,) = why(hit)
    assert "slow" not in sentence.lower()
    assert sentence == (
        "The emulated Wi-Fi 4 (20.9 Mbit/s, 4 ms) link took 3.4 s for 8.4 MB (forecast 3.3 s), 94% of the time to first token, "
        "and still 5.0x faster than computing those 456 tokens here (17.3 s forecast)."
    )
    # Slower than computing: slow, and it says against what.
    assert why({**hit, "predicted_prefill_ms": 2000.0})[0].startswith(
        "A slow hit: the emulated Wi-Fi 4 (20.9 Mbit/s, 4 ms) link took 3.4 s"
    )
    assert (
        "longer than the 2.0 s computing those 456 tokens here was forecast to take"
        in why({**hit, "predicted_prefill_ms": 2000.0})[0]
    )
    # No forecast of computing: what the link took, and no verdict.
    assert (
        why({**hit, "predicted_prefill_ms": 0})[0]
        == "The emulated Wi-Fi 4 (20.9 Mbit/s, 4 ms) link took 3.4 s for 8.4 MB (forecast 3.3 s), 94% of the time to first token."
    )


# -- the device page: a catalog line that reconciles, a verdict in words, memory advice ---------------------
def device_page(staff_client, status: dict, name: str = "zero") -> str:
    device, token = register(name)
    actions.record_heartbeat(heartbeat(enrolled(device, token), status, device=name))
    return staff_client.get(reverse("device-detail", args=[name])).content.decode()


def sums_line(html: str) -> str:
    row = re.search(r'<tr class="catalog-sums" data-namespace="default"><td[^>]*>(.*?)</td></tr>', html, re.S).group(1)
    return " | ".join(part.strip() for part in row.replace("&quot;", '"').replace("&#x27;", "'").split("<br>"))


def test_the_catalog_line_adds_up(staff_client, control_plane):
    counters = {
        "lookups": 554,
        "maybe_hits": 513,
        "true_hits": 4,
        "false_positives": 0,
        "held_on_board": 480,
        "policy_skipped": 29,
        "cachebox_down": 0,
    }
    line = sums_line(device_page(staff_client, {"catalogs": {"default": {"approx_items": 40, **counters}}}))
    assert line == (
        '554 lookups = 41 certain "no" + 513 "maybe" | 513 "maybe" = 4 in the cache box (true hits) + 0 not there (false positives)'
        " + 480 not asked (the board's own context, RAM or flash tier held those ranges) + 29 not asked (the break-even policy forecast computing them faster)"
    )
    numbers = [int(n) for n in re.findall(r"(?<![\w-])(\d+) ", line.split(" | ")[1])]
    assert numbers[0] == sum(numbers[1:])  # the "maybe"s are the sum of what became of them


def test_a_board_that_counts_no_reasons_is_not_made_to_add_up(staff_client, control_plane):
    # The walk's board: lookups 554, maybe 513, true hits 4, false positives 0, and nothing else.
    line = sums_line(
        device_page(
            staff_client,
            {"catalogs": {"default": {"lookups": 554, "maybe_hits": 513, "true_hits": 4, "false_positives": 0}}},
        )
    )
    assert line.endswith("+ 509 not asked or not counted (this board's version does not say why)")


def test_the_breakeven_verdict_is_said_in_plain_words():
    from dashboard.pages.charts import breakeven_figure

    runs = [{"prompt_tokens": tokens, "matched_tokens": 0, "prefill_ms": 3.0 * tokens} for tokens in (100, 300, 500)]
    runs += [
        {
            "prompt_tokens": tokens,
            "matched_tokens": tokens,
            "fetched_tokens": tokens,
            "redis_ms": 200.0 + 1.5 * tokens,
            "tier": "cachebox",
        }
        for tokens in (128, 256, 512)
    ]
    verdict = breakeven_figure(runs, None, "unshaped")["verdict"]
    assert "x the better alone" not in verdict and "both together" not in verdict
    assert verdict == (
        "Fetching wins from 133 tokens. For a 512-token prompt, computing it all takes about 1.5 s, fetching it all 968 ms, "
        "and computing the front while the back loads 645 ms: 33% less than fetching it all."
    )


def test_a_board_over_its_memory_budget_is_told_what_to_do(staff_client, control_plane):
    status = {
        "memory": {
            "rss_mb": 431.0,
            "peak_rss_mb": 443.0,
            "memory_mb": 512,
            "budget_mb": 399.4,
            "n_ctx": 4096,
            "kv_cache_mb": 144.0,
        },
        "ram_tier": {
            "entries": 3,
            "bytes": 20 * 1024 * 1024,
            "budget_bytes": 64 * 1024 * 1024,
            "rss_limit_bytes": 418_000_000,
        },
    }
    html = device_page(staff_client, status)
    advice = (
        re.search(r'<div class="warning-box" id="memory-advice"[^>]*>(.*?)</div>', html, re.S)
        .group(1)
        .replace("&#x27;", "'")
    )
    assert "a peak of 443 MB against 399 MB" in advice and "44 MB over" in advice
    assert (
        "EDGECACHE_RAM_TIER_MB=16" in advice
        and "EDGECACHE_N_CTX=2816" in advice
        and "freeing about 45 MB of KV cache" in advice
    )
    assert (
        "register what it has (Admin &gt; Devices: memory): registered with 568 MB, this peak is within its budget"
        in advice
    )
    within = {**status, "memory": {**status["memory"], "peak_rss_mb": 380.0}}
    assert 'id="memory-advice"' not in device_page(staff_client, within, name="one")


def test_every_breakdown_field_has_one_heading_on_the_run_page():
    from dataclasses import fields

    from inference.serving.breakdown import FIELD_GROUPS, Breakdown

    listed = [name for _, names in FIELD_GROUPS for name in names]
    assert sorted(listed) == sorted(field.name for field in fields(Breakdown)) and len(listed) == len(set(listed))

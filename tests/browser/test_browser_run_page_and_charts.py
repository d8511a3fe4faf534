"""The Run page and the charts in a real browser (Debian's Chromium, Playwright) against the real
stack (tests/stack.py) with a real board running the real model: the Run page streams tokens
with the board's stage, elapsed time, Cancel and Ctrl+Enter; charts people can steer (time
range, pause, one colour per device, an empty state, each chart's data); MMLU answers that say
right or wrong; cache entries that say what they hold.
"""

from __future__ import annotations

import csv
import io
import json
import re
from decimal import Decimal

import pytest

from tests.stack import ADMIN_PASSWORD, SCREENSHOTS, browser, manage, shell, stack, stack_env, start_board  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.model, pytest.mark.cachebox]  # and browser, from the folder

BOARD = "steer-board"
LONG_WAIT = 90_000  # ms: a board's first answer


@pytest.fixture(scope="module")
def admin(stack, browser):
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.goto(stack["url"] + "/accounts/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page.locator("h1")).to_have_text("Dashboard")
    page.close()
    yield context
    context.close()


@pytest.fixture(scope="module")
def board(stack, admin):
    from playwright.sync_api import expect

    token = (
        shell(
            stack,
            "from dashboard import actions\n"
            f"device, token = actions.register_device(None, name={BOARD!r}, kind='test runner', cpu_threads=2, memory_mb=2048, link_bandwidth_mbps=None, link_rtt_ms=None)\n"
            "print(token)\n",
        )
        .strip()
        .splitlines()[-1]
    )
    start_board(stack, BOARD, token)
    page = admin.new_page()
    page.goto(stack["url"] + f"/devices/{BOARD}/")
    expect(page.locator('h1 [data-role="online"]')).to_have_text("online", timeout=LONG_WAIT)
    page.close()
    return BOARD


# Records, on the Run page, every stage a card went through and the text it showed while pending.
WATCH_CARDS = """
window.__cards = {};
new MutationObserver(function () {
  document.querySelectorAll('#answers .answer-card').forEach(function (card) {
    const seen = window.__cards[card.dataset.request] || (window.__cards[card.dataset.request] = {stages: [], pendingTexts: [], elapsed: []});
    if (seen.stages[seen.stages.length - 1] !== card.dataset.stage) seen.stages.push(card.dataset.stage);
    const streaming = card.querySelector('.answer.streaming');
    if (card.classList.contains('pending') && streaming && streaming.textContent) seen.pendingTexts.push(streaming.textContent);
    const elapsed = card.querySelector('[data-role="elapsed"]');
    if (elapsed && seen.elapsed[seen.elapsed.length - 1] !== elapsed.textContent) seen.elapsed.push(elapsed.textContent);
  });
}).observe(document.getElementById('answers'), {subtree: true, childList: true, characterData: true, attributes: true});
"""


def open_run_page(page, base: str, text: str, max_tokens: int):
    page.goto(base + "/run/")
    page.evaluate(WATCH_CARDS)
    page.check(f"#run-form label:has-text('{BOARD}') input[name=devices]")
    page.check("input[name=source][value=text]")
    page.fill("#id_text", text)
    page.fill("#id_max_tokens", str(max_tokens))


# -- charts: an empty state first (no run yet), then the first live run gives the axes back ------------
def test_an_empty_chart_says_so_and_the_first_live_run_draws_its_axes(stack, admin, board):
    from playwright.sync_api import expect

    home = admin.new_page()
    home.goto(stack["url"] + "/")
    home.wait_for_function("document.getElementById('chart-timeline').classList.contains('js-plotly-plot')")
    timeline = home.locator("#chart-timeline")
    expect(timeline).to_contain_text("No runs in this time range yet")
    assert home.evaluate("document.getElementById('chart-timeline').layout.yaxis.visible") is False
    expect(home.locator("#live-status")).to_have_text("live")

    page = admin.new_page()
    open_run_page(page, stack["url"], "The planets of the solar system are Mercury, Venus,", 24)
    page.keyboard.press("Control+Enter")  # from the text box: Ctrl+Enter sends
    expect(page.locator("#run-feedback")).to_have_text(f"sent to {BOARD}")
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)

    # The Run page streamed it: queued, on the board, decoding, with text growing before the record came.
    seen = page.evaluate("window.__cards[document.querySelector('#answers .answer-card').dataset.request]")
    # In order (an idle board may start before the page drew "queued"; a run that fetches nothing
    # skips "fetching"): this prompt is new, so the board prefills it.
    order = ["queued", "started", "fetching", "prefilling", "decoding", "finishing"]
    stages = seen["stages"]
    assert [order.index(stage) for stage in stages] == sorted({order.index(stage) for stage in stages}), stages
    # Events that come in one network read show only their last stage: "started" may be drawn over.
    assert "decoding" in stages and {"started", "prefilling"} & set(stages), stages
    final = card.locator(".answer").inner_text()
    assert seen["pendingTexts"] and all(text.strip() in final for text in seen["pendingTexts"])
    assert len(set(seen["pendingTexts"])) >= 2  # the text grew token by token
    assert len(seen["elapsed"]) >= 2 and all(re.fullmatch(r"\d+\.\d s", e) for e in seen["elapsed"])
    expect(card).to_contain_text(re.compile(r"between tokens p50 \d+\.\d ms, p99 \d+\.\d ms"))
    expect(card.locator(".prompt-title")).to_contain_text("answers: The planets of the solar system")
    page.close()

    # The dashboard drew it live: the axes are back, and the time between tokens sits beside TTFT.
    expect(timeline).not_to_contain_text("No runs in this time range yet")
    assert home.evaluate("document.getElementById('chart-timeline').layout.yaxis.visible") is True
    tbt = home.evaluate("document.getElementById('chart-tbt').data.map((t) => [t.name, t.y.length])")
    assert [f"{BOARD} TBT p50", 1] in tbt and [f"{BOARD} TBT p99", 1] in tbt
    # The hit ratio by tier: the live run moved each of the board's tier lines, to what the server draws.
    lines = f"(d) => Object.fromEntries(d.filter((t) => t.name.startsWith('{BOARD} ')).map((t) => [t.name, t.y]))"
    live = home.evaluate(f"({lines})(document.getElementById('chart-hits').data)")
    assert set(live) == {f"{BOARD} context", f"{BOARD} RAM tier", f"{BOARD} flash tier", f"{BOARD} cache box"} and all(
        len(y) == 1 for y in live.values()
    ), live
    served = home.evaluate(f"fetch('/charts.json?range=24h').then((r) => r.json()).then((d) => ({lines})(d.hits.data))")
    assert served == live
    # The same prompt again: the board still holds it in its context, a hit of the context tier.
    page = admin.new_page()
    open_run_page(page, stack["url"], "The planets of the solar system are Mercury, Venus,", 4)
    page.click("#run-submit")
    expect(page.locator("#answers .answer-card").first).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    page.close()
    home.wait_for_function(
        f"document.getElementById('chart-hits').data.find((t) => t.name === '{BOARD} context').y.length === 2"
    )
    live = home.evaluate(f"({lines})(document.getElementById('chart-hits').data)")
    served = home.evaluate(f"fetch('/charts.json?range=24h').then((r) => r.json()).then((d) => ({lines})(d.hits.data))")
    assert live[f"{BOARD} context"] == [0, 0.5] and live[f"{BOARD} cache box"] == [0, 0] and served == live
    home.close()


# -- the Run page: Cancel stops a run mid-answer ----------------------------------------------------------
def test_cancel_stops_a_streaming_run(stack, admin, board):
    from playwright.sync_api import expect

    page = admin.new_page()
    open_run_page(page, stack["url"], "Count from one to five hundred in words: one, two, three, four,", 256)
    page.click("#run-submit")
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_attribute("data-stage", "decoding", timeout=LONG_WAIT)
    expect(card.locator('[data-role="stage"]')).to_have_text("decoding: tokens as they are chosen")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "run-streaming.png"), full_page=True)
    card.locator(".cancel-run").click()
    expect(card).to_have_class(re.compile(r"\bcancelled\b"), timeout=30_000)
    expect(card.locator(".badge.cancelled")).to_have_text("cancelled")
    expect(card.locator(".answer")).to_contain_text(re.compile(r"\w"))  # what was streamed stays
    run_id = re.search(r"run #(\d+)", card.inner_text()).group(1)
    generated = json.loads(
        shell(
            stack,
            f"import json; from dashboard.models import InferenceRun; print(json.dumps(InferenceRun.objects.get(pk={run_id}).breakdown))",
        )
        .strip()
        .splitlines()[-1]
    )
    assert 0 < generated["generated_tokens"] < 256
    page.close()


# -- charts people can steer: time range, pause, colours, data ----------------------------------------------
def test_charts_have_a_time_range_pause_one_colour_per_device_and_their_data(stack, admin, board):
    from playwright.sync_api import expect

    home = admin.new_page()
    home.goto(stack["url"] + "/")
    home.wait_for_function("document.getElementById('chart-tbt').classList.contains('js-plotly-plot')")
    expect(home.locator("#live-status")).to_have_text("live")

    # One colour per device on every chart.
    colors = home.evaluate(
        "['chart-timeline', 'chart-tbt', 'chart-hits', 'chart-bytes'].map((id) => document.getElementById(id).data"
        f".filter((t) => t.name.startsWith('{BOARD}')).map((t) => (t.line && t.line.color) || (t.marker && t.marker.color)))"
    )
    flat = {color for chart in colors for color in chart}
    assert len(flat) == 1 and all(chart for chart in colors), colors

    # A time range from the server: the address keeps it, the status says how many runs it holds.
    home.click('[data-range="15m"]')
    expect(home.locator('[data-range="15m"]')).to_have_attribute("aria-pressed", "true")
    expect(home.locator("#chart-status")).to_have_text(re.compile(r"^\d+ runs?( \(.*\))? in the last 15 min"))
    assert home.url.endswith("range=15m")

    def count() -> int:
        return home.evaluate(
            f"document.getElementById('chart-timeline').data.find((t) => t.name === '{BOARD} TTFT').x.length"
        )

    before = count()
    assert before >= 1

    # Paused, a new run is counted but not drawn; resumed, it is there.
    home.click("#chart-pause")
    expect(home.locator("#chart-pause")).to_have_text("Resume")
    other = admin.new_page()
    open_run_page(other, stack["url"], "Pause test: the colours of the rainbow are red, orange,", 3)
    other.click("#run-submit")
    expect(other.locator("#answers .answer-card").first).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    expect(home.locator("#chart-status")).to_have_text("paused: 1 new run not drawn yet")
    assert count() == before
    home.click("#chart-pause")
    expect(home.locator("#chart-status")).to_have_text(re.compile(r"^\d+ runs?( \(.*\))? in the last 15 min"))
    assert count() == before + 1
    other.close()

    # Each chart's data, as CSV and JSON: the points it draws.
    with home.expect_download() as download:
        home.click("#chart-timeline-csv")
    rows = list(csv.DictReader(io.StringIO(open(download.value.path(), encoding="utf-8").read())))
    assert download.value.suggested_filename == "edgecache-ttft-ttlt-15m.csv"
    mine = [row for row in rows if row["series"] == f"{BOARD} TTFT"]
    assert len(mine) == before + 1 and all(float(row["y"]) > 0 for row in mine)
    with home.expect_download() as download:
        home.click("#chart-tbt-json")
    document = json.loads(open(download.value.path(), encoding="utf-8").read())
    assert document["chart"] == "time-between-tokens" and document["range"] == "15m"
    assert {point["series"] for point in document["points"]} >= {f"{BOARD} TBT p50", f"{BOARD} TBT p99"}
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    home.screenshot(path=str(SCREENSHOTS / "dashboard-steer.png"), full_page=True)
    home.close()


# -- numbers that add up, live (issue 42, item 5) ------------------------------------------------------------------
def test_live_runs_are_summed_and_counted_as_the_server_says(stack, admin, board):
    """An answer card shows TTFT and TTLT as the sums of their parts, as the server words them; the
    dashboard's counts move live as runs arrive (a cancelled one too, its TTFT shown) and say what a
    reload says."""
    from playwright.sync_api import expect

    home = admin.new_page()
    home.goto(stack["url"] + "/?range=24h")
    home.wait_for_function("document.getElementById('chart-breakdown').classList.contains('js-plotly-plot')")
    expect(home.locator("#live-status")).to_have_text("live")
    bars = home.evaluate("document.getElementById('chart-breakdown').data.map((t) => t.name)")
    assert bars == ["Token", "Bloom", "P-decode", "Redis", "R-decode", "Sample", "other"]
    before = home.evaluate("document.getElementById('chart-breakdown').data[0].x.length")

    page = admin.new_page()
    open_run_page(page, stack["url"], "Sums test: the seasons of the year are spring, summer,", 6)
    page.click("#run-submit")
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    run_id = re.search(r"run #(\d+)", card.inner_text()).group(1)
    served = json.loads(
        shell(
            stack,
            f"import json; from dashboard.models import InferenceRun; from dashboard.actions import run_json; print(json.dumps(run_json(InferenceRun.objects.get(pk={run_id}))['time_sums']))",
        )
        .strip()
        .splitlines()[-1]
    )
    for which in ("ttft", "ttlt"):
        line = card.locator(f'.time-sum[data-sum="{which}"]')
        expect(line).to_have_text(served[which]["sentence"] + " (ms)")
        whole, parts = re.match(r"^TT[FL]T ([\d.]+) ms = (.*) \(ms\)$", line.inner_text()).groups()
        assert sum(Decimal(n) for n in re.findall(r"-?\d+\.\d", parts)) == Decimal(whole)
    # The dashboard stacked it live: the bar is the run's TTLT, part by part.
    home.wait_for_function(f"document.getElementById('chart-breakdown').data[0].x.length === {before + 1}")
    stacked = home.evaluate("document.getElementById('chart-breakdown').data.map((t) => t.y[t.y.length - 1])")
    assert stacked == [part["ms"] for part in served["ttlt"]["parts"]]

    # A cancelled run: counted as cancelled, live, and its TTFT shown in the runs table.
    open_run_page(page, stack["url"], "Count from one to three hundred in words: one, two, three,", 200)
    page.click("#run-submit")
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_attribute("data-stage", "decoding", timeout=LONG_WAIT)
    card.locator(".cancel-run").click()
    expect(card).to_have_class(re.compile(r"\bcancelled\b"), timeout=30_000)
    expect(card.locator(".cancelled-note")).to_contain_text(re.compile(r"TTFT \d+\.\d ms"))
    request = card.get_attribute("data-request")
    row = home.locator(f'#runs-body tr[data-request="{request}"]')
    expect(row).to_have_class("cancelled")
    expect(row.locator("td").nth(6)).to_have_text(re.compile(r"^\d+\.\d$"))  # TTFT, measured
    expect(home.locator("#chart-status")).to_contain_text("cancelled")
    live_status = home.locator("#chart-status").inner_text()
    live_card = home.locator(f'#device-cards [data-device="{BOARD}"] [data-role="runs"]').inner_text()
    page.close()
    home.reload()
    expect(home.locator("#chart-status")).to_have_text(live_status)  # the live words are the server's
    expect(home.locator(f'#device-cards [data-device="{BOARD}"] [data-role="runs"]')).to_have_text(live_card)
    assert re.search(r"\(.*\d+ cancelled\)", live_card), live_card
    home.close()


# -- answers that explain themselves: an MMLU answer says right or wrong ----------------------------------------
def test_an_mmlu_answer_says_right_or_wrong(stack, admin, board):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/run/")
    page.check(f"#run-form label:has-text('{BOARD}') input[name=devices]")
    page.check("input[name=source][value=mmlu]")
    page.fill("#id_shots", "1")
    page.fill("#id_question", "2")
    page.fill("#id_max_tokens", "2")
    page.click("#run-submit")
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    verdict = card.locator(".verdict")
    expect(verdict).to_have_text(
        re.compile(
            r"^(right: answered [ABCD]|wrong: answered [ABCD], the answer is [ABCD]|no answer letter in the reply: the answer is [ABCD])$"
        )
    )
    expect(card.locator(".prompt-title")).to_contain_text("answers: MMLU")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "run-streamed.png"), full_page=True)
    page.close()


# -- cache entries people can read ------------------------------------------------------------------------------
def test_cache_entries_say_what_they_hold(stack, admin, board):
    from playwright.sync_api import expect

    page = admin.new_page()
    context_text = (
        "Lighthouse keepers' log. "
        + "The lamp was trimmed at dusk and the fog bell rang twice every minute until dawn. " * 12
    )
    open_run_page(page, stack["url"], context_text + "Question: when was the lamp trimmed?", 2)
    page.click("#run-submit")
    expect(page.locator("#answers .answer-card").first).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    page.goto(stack["url"] + "/cache/")
    holds = page.locator("#cache-entries td.holds", has_text="Lighthouse keepers")
    expect(holds.first).to_be_visible()
    expect(page.locator("#cache-entries td.size").first).to_have_text(re.compile(r"^\d+\.\d (kB|MB|GB)$"))

    page.goto(stack["url"] + "/admin/dashboard/cacheentry/")
    expect(page.locator("#result_list")).to_contain_text("Lighthouse keepers")
    page.locator("#result_list tbody tr", has_text="Lighthouse keepers").first.locator("input.action-select").check()
    page.select_option("select[name=action]", "unpin")
    page.click("button[name=index]")
    expect(page.locator("#confirm-explanation")).to_contain_text("Unpinning deletes nothing")
    expect(page.locator("#content")).not_to_contain_text("cannot be undone")
    expect(page.locator("#content li").first).to_contain_text("Lighthouse keepers")
    page.goto(stack["url"] + "/cache/")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "cache-entries.png"), full_page=True)
    page.close()

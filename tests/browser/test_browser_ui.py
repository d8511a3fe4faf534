"""The dashboard as an operator's tool (issue 14), in a real browser: Debian's Chromium driven by
Playwright against the real stack (tests/stack.py) and a real board running the real model.

Each test names the item of the issue it checks; each fails on the dashboard before the issue.
"""

from __future__ import annotations

import csv
import io
import json
import re

import pytest

from tests.conftest import ROOT
from tests.stack import ADMIN_PASSWORD, SCREENSHOTS, browser, log_in, manage, shell, stack, start_board  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.model, pytest.mark.cachebox]  # and browser, from the folder

BOARD = "ui-board"
RUN_RATE = 10  # the stack's EDGECACHE_RUN_RATE (per user and minute)
LONG_WAIT = 90_000  # ms: a board's first answer, an encode


@pytest.fixture(scope="module")
def stack_env():
    return {"EDGECACHE_RUN_RATE": str(RUN_RATE)}


@pytest.fixture(scope="module")
def admin(stack, browser):
    context = log_in(browser, stack["url"], "admin", ADMIN_PASSWORD)
    yield context
    context.close()


@pytest.fixture(scope="module")
def devices(stack, admin):
    """A real board (online), a device never started ("ghost") and one last seen two hours ago
    ("sleeper", with a catalog from an older epoch in its last heartbeat)."""
    from playwright.sync_api import expect

    token = (
        shell(
            stack,
            "from dashboard import actions\n"
            f"device, token = actions.register_device(None, name={BOARD!r}, kind='test runner', cpu_threads=2, memory_mb=2048, link_bandwidth_mbps=None, link_rtt_ms=None)\n"
            "print(token)\n"
            "for name in ('ghost', 'sleeper'):\n"
            "    actions.register_device(None, name=name, kind='', cpu_threads=1, memory_mb=512, link_bandwidth_mbps=None, link_rtt_ms=None)\n"
            "from datetime import timedelta\n"
            "from django.utils import timezone\n"
            "from dashboard.models import Device\n"
            "Device.objects.filter(name='sleeper').update(last_seen=timezone.now() - timedelta(hours=2), status={'catalogs': {'default': "
            "{'approx_items': 3, 'size_bytes': 1198132, 'fill_ratio': 0.00002, 'estimated_fp_rate': 0.0, 'configured_fp_rate': 0.01, "
            "'last_sync': None, 'epoch': '0ld0ld0ld0ld0ld0ld0ld0ld0ld0ld0l', 'false_positives': 0}}})\n",
        )
        .strip()
        .splitlines()[-1]
    )
    start_board(stack, BOARD, token)
    page = admin.new_page()
    page.goto(stack["url"] + f"/devices/{BOARD}/")
    expect(page.locator('h1 [data-role="online"]')).to_have_text("online", timeout=LONG_WAIT)
    page.close()
    return {"board": BOARD}


def send_text(page, base: str, device: str, text: str, max_tokens: int = 2):
    """Send a free-text prompt from the Run page (no offline warning: ``device`` is online)."""
    page.goto(base + "/run/")
    page.check(f"#run-form label:has-text('{device}') input[name=devices]")
    page.check("input[name=source][value=text]")
    page.fill("#id_text", text)
    page.fill("#id_max_tokens", str(max_tokens))
    page.click("#run-submit")


# -- 3. the live badge on every page ------------------------------------------------------------
def test_every_page_is_live(stack, admin, devices):
    from playwright.sync_api import expect

    page = admin.new_page()
    for path in (
        "/devices/register/",
        "/devices/ghost/rotate/",
        "/cache/",
        "/benchmarks/",
        "/schemas/",
        "/devices/",
        "/runs/",
        "/queue/",
    ):
        page.goto(stack["url"] + path)
        expect(page.locator("#live-status"), f"{path} is not live").to_have_text("live")
    page.close()


# -- 9. the register form: help text, presets on screen, a name too long ------------------------------
def test_register_form_fills_presets_and_refuses_a_long_name_with_a_word(stack, admin):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/devices/register/")
    expect(page.locator("main form")).to_contain_text("the board's queue is device.<name>")
    page.select_option("#id_link_preset", "wifi4")
    expect(page.locator("#id_link_bandwidth_mbps")).to_have_value("20.9")
    expect(page.locator("#id_link_rtt_ms")).to_have_value("4")
    page.select_option("#id_link_preset", "none")
    expect(page.locator("#id_link_bandwidth_mbps")).to_have_value("")
    page.select_option("#id_link_preset", "gigabit")
    expect(page.locator("#id_link_bandwidth_mbps")).to_have_value("940")

    long_name = "a-board-with-a-name-far-longer-than-forty-characters-0123456"
    assert len(long_name) == 60
    page.click("#id_name")
    page.keyboard.insert_text(long_name)  # as typed or pasted: nothing cut silently
    assert page.input_value("#id_name") == long_name
    expect(page.locator("#id_name-count")).to_contain_text("too long")
    page.fill("#id_cpu_threads", "1")
    page.click("#register-submit")
    expect(page.locator("main form")).to_contain_text("A device name has at most 40 characters; this one has 60")
    assert page.input_value("#id_name") == long_name

    # Shortened, it registers; the page that shows the token once is live too.
    page.fill("#id_name", "short-name")
    page.select_option("#id_link_preset", "wifi4")
    page.click("#register-submit")
    expect(page.locator("#device-token")).to_be_visible()
    expect(page.locator("#live-status")).to_have_text("live")
    assert "20.9 Mbit/s" in shell(
        stack, "from dashboard.models import Device; print(Device.objects.get(name='short-name').link_label)"
    )
    page.close()


# -- 4. board status on the Run page, a warning before sending to a board that is not running ------
def test_run_page_shows_each_board_status_and_warns_before_sending_to_an_absent_one(stack, admin, devices):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/run/")
    expect(page.locator(f'[data-device="{BOARD}"] [data-role="online"]')).to_have_text("online")
    expect(page.locator('[data-device="ghost"] [data-role="online"]')).to_have_text("never started")
    expect(page.locator('[data-device="sleeper"] [data-role="online"]')).to_contain_text(
        re.compile(r"offline since \d{4}-\d\d-\d\d \d\d:\d\d")
    )

    page.evaluate("document.getElementById('answers').dataset.hintAfter = '1'")
    page.check("#run-form label:has-text('ghost') input[name=devices]")
    page.check("input[name=source][value=text]")
    page.fill("#id_text", "Is anybody there?")
    with page.expect_response(lambda r: r.url.endswith("/run/") and r.request.method == "POST") as sent:
        page.click("#run-submit")
        warning = page.locator("#run-offline-warning")
        expect(warning).to_be_visible()
        expect(warning).to_contain_text("ghost (never started)")
        expect(warning).to_contain_text(
            re.compile(r"REDIS_URL=redis://\S+ \.venv-board/bin/edgecache-board --name ghost")
        )  # staff: with the address
        assert page.locator("#answers .answer-card").count() == 0  # nothing sent yet
        page.click("#run-send-anyway")
    assert sent.value.ok
    card = page.locator('#answers .answer-card[data-device="ghost"]')
    expect(card).to_contain_text("waiting for the board")
    expect(card.locator(".hint")).to_contain_text(
        "no answer after 1 s: is the board running? Start it on the board with"
    )
    expect(card.locator(".hint code")).to_contain_text(".venv-board/bin/edgecache-board --name ghost")
    expect(card).to_have_class(re.compile(r"\bpending\b"))
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "run-offline.png"), full_page=True)
    page.close()


# -- 10. the rate limit counts only the valid submissions that are sent ---------------------------------
def test_rejected_submissions_do_not_use_up_the_rate_limit(stack, browser, devices):
    from playwright.sync_api import expect

    shell(
        stack,
        "from django.contrib.auth import get_user_model; get_user_model().objects.create_user('clicker', password='clicker-pw-12345', is_staff=True)",
    )
    context = log_in(browser, stack["url"], "clicker", "clicker-pw-12345")
    page = context.new_page()
    page.goto(stack["url"] + "/run/")
    page.check("input[name=source][value=text]")  # the page opens on Chat
    feedback = page.locator("#run-feedback")
    for _ in range(RUN_RATE + 2):  # empty clicks: each is refused by the form
        with page.expect_response(lambda r: r.url.endswith("/run/") and r.request.method == "POST") as answer:
            page.click("#run-submit")
        assert answer.value.status == 400
        expect(feedback).to_contain_text("Write a prompt")
    page.check(f"#run-form label:has-text('{BOARD}') input[name=devices]")
    page.fill("#id_text", "Count me once:")
    page.fill("#id_max_tokens", "1")
    page.click("#run-submit")
    expect(feedback).to_have_text(f"sent to {BOARD}")
    expect(page.locator("#answers .answer-card")).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    context.close()


# -- 5. a prompt longer than the limit: refused with a word, never cut -------------------------------
def test_an_overlong_prompt_is_refused_not_cut(stack, admin, devices):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/run/")
    page.check(f"#run-form label:has-text('{BOARD}') input[name=devices]")
    pasted = ("All work and no play makes a long prompt. " * 2400)[:100_000]
    page.check("input[name=source][value=text]")
    page.click("#id_text")
    page.keyboard.insert_text(pasted)  # a paste: the text box keeps all of it
    assert page.evaluate("document.getElementById('id_text').value.length") == 100_000
    expect(page.locator("#id_text-count")).to_contain_text("100,000 / 32,000 characters: too long")
    with page.expect_response(lambda r: r.url.endswith("/run/") and r.request.method == "POST") as answer:
        page.click("#run-submit")
    assert answer.value.status == 400
    expect(page.locator("#run-feedback")).to_contain_text(
        "The prompt has 100,000 characters; at most 32,000 are accepted"
    )
    assert page.locator("#answers .answer-card").count() == 0
    page.close()


# -- 5 and 2. the board's context error in the page's words; failed runs stay listed --------------------
def test_a_context_error_is_explained_and_the_failed_run_stays_listed(stack, admin, devices):
    from playwright.sync_api import expect

    page = admin.new_page()
    send_text(
        page, stack["url"], BOARD, "word " * 3000, max_tokens=4
    )  # about 3,000 tokens: more than the 2,048 the board holds
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_class(re.compile(r"\bfailed\b"), timeout=LONG_WAIT)
    expect(card).to_contain_text(
        re.compile(
            r"The prompt has [\d,]+ tokens and 4 more were asked for, but the board's context holds 2,048: shorten it or ask for fewer tokens\."
        )
    )
    expect(card).not_to_contain_text("EDGECACHE_N_CTX")
    for path in ("/run/", "/", f"/devices/{BOARD}/"):
        page.goto(stack["url"] + path)
        failed = page.locator("#runs-body tr.failed")
        expect(failed.first, f"no failed run listed on {path}").to_contain_text("shorten it or ask for fewer tokens")
    page.close()


# -- 1. device cards follow the runs live -----------------------------------------------------------------
def test_device_cards_update_live(stack, admin, devices):
    from playwright.sync_api import expect

    home = admin.new_page()
    home.goto(stack["url"] + "/")
    expect(home.locator("#live-status")).to_have_text("live")
    home.evaluate("window.__notReloaded = true")
    card = home.locator(f'.device-card[data-device="{BOARD}"]')
    runs = int(
        re.search(r"(\d+) runs?(?: \([^)]*\))? · hit ratio", card.inner_text()).group(1)
    )  # failed and cancelled ones said in brackets
    counted = int(re.match(r"(\d+) runs?", home.locator("#chart-status").inner_text()).group(1))
    other = admin.new_page()
    send_text(other, stack["url"], BOARD, "The three primary colors are red, yellow and")
    expect(card).to_contain_text(
        re.compile(rf"\b{runs + 1} runs?(?: \([^)]*\))? · hit ratio \d\.\d\d · median TTFT \d+ ms"), timeout=LONG_WAIT
    )
    # B2 (issue 28): the count beside Pause follows the runs as they arrive (counted as the cards count them).
    expect(home.locator("#chart-status")).to_have_text(
        re.compile(rf"^{counted + 1} runs?( \([^)]*\))? in the last 24 h")
    )
    assert home.evaluate("window.__notReloaded") is True
    other.close()
    home.close()


# -- 7 and 6. encoding: old errors cleared, "n/n done" at once; a PML prompt names its schema ---------------
def test_encode_progress_and_a_schema_prompt_without_choosing_the_schema(stack, admin, devices):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/schemas/new/")
    page.fill("#id_source", (ROOT / "examples" / "travel.pml").read_text())
    page.click("#schema-save")
    expect(page.locator("h1")).to_contain_text("Schema travel")
    page.wait_for_load_state("load")  # the page's script sends the form from now on

    page.click("#encode-submit")  # no board chosen: an error
    errors = page.get_by_text(re.compile(r"Devices: .*required"))  # the field's label, as the page shows it
    expect(errors).to_be_visible()
    page.check(f"#encode-form label:has-text('{BOARD}') input[name=devices]")
    page.click("#encode-submit")
    expect(errors).to_be_hidden()
    bar = page.locator(".encode-bar").first
    expect(bar).to_contain_text("6/6 done", timeout=LONG_WAIT)
    expect(page.locator(".encode-bar.done")).to_contain_text("6 stored", timeout=LONG_WAIT)

    # Everything is cached now: a second encode says "6/6 done" as soon as the board has looked.
    page.reload()
    page.wait_for_load_state("load")
    page.check(f"#encode-form label:has-text('{BOARD}') input[name=devices]")
    page.click("#encode-submit")
    expect(page.locator(".encode-bar").first).to_contain_text("6/6 done", timeout=15_000)
    expect(page.locator(".encode-bar.done")).to_contain_text("6 already cached", timeout=LONG_WAIT)

    page.goto(stack["url"] + "/run/")
    page.check(f"#run-form label:has-text('{BOARD}') input[name=devices]")
    page.check("input[name=source][value=pml]")
    assert page.input_value("#id_schema") == ""  # left as it is: the prompt names its schema
    page.fill(
        "#id_pml", '<prompt schema="travel"><trip-plan duration="3 days"/><miami/><user>Where to surf?</user></prompt>'
    )
    page.fill("#id_max_tokens", "2")
    page.click("#run-submit")
    answer = page.locator("#answers .answer-card").first
    expect(answer).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    expect(answer.locator(".matched")).to_contain_text(re.compile(r"matched (\d+) of (\d+) prompt tokens"))
    matched, total = map(int, re.search(r"matched (\d+) of (\d+)", answer.locator(".matched").inner_text()).groups())
    assert 0 < matched < total

    # A schema no one saved: a clear error, nothing sent.
    page.fill("#id_pml", '<prompt schema="nowhere"><user>Hi</user></prompt>')
    page.click("#run-submit")
    expect(page.locator("#run-feedback")).to_contain_text(
        "The prompt names schema 'nowhere', which is not known (known: travel)"
    )
    page.close()


# -- 8. the Cache page's catalogs: epochs, fill as a percentage, stale boards --------------------------
def test_cache_page_shows_epochs_fill_and_stale_boards(stack, admin, devices):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/cache/")
    master = page.locator('#master-catalogs tr[data-namespace="default"]')
    epoch = master.locator("td.epoch code").get_attribute("title")
    assert epoch and re.fullmatch(r"[0-9a-f]{32}", epoch)
    board = page.locator(f'#board-catalogs tr[data-device="{BOARD}"][data-namespace="default"]')
    expect(board.locator("td.epoch code")).to_have_attribute("title", epoch)
    expect(board).not_to_contain_text("stale")
    expect(board.locator("td").nth(3)).to_have_text(re.compile(r"^(< 0\.01%|\d+(\.\d+)?%)$"))
    sleeper = page.locator('#board-catalogs tr[data-device="sleeper"]')
    expect(sleeper).to_contain_text("stale until the board's next sync")
    expect(sleeper.locator("td").nth(3)).to_have_text("< 0.01%")

    # A flush: the board drops its filter at its next sync and reports the new epoch.
    page.select_option("#flush-form #id_namespace", "default")
    page.check("#flush-form #id_confirm")
    page.click("#flush-form button")
    expect(page.locator(".messages")).to_contain_text("Deleted")
    for _ in range(30):
        page.reload()
        fresh = page.locator('#master-catalogs tr[data-namespace="default"] td.epoch code')
        if fresh.count() and fresh.get_attribute("title") != epoch and "stale" not in board.inner_text():
            break
        page.wait_for_timeout(1000)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "cache.png"), full_page=True)
    new_epoch = page.locator('#master-catalogs tr[data-namespace="default"] td.epoch code').get_attribute("title")
    assert new_epoch != epoch
    expect(board.locator("td.epoch code")).to_have_attribute("title", new_epoch)
    expect(board.locator("td").nth(2)).to_have_text("0")
    page.close()


# -- 12. the Runs page, a run's page, exports; scoped to the user's namespaces ------------------------------
def test_runs_page_filters_run_page_and_exports(stack, browser, admin, devices):
    from playwright.sync_api import expect

    base = stack["url"]
    page = admin.new_page()
    page.goto(base + "/runs/")
    assert page.locator("#runs-table tbody tr[data-run]").count() >= 4
    page.select_option("#id_error", "yes")
    page.click("#runs-apply")
    rows = page.locator("#runs-table tbody tr[data-run]")
    expect(rows.first).to_contain_text("shorten it or ask for fewer tokens")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "runs.png"), full_page=True)
    assert rows.count() == page.locator("#runs-table tbody tr.failed").count()

    page.goto(base + f"/runs/?device={BOARD}&q=primary+colors&error=no")
    rows = page.locator("#runs-table tbody tr[data-run]")
    expect(rows).to_have_count(1)
    csv_url = page.locator("#export-csv").get_attribute("href")
    json_url = page.locator("#export-json").get_attribute("href")
    rows.first.locator("a").first.click()
    expect(page.locator("#run-prompt")).to_contain_text("The three primary colors are red, yellow and")
    breakdown = page.locator("#run-breakdown")
    for field in ("ttft_ms", "prefill_ms", "prompt_tokens", "matched_tokens", "decision", "cachebox", "link"):
        expect(breakdown).to_contain_text(field)
    page.click("#run-again")
    expect(page.locator("#run-again-note")).to_be_visible()
    assert page.input_value("#id_text") == "The three primary colors are red, yellow and"
    assert page.is_checked(f'[data-device="{BOARD}"] input[name=devices]')

    exported = page.request.get(base + csv_url)
    assert exported.ok and exported.headers["content-type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(exported.text())))
    assert len(table) == 1 and table[0]["device"] == BOARD and table[0]["prompt"].startswith("The three primary colors")
    document = json.loads(page.request.get(base + json_url).text())
    assert document["count"] == 1 and document["runs"][0]["answer"] == table[0]["answer"]
    run_id = document["runs"][0]["id"]
    page.close()

    # A user of no namespace sees no run, and another tenant's run is a 404.
    shell(
        stack,
        "from django.contrib.auth import get_user_model; get_user_model().objects.create_user('outsider', password='outsider-pw-12345')",
    )
    context = log_in(browser, base, "outsider", "outsider-pw-12345")
    page = context.new_page()
    page.goto(base + "/runs/")
    expect(page.locator("#runs-table tbody")).to_contain_text("No run matches.")
    assert page.goto(base + f"/runs/{run_id}/").status == 404
    assert page.request.get(base + "/runs/export.csv").text().strip().count("\n") == 0  # the header only
    assert page.locator("#nav-metrics").count() == 0  # not staff: no metrics link
    context.close()


def test_favicon_dark_theme_and_metrics_link(stack, browser, admin):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/")
    icon = page.locator('link[rel="icon"]').get_attribute("href")
    assert page.request.get(stack["url"] + icon).headers["content-type"].startswith("image/svg")
    assert page.request.get(stack["url"] + "/favicon.ico").ok
    expect(page.locator("#nav-metrics")).to_have_attribute("href", "/metrics")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(243, 244, 247)"
    page.close()
    dark = browser.new_context(storage_state=admin.storage_state(), color_scheme="dark")
    page = dark.new_page()
    page.goto(stack["url"] + "/")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(18, 21, 28)"
    page.wait_for_function("document.getElementById('chart-breakdown').classList.contains('js-plotly-plot')")
    page.screenshot(path=str(SCREENSHOTS / "dark-dashboard.png"), full_page=True)
    dark.close()


# -- 11. a phone's screen: no sideways scrolling, a menu, chart titles clear of the toolbar ------------
def test_pages_fit_a_phone_screen(stack, browser, admin, devices):
    from playwright.sync_api import expect

    base = stack["url"]
    schema_id = shell(stack, "from dashboard.models import Schema; print(Schema.objects.get(name='travel').pk)").strip()
    run_id = shell(
        stack,
        "from dashboard.models import InferenceRun; print(getattr(InferenceRun.objects.order_by('-pk').first(), 'pk', ''))",
    ).strip()
    phone = browser.new_context(storage_state=admin.storage_state(), viewport={"width": 390, "height": 844})
    page = phone.new_page()
    pages = [
        "/",
        "/devices/",
        f"/devices/{BOARD}/",
        "/run/",
        "/runs/",
        f"/runs/{run_id}/",
        "/schemas/",
        f"/schemas/{schema_id}/",
        "/cache/",
        "/benchmarks/",
        "/devices/register/",
        "/queue/",
    ]
    assert run_id and schema_id
    for path in pages:
        page.goto(base + path)
        if page.locator(".chart").count():
            page.wait_for_function(
                "Array.from(document.querySelectorAll('.chart')).every((c) => c.classList.contains('js-plotly-plot'))"
            )
        width = page.evaluate("document.scrollingElement.scrollWidth")
        assert width <= 390, f"{path} is {width} px wide at 390 px"
        if path in ("/", "/run/", "/cache/", "/queue/"):
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / f"phone-{path.strip('/') or 'dashboard'}.png"), full_page=True)

    # The navigation is a menu: Cache, Admin and Log out are reachable on screen.
    page.goto(base + "/")
    cache_link = page.locator("#site-nav a", has_text="Cache")
    expect(cache_link).to_be_hidden()
    page.click("#nav-toggle")
    for item in (cache_link, page.locator("#site-nav a", has_text="Admin"), page.locator("#logout")):
        expect(item).to_be_visible()
        box = item.bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390
    page.click("#nav-toggle")

    # Chart titles stay clear of the toolbar (shown on hover, over the top right).
    page.wait_for_function("document.getElementById('chart-breakdown').classList.contains('js-plotly-plot')")
    for chart in ("chart-breakdown", "chart-timeline", "chart-hits", "chart-bytes"):
        node = page.locator(f"#{chart}")
        node.scroll_into_view_if_needed()
        node.hover()
        modebar = node.locator(".modebar").bounding_box()
        title = node.locator(".gtitle").bounding_box()
        chart_box = node.bounding_box()
        assert modebar and title and chart_box
        assert (
            title["x"] >= chart_box["x"] and title["x"] + title["width"] <= chart_box["x"] + chart_box["width"] + 1
        ), f"the title of {chart} is cut"
        overlap = not (
            title["x"] + title["width"] <= modebar["x"]
            or modebar["x"] + modebar["width"] <= title["x"]
            or title["y"] + title["height"] <= modebar["y"]
            or modebar["y"] + modebar["height"] <= title["y"]
        )
        assert not overlap, f"the toolbar covers the title of {chart}"
    phone.close()


# The tests of issue 28 come last: they leave a failed (revoked) run and a dead board behind.
# -- issue 28, B1: a board that dies goes offline on every open page, without a reload -----------------
def test_a_board_that_dies_goes_offline_on_every_open_page(stack, admin, devices):
    import signal

    from playwright.sync_api import expect

    name = "doomed"
    token = (
        shell(
            stack,
            "from dashboard import actions\n"
            f"device, token = actions.register_device(None, name={name!r}, kind='test runner', cpu_threads=1, memory_mb=1024, link_bandwidth_mbps=None, link_rtt_ms=None)\n"
            "print(token)\n",
        )
        .strip()
        .splitlines()[-1]
    )
    board = start_board(
        stack, name, token
    )  # 1 s heartbeats: offline after 4 s (3 missed + 1), told at the next sweep (5 s)
    badges = {
        f"/devices/{name}/": 'h1 [data-role="online"]',
        "/": f'.device-card[data-device="{name}"] [data-role="online"]',
        "/devices/": f'tr[data-device="{name}"] [data-role="online"]',
        "/run/": f'label[data-device="{name}"] [data-role="online"]',
    }
    pages = {}
    for path, badge in badges.items():
        page = pages[path] = admin.new_page()
        page.goto(stack["url"] + path)
        expect(page.locator(badge)).to_have_text("online", timeout=LONG_WAIT)  # the first waits for the board to start
        page.evaluate("window.__notReloaded = true")
    board.send_signal(signal.SIGKILL)
    board.wait(timeout=10)
    for path, badge in badges.items():
        expect(pages[path].locator(badge)).to_have_text(
            re.compile(r"^offline since \d{4}-\d\d-\d\d \d\d:\d\d$"), timeout=20_000
        )
        assert pages[path].evaluate("window.__notReloaded") is True, path
    assert pages["/run/"].locator(f'label[data-device="{name}"]').get_attribute("data-status") == "offline"
    for page in pages.values():
        page.close()
    shell(
        stack, f"from dashboard.models import Device; Device.objects.filter(name={name!r}).delete()"
    )  # the tests after see the boards they made


# -- issue 28, B6: an answer served from the board's context says so, not "from the cache box" -------
def test_an_answer_from_the_boards_context_says_so(stack, admin, devices):
    from playwright.sync_api import expect

    page = admin.new_page()
    text = "Where an answer came from: the board keeps this prompt in its context for the next run."
    for _ in range(2):
        send_text(page, stack["url"], BOARD, text)
        card = page.locator("#answers .answer-card").first
        expect(card).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    expect(card).to_contain_text(re.compile(r"full: (\d+)/\1 prompt tokens from the board's own context"))
    assert "from the cache box" not in card.inner_text()
    page.close()


# -- issue 28, the queue: what waits shows up live, and Revoke takes it back ---------------------------
def test_the_queue_page_follows_a_run_sent_to_an_absent_board_and_revokes_it(stack, admin, devices):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/queue/")
    page.evaluate("window.__notReloaded = true")
    request_id = (
        shell(
            stack,
            "from dashboard import actions\nfrom dashboard.models import Device\n"
            "sent = actions.dispatch_run(None, [Device.objects.get(name='ghost')], actions.run_request(segments=['Anyone home?'], max_tokens=2, title='queued while watching'))\n"
            "print(sent[0]['request_id'])\n",
        )
        .strip()
        .splitlines()[-1]
    )
    row = page.locator(f'#queue-waiting tr[data-request="{request_id}"]')
    expect(row).to_contain_text("queued while watching", timeout=10_000)  # no reload: the page follows the dispatch
    expect(row).to_contain_text("waiting for its board to start")
    assert page.evaluate("window.__notReloaded") is True
    row.locator("button", has_text="Revoke").click()
    expect(page.locator("h1")).to_have_text("Revoke the run on ghost?")  # it asks first (issue 42)
    page.check("#id_confirm")
    page.click("#confirm-submit")
    expect(page.locator(".messages")).to_contain_text("Revoked the run")
    expect(page.locator(f'#queue-waiting tr[data-request="{request_id}"]')).to_have_count(0)
    expect(page.locator(f'#queue-ended tr[data-request="{request_id}"]')).to_contain_text(
        "revoked: admin took it back from the queue"
    )
    page.close()

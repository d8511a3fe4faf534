"""End to end in a real browser: Debian's Chromium driven by Playwright against the real
stack (`manage.py run`: embedded Valkey, control-plane worker, ASGI server) and a real
board (`manage.py edge`) running the real model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT, control_plane_password
from tests.stack import ADMIN_PASSWORD, SCREENSHOTS, browser, stack, stack_env  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.model, pytest.mark.cachebox]  # and browser, from the folder


def test_log_in_register_run_watch_the_chart_and_evict(stack, browser):
    from playwright.sync_api import expect

    from tests.stack import expect_board_online, start_board

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    base = stack["url"]

    # Log in (every page needs it).
    page.goto(base + "/")
    assert "/accounts/login/" in page.url
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    expect(page.locator("h1")).to_have_text("Dashboard")
    expect(page.locator("#live-status")).to_have_text("live")

    # Register a device: the token is shown once.
    page.goto(base + "/devices/register/")
    page.fill("#id_name", "bench-board")
    page.fill("#id_kind", "test runner")
    page.fill("#id_cpu_threads", "2")
    page.select_option("#id_link_preset", "none")
    page.click("#register-submit")
    token = page.locator("#device-token").inner_text().strip()
    assert len(token) > 30

    # Start the board with that token; its heartbeat turns the device online, live.
    board = start_board(stack, "bench-board", token)
    page.goto(base + "/devices/bench-board/")
    expect_board_online(page, stack, "bench-board", board)

    # Run a prompt twice: the answers and the breakdown chart update without a reload.
    page.goto(base + "/run/")
    page.evaluate("window.__notReloaded = true")
    points = lambda: page.evaluate("document.getElementById('chart-breakdown').data[0].x.length")  # noqa: E731
    assert points() == 0
    page.check("input[name=devices][value]")
    page.check("input[name=source][value=text]")
    page.fill("#id_text", "The three primary colors are red, yellow and")
    page.fill("#id_max_tokens", "4")
    for expected_points, expected_case in ((1, "miss"), (2, "full")):
        page.click("#run-submit")
        expect(page.locator("#answers .answer-card")).to_have_count(
            expected_points, timeout=30_000
        )  # this run's card, first
        card = page.locator("#answers .answer-card").first
        expect(card).to_have_class("card answer-card done", timeout=90_000)
        expect(card).to_contain_text(expected_case, timeout=30_000)
        page.wait_for_function(f"document.getElementById('chart-breakdown').data[0].x.length === {expected_points}")
    assert page.evaluate("window.__notReloaded") is True
    assert page.locator("#runs-body tr").count() >= 2

    # The dashboard shows both runs; keep a screenshot of it.
    page.goto(base + "/")
    page.wait_for_function("document.getElementById('chart-breakdown').data[0].x.length === 2")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "dashboard.png"), full_page=True)

    # A prompt schema: an inline error first, then saved, encoded on the board with live
    # progress, cached for the board's model, and a PML prompt served from its modules.
    travel = (ROOT / "examples" / "travel.pml").read_text()
    page.goto(base + "/schemas/new/")
    page.fill("#id_source", travel.replace('len="4"', 'len="x"'))
    page.click("#schema-save")
    expect(page.locator("#schema-errors")).to_contain_text("line 3")
    page.fill("#id_source", travel)
    page.click("#schema-save")
    expect(page.locator("h1")).to_contain_text("Schema travel")
    assert page.locator("#module-table tbody tr").count() == 6
    page.check("#encode-form input[name=devices]")
    page.click("#encode-submit")
    expect(page.locator(".encode-bar.done")).to_contain_text("6 stored", timeout=90_000)
    page.reload()
    expect(page.locator("#module-table tbody td.ok")).to_have_count(6)
    page.screenshot(path=str(SCREENSHOTS / "schema.png"), full_page=True)
    page.goto(base + "/run/")
    page.check("input[name=devices][value]")
    page.check("input[name=source][value=pml]")
    page.select_option("#id_schema", label="travel")
    page.fill(
        "#id_pml", '<prompt schema="travel"><trip-plan duration="3 days"/><miami/><user>Where to surf?</user></prompt>'
    )
    page.fill("#id_max_tokens", "4")
    page.click("#run-submit")
    answer = page.locator("#answers .answer-card").first
    expect(answer).to_have_class("card answer-card done", timeout=90_000)
    # Every module came from the cache box but the user's question was computed: a partial hit
    # by tokens, not "full" (a schema run is labelled by the tokens it reused).
    expect(answer).to_contain_text(re.compile(r"partial: \d+/\d+ prompt tokens"))

    # Evict an entry in the admin, with confirmation.
    page.goto(base + "/admin/dashboard/cacheentry/")
    rows = page.locator("#result_list tbody tr")
    before = rows.count()
    assert before >= 1
    key = rows.first.locator("th, td.field-key").first.inner_text().strip()
    rows.first.locator("input.action-select").check()
    page.select_option("select[name=action]", "evict")
    page.click("button[name=index], input[name=index], .actions button")
    page.click("#confirm-action")
    expect(page.locator(".messagelist")).to_contain_text("Evicted 1 entries.")
    assert page.locator("#result_list tbody tr").count() == before - 1

    import redis

    from cachebox.embedded import url_for

    client = redis.Redis.from_url(
        url_for(Path(stack["home"]) / "valkey", password=control_plane_password(stack["home"]))
    )
    assert client.exists(key) == 0


def test_a_board_registered_in_a_second_tenant_caches_there_only(stack, browser):
    """The probe: the form saved a board picked for tenant-b into default, its prompt's states landed
    in default, a default key got a full hit on them, and flushing tenant-b left them behind."""
    from playwright.sync_api import expect

    from tests.stack import expect_board_online, manage, start_board

    manage(
        stack, "shell", "-c", "from dashboard.models import Namespace; Namespace.objects.get_or_create(name='tenant-b')"
    )
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    base = stack["url"]
    page.goto(base + "/accounts/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", ADMIN_PASSWORD)
    page.click("#login-submit")
    page.goto(base + "/devices/register/")
    page.fill("#id_name", "b-board")
    page.select_option("#id_namespace", "tenant-b")
    page.fill("#id_cpu_threads", "2")
    page.select_option("#id_link_preset", "none")
    page.click("#register-submit")
    token = page.locator("#device-token").inner_text().strip()
    board = start_board(stack, "b-board", token)
    page.goto(base + "/devices/b-board/")
    expect_board_online(page, stack, "b-board", board)
    expect(page.locator("body")).to_contain_text("tenant-b")

    counts = "from dashboard.models import CacheEntry; print(CacheEntry.objects.filter(namespace='default').count(), CacheEntry.objects.filter(namespace='tenant-b').count())"
    default_before, _ = map(int, manage(stack, "shell", "-c", counts).split()[-2:])
    pk = manage(
        stack, "shell", "-c", "from dashboard.models import Device; print(Device.objects.get(name='b-board').pk)"
    ).split()[-1]
    page.goto(base + "/run/")
    page.check(f"input[name=devices][value='{pk}']")
    page.check("input[name=source][value=text]")
    page.fill("#id_text", "Tenant B secret: the launch code is 4471. Repeat the launch code:")
    page.fill("#id_max_tokens", "4")
    page.click("#run-submit")
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_class("card answer-card done", timeout=120_000)
    default_after, tenant_b = map(int, manage(stack, "shell", "-c", counts).split()[-2:])
    assert default_after == default_before and tenant_b >= 1  # its states went to tenant-b only
    page.goto(base + "/cache/")
    expect(page.locator("body")).to_contain_text("tenant-b")
    # Flushing tenant-b removes them, from the cache box too.
    manage(stack, "cachebox", "flush", "--namespace", "tenant-b", "--yes")
    listed = manage(
        stack,
        "shell",
        "-c",
        "from cachebox.store import CacheBox; from django.conf import settings; print(len(list(CacheBox(settings.REDIS_URL).scan_entries('tenant-b'))))",
    )
    assert listed.split()[-1] == "0"

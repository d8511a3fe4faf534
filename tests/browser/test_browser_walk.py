"""The pages an operator lives in, second walk (issue 42), in a real browser: Debian's Chromium
driven by Playwright against the real stack (tests/stack.py: embedded Valkey as cache box and
broker, the control-plane worker, the ASGI server). No board runs: these are what the pages say.

Each test names the item of the issue it checks; each fails on the pages before it. The server
side of the same items is in tests/dashboard/test_operator_pages.py.
"""

from __future__ import annotations

import re

import pytest

from tests.stack import ADMIN_PASSWORD, SCREENSHOTS, browser, log_in, shell, stack, stack_env  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.cachebox]  # and browser, from the folder

EMOJI = "\U0001f600"  # one character to the server (Python), two UTF-16 units to JavaScript


@pytest.fixture(scope="module")
def admin(stack, browser):
    shell(
        stack,
        "from dashboard import actions\n"
        "actions.register_device(None, name='ghost', kind='', cpu_threads=1, memory_mb=512, link_bandwidth_mbps=None, link_rtt_ms=None)\n",
    )
    context = log_in(browser, stack["url"], "admin", ADMIN_PASSWORD)
    yield context
    context.close()


# -- 2. the counters count what the server counts ---------------------------------------------------
def test_the_counters_count_an_emoji_as_one_character_as_the_server_does(stack, admin):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/run/")
    page.check(
        "input[name=source][value=text]"
    )  # no device ticked: the form refuses it without asking about a board first
    page.fill("#id_text", EMOJI * 20_000)
    expect(page.locator("#id_text-count")).to_have_text(
        "20,000 / 32,000 characters"
    )  # 40,000 UTF-16 units: not too long
    page.fill("#id_text", EMOJI * 33_000 + "abc")
    expect(page.locator("#id_text-count")).to_have_text("33,003 / 32,000 characters: too long, shorten it by 1,003")
    page.click("#run-submit")
    expect(page.locator("#run-feedback")).to_contain_text(
        "Text: The prompt has 33,003 characters; at most 32,000 are accepted"
    )  # the same count

    page.check("input[name=source][value=chat]")
    page.fill("#id_message", "Hi " + EMOJI * 4)
    expect(page.locator("#id_message-count")).to_have_text("7 / 32,000 characters")

    page.goto(stack["url"] + "/devices/register/")
    page.fill("#id_kind", EMOJI * 100)  # Device.kind holds 100 characters: exactly the limit
    expect(page.locator("#id_kind-count")).to_have_text("100 / 100 characters")
    page.fill("#id_kind", EMOJI * 101)
    expect(page.locator("#id_kind-count")).to_contain_text("101 / 100 characters: too long, shorten it by 1")
    page.close()


# -- 7. the Run page's options: greedy beside Temperature, help for Namespace, errors in the page's words --
def test_run_options_say_greedy_beside_temperature_and_errors_use_the_labels(stack, admin):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/run/")
    temperature, greedy = (
        page.locator("#id_temperature").bounding_box(),
        page.locator("#id_temperature-help").bounding_box(),
    )
    top_p, seed = page.locator("#id_top_p").bounding_box(), page.locator("#id_seed").bounding_box()
    expect(page.locator("#id_temperature-help")).to_have_text(re.compile(r"^0: greedy"))
    # On one line at this width, in order: Temperature, its help, then Top-p and Seed (the help no longer follows Seed).
    middle = greedy["y"] + greedy["height"] / 2
    assert temperature["y"] <= middle <= temperature["y"] + temperature["height"]
    assert (
        temperature["x"] + temperature["width"] <= greedy["x"]
        and greedy["x"] + greedy["width"] <= top_p["x"] < seed["x"]
    )
    expect(page.locator("#id_namespace-help")).to_contain_text("A board serves its own namespace only")

    page.check("input[name=source][value=text]")  # no device ticked (ghost is not running: the page would ask first)
    page.fill("#id_text", "Hello")
    page.evaluate(
        "document.getElementById('run-form').noValidate = true"
    )  # the server's checks, as a script (or an older browser) meets them
    page.fill("#id_max_tokens", "0")
    page.fill("#id_top_p", "5")
    page.fill("#id_namespace", "defualt")
    with page.expect_response(lambda r: r.url.endswith("/run/") and r.request.method == "POST") as answer:
        page.click("#run-submit")
    assert answer.value.status == 400
    feedback = page.locator("#run-feedback")
    expect(feedback).to_contain_text("Max tokens: Ensure this value is greater than or equal to 1.")
    expect(feedback).to_contain_text("Top-p: Ensure this value is less than or equal to 1.0.")
    expect(feedback).to_contain_text("Namespace: There is no namespace 'defualt'")
    assert "max_tokens:" not in feedback.inner_text() and "top_p:" not in feedback.inner_text()
    assert page.locator("#answers .answer-card").count() == 0  # a form error, not a failed run
    page.close()


# -- 10. the Queue page's states, Revoke confirmed ---------------------------------------------------
def test_the_queue_shows_where_each_run_is_and_revoke_asks_first(stack, admin):
    from playwright.sync_api import expect

    sent = shell(
        stack,
        "from dashboard import actions\nfrom dashboard.models import Device\n"
        "ghost = Device.objects.get(name='ghost')\n"
        "for n in range(2):\n"
        "    print('SENT=' + actions.dispatch_run(None, [ghost], actions.run_request(segments=[f'Anyone home {n}?'], max_tokens=2, title=f'walk {n}'))[0]['request_id'])\n",
    )
    first, second = [line.removeprefix("SENT=") for line in sent.splitlines() if line.startswith("SENT=")]
    page = admin.new_page()
    page.goto(stack["url"] + "/queue/")
    expect(page.locator(f'#queue-waiting tr[data-request="{first}"] td.state')).to_have_text(
        "waiting for its board to start: next in its queue"
    )
    expect(page.locator(f'#queue-waiting tr[data-request="{second}"] td.state')).to_have_text(
        "waiting for its board to start: 1 run ahead of it"
    )
    expect(page.locator("#queue-waiting")).not_to_contain_text("queued or running")

    page.locator(f'#queue-waiting tr[data-request="{first}"] button', has_text="Revoke").click()
    expect(page.locator("h1")).to_have_text("Revoke the run on ghost?")
    expect(page.locator("main")).to_contain_text("walk 0")
    page.click("#confirm-submit")  # not ticked: asked again, nothing revoked
    expect(page.locator("h1")).to_have_text("Revoke the run on ghost?")
    page.check("#id_confirm")
    page.click("#confirm-submit")
    expect(page.locator(".messages")).to_contain_text("Revoked the run")
    expect(page.locator(f'#queue-ended tr[data-request="{first}"]')).to_contain_text(
        "revoked: admin took it back from the queue"
    )
    # The revoked run's message still waits in the queue (its board drops it): it is not counted ahead.
    expect(page.locator(f'#queue-waiting tr[data-request="{second}"] td.state')).to_have_text(
        "waiting for its board to start: next in its queue"
    )
    page.close()


# -- 6. the Cache page's flush form opens on the current namespace -------------------------------------------
def test_the_flush_form_opens_on_the_current_namespace_not_every_one(stack, admin):
    from playwright.sync_api import expect

    page = admin.new_page()
    page.goto(stack["url"] + "/cache/")
    expect(page.locator("#flush-form #id_namespace")).to_have_value("default")
    page.check("#flush-form #id_confirm")
    page.click("#flush-form button[type=submit]")
    expect(page.locator(".messages")).to_contain_text("namespace default")
    expect(page.locator("#flush-form #id_namespace")).to_have_value("default")  # back on it, not on every namespace
    page.select_option("#flush-form #id_namespace", "*")
    page.check("#flush-form #id_confirm")
    page.click("#flush-form button[type=submit]")
    expect(page.locator(".messages")).to_contain_text("type “every namespace” to confirm")
    expect(page.locator("#flush-form #id_namespace")).to_have_value("default")
    page.close()


# -- 8 and 10. a member who is not staff; the login page -------------------------------------------------
def test_a_member_is_told_who_registers_boards_and_staff_pages_explain_themselves(stack, browser):
    from playwright.sync_api import expect

    shell(
        stack,
        "from django.contrib.auth import get_user_model\nfrom dashboard.models import Membership, Namespace\n"
        "Namespace.objects.get_or_create(name='walk-t2')\n"
        "walker = get_user_model().objects.create_user('walker', password='walker-pw-12345')\n"
        "Membership.objects.create(user=walker, namespace_id='walk-t2')\n",
    )
    stranger = browser.new_context(viewport={"width": 390, "height": 844})
    page = stranger.new_page()
    page.goto(stack["url"] + "/accounts/login/")
    page.fill("#id_username", "walker")
    page.fill("#id_password", "not-the-password")
    page.click("#login-submit")
    expect(page.locator("main .error, main .errorlist")).to_have_count(1)
    expect(page.locator("#login-error")).to_have_text(
        "Wrong username or password (both are case-sensitive): try again."
    )
    page.screenshot(path=str(SCREENSHOTS / "login-refused.png"), full_page=True)
    page.goto(stack["url"] + "/schemas/new/")
    assert "/accounts/login/" in page.url and "/admin/" not in page.url
    stranger.close()

    member = log_in(browser, stack["url"], "walker", "walker-pw-12345", width=390)
    page = member.new_page()
    page.goto(stack["url"] + "/")
    expect(page.locator(".no-devices")).to_contain_text("Your namespace walk-t2 has no boards yet.")
    expect(page.locator(".no-devices")).to_contain_text("Only staff register boards: ask a staff member")
    response = page.goto(stack["url"] + "/schemas/new/")
    assert response.status == 403 and "/admin/" not in page.url
    expect(page.locator("h1")).to_have_text("For staff only")
    expect(page.locator("#staff-only")).to_contain_text("a member of walk-t2")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "staff-only.png"), full_page=True)
    member.close()

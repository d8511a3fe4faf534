"""The dashboard tells the truth while it is open, in Debian's
Chromium against the real stack (tests/stack.py) and a real board running the real model: the
Run page's chat (template, turns that continue from the last one's state, sampling, Cancel that
keeps what was streamed), prompts typed with line breaks, "Run again", the break-even chart at a
phone's and a desktop's width, and the "Confusing" list. One stack for the module.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.stack import ADMIN_PASSWORD, SCREENSHOTS, browser, log_in, manage, shell, stack, stack_env, start_board  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.model, pytest.mark.cachebox]  # and browser, from the folder

BOARD = "truth-board"
LONG_WAIT = 90_000  # ms: a board's first answer


# Runs of a board that never ran ("chart-board", a Wi-Fi 4 link): prefills and fetches whose
# fitted lines cross, so its break-even chart has every part (title, legend, crossing label).
CHART_RUNS = [
    *(
        {
            "case": "miss",
            "prompt_tokens": t,
            "prefill_ms": t * 2.0,
            "decision": "policy-skip",
            "candidate_tokens": t,
            "predicted_fetch_ms": t * 0.5,
        }
        for t in (100, 200, 300, 400, 500)
    ),
    *(
        {
            "case": "full",
            "prompt_tokens": t + 5,
            "matched_tokens": t,
            "redis_ms": 30 + t * 0.4,
            "fetch_ms": 20 + t * 0.3,
            "restore_ms": 10 + t * 0.1,
            "fetched_bytes": t * 18_500,
            "decision": "fetch",
            "candidate_tokens": t,
            "predicted_fetch_ms": t * 0.45,
            "tier": "cachebox",
        }
        for t in (128, 256, 384)
    ),
]


@pytest.fixture(scope="module")
def setup(stack, browser):
    """A real board (online), a chart-only device with runs, a member of the default namespace, an admin session."""
    token = shell(
        stack,
        "import json\n"
        "from django.contrib.auth import get_user_model\n"
        "from dashboard import actions\n"
        "from dashboard.models import InferenceRun, Membership\n"
        f"device, token = actions.register_device(None, name={BOARD!r}, kind='test runner', cpu_threads=2, memory_mb=2048, link_bandwidth_mbps=None, link_rtt_ms=None)\n"
        "print('TOKEN=' + token)\n"
        "chart, _ = actions.register_device(None, name='chart-board', kind='', cpu_threads=1, memory_mb=512, link_bandwidth_mbps=20.9, link_rtt_ms=4.0)\n"
        f"for breakdown in json.loads({json.dumps(CHART_RUNS)!r}):\n"
        "    InferenceRun.objects.create(device=chart, source='text', prompt='x', text='y', breakdown=breakdown, case=breakdown['case'], prompt_tokens=breakdown['prompt_tokens'])\n"
        "member = get_user_model().objects.create_user('member', password='member-pw-12345')\n"
        "Membership.objects.create(user=member, namespace_id='default')\n",
    )
    token = next(line for line in token.splitlines() if line.startswith("TOKEN=")).removeprefix("TOKEN=")
    start_board(stack, BOARD, token)
    admin = log_in(browser, stack["url"], "admin", ADMIN_PASSWORD)
    page = admin.new_page()
    deadline = time.monotonic() + LONG_WAIT / 1000
    while True:  # what the control plane knows (a reload), not only what the socket pushed
        page.goto(stack["url"] + f"/devices/{BOARD}/")
        if page.locator('h1 [data-role="online"]').inner_text() == "online":
            break
        board_log = (stack["home"] / f"board-{BOARD}.log").read_text(errors="replace")[-2000:]
        assert time.monotonic() < deadline, f"{BOARD} did not come online; its log ends:\n{board_log}"
        page.wait_for_timeout(1000)
    page.close()
    yield {"admin": admin}
    admin.close()


def choose_board(page):
    page.check(f"#run-form label:has-text('{BOARD}') input[name=devices]")


def breakdown_row(page, name: str) -> str:
    return page.locator(f'#run-breakdown tr:has(th code:text-is("{name}")) td').inner_text()


# -- 1. the chat: template, the next turn from the last one's state, sampling ---------------------
def test_a_chat_turn_continues_from_the_state_of_the_last_one(stack, setup):
    from playwright.sync_api import expect

    page = setup["admin"].new_page()
    page.goto(stack["url"] + "/run/")
    expect(page.locator("input[name=source][value=chat]")).to_be_checked()  # the page opens on Chat
    choose_board(page)
    page.fill("#id_max_tokens", "8")
    page.fill("#id_temperature", "0")
    page.fill("#id_message", "Name one ferry port in England.")
    page.press("#id_message", "Enter")  # Enter sends, as in llama.cpp's web UI
    log = page.locator("#chat-log")
    first = log.locator(".chat-msg.assistant").nth(0)
    expect(first).not_to_have_class(re.compile(r"\bpending\b"), timeout=LONG_WAIT)
    answer = first.inner_text().strip()
    assert (
        answer
    )  # (the packaged Gemma-3 270M is a base model: through its template too it mostly repeats the question)
    expect(page.locator("#id_message")).to_have_value("")
    # The run's row, added live, writes its time as the rows the server wrote (not "8:15:56 PM").
    expect(page.locator("#runs-body tr[data-request]").first.locator("td").first).to_have_text(
        re.compile(r"^\d\d:\d\d:\d\d$")
    )
    assert [turn["role"] for turn in json.loads(page.input_value("#id_history"))] == ["user", "assistant"]
    # A person reads the answer before typing the next turn; meanwhile the board prepares it (a
    # request that reaches the board at once goes first instead). The first turn's report leaves
    # the board once that is done.
    request_id = page.locator("#answers .answer-card").first.get_attribute("data-request")
    prepared = shell(
        stack,
        "import time; from dashboard.models import InferenceRun; deadline = time.monotonic() + 60\n"
        f"while not InferenceRun.objects.filter(request_id='{request_id}').exists() and time.monotonic() < deadline: time.sleep(0.1)\n"
        f"print(InferenceRun.objects.get(request_id='{request_id}').breakdown.get('next_turn_tokens', 0))",
    )
    assert int(prepared.strip().splitlines()[-1]) > 0, prepared

    page.fill("#id_message", "And one in France?")
    page.click("#run-submit")
    expect(page.locator("#answers .answer-card")).to_have_count(2)
    second = log.locator(".chat-msg.assistant").nth(1)
    expect(second).not_to_have_class(re.compile(r"\bpending\b"), timeout=LONG_WAIT)
    expect(log.locator(".chat-msg.user")).to_have_text(["Name one ferry port in England.", "And one in France?"])
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#run-form").screenshot(path=str(SCREENSHOTS / "run-chat.png"))
    # The second turn's record: prefilled only its new message, from the board's own context.
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    page.goto(stack["url"] + card.locator("h3 a").get_attribute("href"))
    assert breakdown_row(page, "tier") == "context"
    matched, prompt = int(breakdown_row(page, "matched_tokens")), int(breakdown_row(page, "prompt_tokens"))
    assert prompt - matched < 20 < matched  # the first turn and its answer came from the state, not prefilled again
    expect(page.locator("#run-asked")).to_contain_text("Asked for 8 tokens · temperature 0.0")
    expect(page.locator("#run-prompt")).to_contain_text("<start_of_turn>user")  # the model's chat template
    page.close()


def test_cancel_keeps_what_was_streamed_and_run_again_asks_for_as_many_tokens(stack, setup):
    from playwright.sync_api import expect

    page = setup["admin"].new_page()
    page.goto(stack["url"] + "/run/")
    choose_board(page)
    page.fill("#id_max_tokens", "256")
    page.fill("#id_message", "Write a long story about a ferry crossing the sea at night.")
    page.click("#run-submit")
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_attribute("data-tokens", re.compile(r"^([3-9]|\d\d+)$"), timeout=LONG_WAIT)
    card.locator(".cancel-run").click()
    expect(card).to_have_class(re.compile(r"\bcancelled\b"), timeout=LONG_WAIT)
    kept = card.locator(".answer").inner_text()
    assert len(kept.strip()) > 3
    expect(card.locator(".badge.cancelled")).to_have_text("cancelled")
    bubble = page.locator("#chat-log .chat-msg.assistant").last
    expect(bubble).to_have_class(re.compile(r"\bcancelled\b"))
    assert kept.strip()[:10] in bubble.inner_text()

    page.goto(stack["url"] + card.locator("h3 a").get_attribute("href"))
    expect(page.locator("#run-cancelled")).to_have_text("cancelled")
    expect(page.locator("#run-answer")).to_contain_text(kept.strip()[:10])
    page.click("#run-again")
    expect(page.locator("#id_max_tokens")).to_have_value("256")  # asked for, not generated
    expect(page.locator("input[name=source][value=chat]")).to_be_checked()
    expect(page.locator("#id_message")).to_have_value("Write a long story about a ferry crossing the sea at night.")
    page.close()


# -- 2, 3. a prompt typed with line breaks; Run again on an MMLU question -----------------------------
def test_a_typed_multiline_prompt_is_stored_with_lf_and_an_mmlu_run_again_stays_mmlu(stack, setup):
    from playwright.sync_api import expect

    page = setup["admin"].new_page()
    page.goto(stack["url"] + "/run/")
    page.check("input[name=source][value=text]")
    choose_board(page)
    page.fill("#id_max_tokens", "1")
    page.click("#id_text")
    page.keyboard.type("Ferry times:")
    page.keyboard.press("Enter")
    page.keyboard.type("Dover 08:00")
    with page.expect_request(lambda r: r.url.endswith("/run/") and r.method == "POST") as sent:
        page.click("#run-submit")
    assert b"Ferry times:\r\nDover 08:00" in sent.value.post_data_buffer  # what browsers post (HTML: CRLF)
    expect(page.locator("#answers .answer-card").first).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    exported = page.evaluate("fetch('/runs/export.json?q=Ferry+times').then(r => r.json())")
    assert [run["prompt"] for run in exported["runs"]] == ["Ferry times:\nDover 08:00"]  # as the API and infer send it

    page.check("input[name=source][value=mmlu]")
    page.select_option("#id_topic", "astronomy")
    page.fill("#id_shots", "0")
    page.fill("#id_question", "99999")
    page.click("#run-submit")
    expect(page.locator("#run-feedback")).to_contain_text(
        re.compile(r"astronomy has [\d,]+ questions at 0 shots: choose a question from 1 to [\d,]+")
    )
    page.fill("#id_question", "2")
    page.click("#run-submit")
    expect(page.locator("#answers .answer-card")).to_have_count(2)  # its card, before the first
    card = page.locator("#answers .answer-card").first
    expect(card).to_have_class(re.compile(r"\bdone\b"), timeout=LONG_WAIT)
    expect(card.locator(".verdict")).to_be_visible()
    page.goto(stack["url"] + card.locator("h3 a").get_attribute("href"))
    page.click("#run-again")
    expect(page.locator("input[name=source][value=mmlu]")).to_be_checked()
    expect(page.locator("#id_topic")).to_have_value("astronomy")
    expect(page.locator("#id_question")).to_have_value("2")
    expect(page.locator("#id_shots")).to_have_value("0")
    page.close()


# -- 4. B4: the break-even chart at a phone's and a desktop's width -----------------------------------
def overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    )


@pytest.mark.parametrize("width", [390, 1440])
def test_the_break_even_chart_keeps_title_label_axis_title_and_legend_apart(stack, browser, setup, width):
    from playwright.sync_api import expect

    context = log_in(browser, stack["url"], "admin", ADMIN_PASSWORD, width=width)
    page = context.new_page()
    page.goto(stack["url"] + "/devices/chart-board/")
    chart = page.locator("#chart-breakeven")
    expect(chart.locator(".legend")).to_be_visible()
    expect(chart.locator(".annotation")).to_contain_text(re.compile(r"break-even ≈ \d+ tokens"))
    parts = (
        ("title", ".gtitle"),
        ("label", ".annotation"),
        ("axis title", ".xtitle"),
        ("legend", ".legend"),
        ("plot", ".draglayer .nsewdrag"),
    )

    def measured():
        return {name: chart.locator(selector).first.bounding_box() for name, selector in parts}

    # The chart may draw again once it knows its legend's height: wait until two readings agree.
    boxes, deadline = measured(), time.monotonic() + 15
    while True:
        page.wait_for_timeout(250)
        again = measured()
        if again == boxes:
            break
        assert time.monotonic() < deadline, "the chart kept moving"
        boxes = again
    chart.hover()  # the toolbar shows on hover, above the title
    boxes["toolbar"] = chart.locator(".modebar").bounding_box()
    assert boxes["plot"]["height"] > 150, boxes  # the plot is not squeezed by its title or legend
    for a, b in (
        ("title", "plot"),
        ("title", "label"),
        ("axis title", "legend"),
        ("legend", "plot"),
        ("title", "legend"),
        ("toolbar", "title"),
    ):
        assert not overlap(boxes[a], boxes[b]), f"at {width} px the {a} covers the {b}: {boxes}"
    expect(page.locator("#breakeven-verdict")).to_contain_text("Fetching wins from")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    chart.screenshot(path=str(SCREENSHOTS / f"breakeven-{width}.png"))
    context.close()


# -- 5. the "Confusing" list -------------------------------------------------------------------
def test_a_duplicate_name_is_marked_on_its_field_and_the_token_page_does_not_post_again(stack, setup):
    from playwright.sync_api import expect

    page = setup["admin"].new_page()
    page.goto(stack["url"] + "/devices/register/")
    expect(page.locator("label[for=id_cpu_threads]")).to_have_text("CPU threads:")
    expect(page.locator("label[for=id_memory_mb]")).to_have_text("Memory (MB):")
    page.fill("#id_name", BOARD)
    page.click("#register-submit")
    name = page.locator("#id_name")
    expect(name).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#id_name_error")).to_contain_text(f"A device named '{BOARD}' is registered already")
    error_color = page.evaluate("getComputedStyle(document.getElementById('id_name_error')).color")
    assert (
        name.evaluate("n => getComputedStyle(n).borderTopColor") == error_color
    )  # the field is marked in the error's colour

    page.fill("#id_name", "once-board")
    page.click("#register-submit")
    token = page.locator("#device-token").inner_text().strip()
    assert len(token) > 30
    reloaded = page.reload()  # a GET: nothing posted again
    assert reloaded.request.method == "GET"
    expect(page.locator(".messages")).to_contain_text("was shown once")
    expect(page.locator("body")).not_to_contain_text(token)
    page.goto(stack["url"] + "/devices/")
    expect(page.locator('tr[data-device^="once-"]')).to_have_count(1)
    page.close()


def test_the_counter_and_the_server_agree_and_a_member_sees_no_internal_address(stack, browser, setup):
    from playwright.sync_api import expect

    page = setup["admin"].new_page()
    page.goto(stack["url"] + "/run/")
    page.check("input[name=source][value=text]")
    choose_board(page)
    page.fill("#id_max_tokens", "1")
    page.fill("#id_text", ("x" * 99 + "\n") * 320)  # 32,000 characters as the page counts them
    expect(page.locator("#id_text-count")).to_have_text("32,000 / 32,000 characters")
    page.click("#run-submit")
    expect(page.locator("#run-feedback")).to_have_text(
        f"sent to {BOARD}"
    )  # accepted (the board then says it does not fit its context)
    page.close()

    member = log_in(browser, stack["url"], "member", "member-pw-12345", timezone_id="America/New_York")
    home = member.new_page()
    home.goto(stack["url"] + "/")
    expect(home.locator("#cachebox-line")).to_have_text("Cache box")
    assert "redis://" not in home.content() and "rediss://" not in home.content()
    # Dates the live script writes read as the server's (UTC here), not the browser's zone.
    home.goto(stack["url"] + "/devices/")
    cell = home.locator(f'tr[data-device="{BOARD}"] [data-role="last-seen"]')
    cell.evaluate("node => { node.textContent = 'rewritten by the next device event'; }")
    # A device event (a heartbeat sends one at most every 30 s; a change of the device, at once).
    shell(
        stack,
        f"from dashboard import actions\nfrom dashboard.models import Device\nactions.update_device(None, Device.objects.get(name={BOARD!r}))\n",
    )
    expect(cell).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d$"))
    from datetime import datetime, timedelta, timezone

    now = datetime.now(timezone.utc)
    assert cell.inner_text() in {(now - timedelta(minutes=m)).strftime("%Y-%m-%d %H:%M") for m in (-1, 0, 1, 2)}
    member.close()

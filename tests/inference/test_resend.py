"""Re-sends that continue, and busy is not dead (issue 39, item 4).

The sweeper's verdicts on the real database and a real Valkey (``actions.sweeper``): a board heard
on a run's stream is alive whatever its heartbeats say; a run sent to a named board is never moved
(it waits while its client does, then fails with the reason and the answer its client had); a
routed run moves once, and its follower sends it to the new board with what it streamed. The
processes' part (real boards killed and stopped mid-answer, the official `openai` client and the
Run page) is at the end of this file.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from datetime import timedelta

import pytest

from tests.conftest import require
from tests.stack import ADMIN_PASSWORD, browser, free_port, log_in, wait_for_http  # noqa: F401  (fixtures)


@pytest.fixture
def two_boards(settings, valkey_url, monkeypatch):
    """Two enrolled boards of one namespace, beating every second, and what is sent to them."""
    from django.utils import timezone

    from cachebox.keys import heard_key_name
    from cachebox.store import CacheBox
    from dashboard.models import Device
    from tests.dashboard.test_dashboard import enrolled, register

    settings.REDIS_URL = valkey_url
    settings.EDGECACHE_BOARD_ACL = False
    CacheBox(valkey_url).delete(
        [heard_key_name("first"), heard_key_name("second")]
    )  # what an earlier test's followers heard
    sent: list[tuple[str, dict]] = []
    monkeypatch.setattr(
        "dashboard.actions.runs.send_to_board",
        lambda device, task, message, expires: sent.append((device.name, message)),
    )
    first, first_token = register("first")
    second, second_token = register("second")
    keys = {"first": enrolled(first, first_token), "second": enrolled(second, second_token)}
    Device.objects.filter(name__in=["first", "second"]).update(
        last_seen=timezone.now(), status={"heartbeat_s": 1, "fingerprint": "00ff00ff00ff00ff"}
    )
    first.refresh_from_db()
    return {"first": first, "second": second, "keys": keys, "sent": sent}


def _dispatch(two_boards, *, routed: bool, allowed=None) -> str:
    from dashboard import actions, router

    spec = actions.run_request(
        segments=["Tell me a story."], max_tokens=40, title="waiting", stream=True
    )  # its client follows it
    record = {"policy": "cache-aware", **({"allowed": allowed} if allowed else {})}
    chosen = router.Routed(two_boards["first"], record) if routed else None
    return actions.dispatch_run(None, [two_boards["first"]], spec, routed=chosen)[0]["request_id"]


def _first_went_quiet(seconds: float = 10):
    """``seconds`` on: first stopped beating right after it took the run; second beats on."""
    from django.utils import timezone

    from dashboard.models import Device

    later = timezone.now() + timedelta(seconds=seconds)
    Device.objects.filter(name="second").update(last_seen=later)
    return later


@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_board_heard_on_a_runs_stream_is_alive_whatever_its_heartbeats_say(two_boards):
    from dashboard.actions import runs, sweeper

    request_id = _dispatch(two_boards, routed=True)
    later = _first_went_quiet()
    runs.heard(
        "first", "0" * 8 + "-0000-0000-0000-" + "0" * 12, now=later.timestamp() - 2
    )  # decoding another run, 2 s ago
    assert sweeper.sweep(later) == {"answered": 0, "resent": 0, "lost": 0, "waiting": 0}
    assert [name for name, _ in two_boards["sent"]] == ["first"]
    # Silent on every stream as well as in its heartbeats: now it is quiet.
    counts = sweeper.sweep(_first_went_quiet(15))
    assert counts["resent"] == 1, request_id


@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_run_sent_to_a_named_board_is_never_moved_it_waits_then_fails_keeping_the_answer_its_client_had(two_boards):
    from django.utils import timezone

    from dashboard import actions
    from dashboard.actions import runs, sweeper
    from dashboard.models import Dispatch, InferenceRun
    from tests.dashboard.test_dashboard import result_payload

    request_id = _dispatch(two_boards, routed=False)
    runs.heard("first", request_id, now=timezone.now().timestamp())  # it took the run and streamed some of it
    later = _first_went_quiet()
    assert sweeper.sweep(later) == {
        "answered": 0,
        "resent": 0,
        "lost": 0,
        "waiting": 1,
    }  # second is online, yet not the board asked for
    runs.keep_streamed(request_id, "Once upon a time, a keeper")  # its client stopped following it with this much
    dispatch = Dispatch.objects.get(request_id=request_id)
    assert (dispatch.device.name, dispatch.attempt, dispatch.outcome) == ("first", 1, "")
    assert sweeper.sweep(dispatch.expires_at + timedelta(seconds=1))["lost"] == 1
    run = InferenceRun.objects.get(request_id=request_id)
    assert (
        run.device.name == "first"
        and run.error.startswith("lost: board first stopped answering")
        and "quiet for" in run.error
    )
    assert run.text == "Once upon a time, a keeper" and "stopped after what is shown" in run.error
    assert [name for name, _ in two_boards["sent"]] == ["first"]
    # The board was paused, not gone: nobody else answered, so its late answer is the run.
    late = actions.record_run(
        result_payload(
            two_boards["first"],
            two_boards["keys"]["first"],
            request_id=request_id,
            dispatched=False,
            text=" a long story",
        )
    )
    assert late is not None and InferenceRun.objects.get(request_id=request_id).error == ""
    assert InferenceRun.objects.get(request_id=request_id).text == " a long story"


@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_routed_run_moves_once_and_its_follower_sends_it_there_going_on_from_what_it_streamed(two_boards):
    from dashboard import actions
    from dashboard.actions import runs, sweeper
    from dashboard.models import Dispatch, InferenceRun
    from tests.dashboard.test_dashboard import result_payload

    request_id = _dispatch(two_boards, routed=True)
    later = _first_went_quiet()
    assert sweeper.sweep(later)["resent"] == 1
    dispatch = Dispatch.objects.get(request_id=request_id)
    assert (dispatch.device.name, dispatch.attempt, dispatch.moving) == ("second", 2, True)
    assert [name for name, _ in two_boards["sent"]] == ["first"]  # not sent yet: its follower listens to second first
    assert sweeper.sweep(later)["resent"] == 0  # once
    # The follower, listening to second now, sends it with the answer its client has.
    assert runs.continue_run(request_id, "second", [10, 11, 12], "Once upon")
    assert not runs.continue_run(request_id, "second", [10, 11, 12], "Once upon")  # once
    name, message = two_boards["sent"][-1]
    assert name == "second" and message["continues"] == {"tokens": [10, 11, 12], "text": "Once upon", "device": "first"}
    assert message["request_id"] == request_id and message["segments"] == ["Tell me a story."]
    assert (
        sweeper.sweep(_first_went_quiet(10 + 2 * sweeper.HANDOVER.total_seconds()))["resent"] == 0
        and len(two_boards["sent"]) == 2
    )
    # first's late answer is refused; second's is the run, and says where it came from.
    assert (
        actions.record_run(
            result_payload(two_boards["first"], two_boards["keys"]["first"], request_id=request_id, dispatched=False)
        )
        is None
    )
    run = actions.record_run(
        result_payload(two_boards["second"], two_boards["keys"]["second"], request_id=request_id, dispatched=False)
    )
    assert (
        run is not None
        and run.device.name == "second"
        and InferenceRun.objects.filter(request_id=request_id).count() == 1
    )
    assert (
        run.breakdown["resent_from"]["from"] == "first" and "stopped answering" in run.breakdown["resent_from"]["why"]
    )


@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_moved_run_nobody_follows_is_sent_by_the_sweeper_and_one_limited_to_its_board_waits(two_boards):
    from dashboard.actions import sweeper
    from dashboard.models import Dispatch

    unfollowed = _dispatch(two_boards, routed=True)
    limited = _dispatch(two_boards, routed=True, allowed=["first"])  # "any board" among the ones ticked: first only
    later = _first_went_quiet()
    counts = sweeper.sweep(later)
    assert counts["resent"] == 1 and counts["waiting"] == 1
    assert Dispatch.objects.get(request_id=limited).device.name == "first"
    assert (
        sweeper.sweep(_first_went_quiet(10 + sweeper.HANDOVER.total_seconds() + 1))["resent"] == 1
    )  # its client's follower never sent it
    name, message = two_boards["sent"][-1]
    assert name == "second" and message["request_id"] == unfollowed and "continues" not in message
    assert not Dispatch.objects.get(request_id=unfollowed).moving


@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_waited_for_run_that_expires_unstarted_fails_at_its_expiry_not_a_minute_later(two_boards):
    from dashboard.actions import sweeper
    from dashboard.models import Dispatch, InferenceRun

    request_id = _dispatch(two_boards, routed=False)
    expires_at = Dispatch.objects.get(request_id=request_id).expires_at
    assert sweeper.sweep(expires_at - timedelta(seconds=1))["lost"] == 0
    assert sweeper.sweep(expires_at + timedelta(seconds=1))["lost"] == 1
    assert InferenceRun.objects.get(request_id=request_id).error.startswith(
        "lost: board first did not start it before it expired"
    )


@pytest.mark.cachebox
def test_a_board_says_its_stage_again_while_it_prefills_so_its_followers_hear_it_is_alive(valkey_url, monkeypatch):
    """A long prefill (or a fetch over a slow link) publishes nothing for seconds: the board's stream
    thread says the run's stage again every ``PULSE_S`` until the first token, never after it."""
    import time
    import uuid

    import redis

    from cachebox.keys import stream_channel
    from cachebox.store import CacheBox
    from inference.board.streaming import StreamPublisher
    from inference.contract.messages import StreamEvent
    from tests.inference.test_edge import board_identity

    monkeypatch.setattr(StreamPublisher, "PULSE_S", 0.3)
    me = board_identity("pulse")
    request_id = str(uuid.uuid4())
    listener = redis.Redis.from_url(valkey_url).pubsub(ignore_subscribe_messages=True)
    listener.subscribe(stream_channel("pulse", request_id))
    stream = StreamPublisher(CacheBox(valkey_url), request_id, me)

    def heard(count: int, within: float = 10.0) -> list:
        events, deadline = [], time.monotonic() + within
        while len(events) < count and time.monotonic() < deadline:
            message = listener.get_message(timeout=0.2)
            if message is not None:
                events.append(
                    StreamEvent.open(
                        message["data"],
                        request_id=request_id,
                        signer_public_key=me.keys.signing_public_key,
                        ring_for=me.ring_for,
                    )
                )
        return events

    stream.send(StreamEvent(type="stage", request_id=request_id, device="pulse", stage="prefilling"))
    assert [(event.type, event.stage) for event in heard(3)] == [
        ("stage", "prefilling")
    ] * 3  # said, then said again while it prefills
    stream.send(StreamEvent(type="token", request_id=request_id, device="pulse", index=stream.count(), text="Once"))
    assert [event.type for event in heard(1)] == ["token"]
    assert heard(1, within=1.5) == []  # tokens flow: no more pulses
    stream.close()
    listener.close()


# -- real boards, killed and stopped mid-answer --------------------------------------------------------
# `manage.py run` (embedded Valkey, the control worker and its sweeper every second, the web server) and two
# real boards beating every second (quiet after 4 s), the real model; an answer long enough to stop
# its board half-way. Each test waits on conditions (chunks read, a board marked offline, a card's
# text), never on a sleep.
STORY = "Write a long story about a lighthouse keeper and the sea."
ANSWER_TOKENS = 120
BOARDS = ("left", "right")


class Fleet:
    def __init__(self, stack, tokens: dict):
        self.stack, self.tokens = stack, tokens
        self.boards: dict = {}
        self.cold: dict = {}

    def start(self, name: str):
        from tests.dashboard.test_api import until

        log = f"board-{name}"
        before = self.stack.log(log).count(f"board {name} ready") if (self.stack.home / f"{log}.log").exists() else 0
        process = self.stack.spawn(
            log,
            [sys.executable, "manage.py", "edge", "--name", name, "--heartbeat", "1"],
            {"EDGECACHE_DEVICE_TOKEN": self.tokens[name]},
        )
        until(
            lambda: self.stack.log(log).count(f"board {name} ready") > before or process.poll() is not None,
            240,
            f"board {name} to load its model",
        )
        assert process.poll() is None, self.stack.log(log)
        self.boards[name] = process
        return process

    def all_up(self) -> None:
        """Every board running and online again (one killed by an earlier test restarts)."""
        from tests.dashboard.test_api import until

        for name in BOARDS:
            process = self.boards.get(name)
            if process is None or process.poll() is not None:
                self.start(name)
            elif process.poll() is None:
                process.send_signal(signal.SIGCONT)  # one left stopped by a failed test
        until(lambda: self.online() >= set(BOARDS), 60, "both boards to be online")

    def online(self) -> set[str]:
        return {row[0] for row in self.stack.db("select name from dashboard_device where announced_online = 1")}

    def dispatched_to(self, request_id: str) -> str:
        from tests.dashboard.test_api import until

        rows = until(
            lambda: self.stack.db(
                "select d.name from dashboard_dispatch x join dashboard_device d on d.id = x.device_id "
                'where replace(x.request_id, "-", "") = ?',
                request_id.replace("-", ""),
            ),
            30,
            "the run's dispatch",
        )
        return rows[0][0]

    def stop(self, name: str, how: signal.Signals) -> None:
        self.boards[name].send_signal(how)
        if how == signal.SIGKILL:
            self.boards[name].wait(timeout=30)

    def cold_answer(self, prompt: str = STORY) -> str:
        """The answer of a cold run (no cache tier read or written), greedy."""
        if prompt not in self.cold:
            answer = self.stack.client().chat.completions.create(
                model=self.stack.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=ANSWER_TOKENS,
                temperature=0,
                extra_body={"edgecache": {"device": "left", "cache": False}},
            )
            self.cold[prompt] = answer.choices[0].message.content
            assert answer.usage.completion_tokens == ANSWER_TOKENS, (
                "the story ended early: pick a prompt whose answer is longer"
            )
        return self.cold[prompt]


REGISTER = """
from dashboard import actions
tokens = [actions.register_device(None, name=name, kind="test board", cpu_threads=1, memory_mb=2048)[1] for name in ("left", "right", "ghost")]
print(" ".join(tokens))
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from tests.dashboard.test_api import Stack, until

    require("openai", "the test extra installs openai (make install)")
    home = tmp_path_factory.mktemp("resend")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "DATABASE_URL")}
    env.update(
        {
            "EDGECACHE_HOME": str(home),
            "EDGECACHE_ADMIN_PASSWORD": ADMIN_PASSWORD,
            "EDGECACHE_N_CTX": "2048",
            "EDGECACHE_API_TIMEOUT": "120",
            "EDGECACHE_SWEEP_SECONDS": "1",
            "EDGECACHE_TASK_EXPIRES": "90",
        }
    )
    stack = Stack(home, port, env)
    server = stack.spawn("run", [sys.executable, "manage.py", "run", "--no-boards", "--port", str(port)])
    try:
        wait_for_http(f"{stack.url}/accounts/login/", server)
        tokens = dict(zip(("left", "right", "ghost"), stack.shell(REGISTER).split()))
        stack.keys["main"] = stack.manage(
            "apikey", "create", "--namespace", "default", "--name", "main", "--rate", "0"
        ).stdout.strip()
        fleet = Fleet(stack, tokens)
        for name in BOARDS:
            fleet.start(name)
        stack.model = until(lambda: stack.client().models.list().data, 60, "the boards to come online")[0].id
        fleet.all_up()
        yield fleet
    finally:
        for process in fleet.boards.values() if "fleet" in locals() else ():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        stack.stop()


class Streamed:
    """The story streamed through the official `openai` client, read chunk by chunk."""

    def __init__(self, fleet, device: str | None = None):
        extra = {"edgecache": {"device": device}} if device else {}
        self.chunks = iter(
            fleet.stack.client().chat.completions.create(
                model=fleet.stack.model,
                messages=[{"role": "user", "content": STORY}],
                max_tokens=ANSWER_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
        )
        self.pieces: list[str] = []
        self.request_id = ""
        self.last = None

    def read(self, pieces: int | None = None) -> None:
        """Read until ``pieces`` pieces of text came (all of it: None)."""
        for chunk in self.chunks:
            self.request_id = self.request_id or chunk.id.removeprefix("chatcmpl-")
            if chunk.choices and chunk.choices[0].delta.content:
                self.pieces.append(chunk.choices[0].delta.content)
            self.last = chunk
            if pieces is not None and len(self.pieces) >= pieces:
                return

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _stop_mid_answer(fleet, streamed: Streamed, how: signal.Signals) -> str:
    """Stop the board answering ``streamed`` with ``how`` after its first pieces; returns its name."""
    streamed.read(3)
    board = fleet.dispatched_to(streamed.request_id)
    recorded = fleet.stack.db(
        'select count(*) from dashboard_inferencerun where replace(request_id, "-", "") = ?',
        streamed.request_id.replace("-", ""),
    )[0][0]
    assert recorded == 0, "the board finished before it was stopped: make the answer longer"
    fleet.stop(board, how)
    print(f"{board} stopped ({how.name}) after {len(streamed.pieces)} pieces of the answer")
    return board


@pytest.mark.model
@pytest.mark.cachebox
@pytest.mark.processes
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_an_api_answer_whose_board_dies_or_stops_mid_answer_goes_on_on_another_board_as_one_cold_answer(fleet, how):
    fleet.all_up()
    cold = fleet.cold_answer()
    streamed = Streamed(fleet)
    stopped = _stop_mid_answer(fleet, streamed, how)
    try:
        streamed.read()
        extension = streamed.last.model_extra["edgecache"]
        print(f"{how.name}: {extension['device']} finished the answer")
        assert streamed.text == cold  # one answer: no repeat, no gap, the cold one
        assert extension["device"] != stopped and streamed.last.usage.completion_tokens == ANSWER_TOKENS
        run = fleet.stack.run_row(streamed.request_id)
        assert run["error"] == "" and run["text"] == cold
        assert run["breakdown"]["resent_from"]["from"] == stopped and run["breakdown"]["continued_tokens"] >= 3
    finally:
        if how == signal.SIGSTOP:
            fleet.boards[stopped].send_signal(
                signal.SIGCONT
            )  # it wakes, finds the run cancelled, and its late report is refused


@pytest.mark.model
@pytest.mark.cachebox
@pytest.mark.processes
def test_an_api_answer_from_a_named_board_that_stops_waits_for_it_and_is_never_moved(fleet):
    import redis

    from cachebox.keys import stream_channel
    from tests.dashboard.test_api import until

    fleet.all_up()
    cold = fleet.cold_answer()
    streamed = Streamed(fleet, device="right")
    listener = redis.Redis.from_url(
        fleet.stack.shell("from dashboard.actions import cachebox_url; print(cachebox_url())")
    ).pubsub(ignore_subscribe_messages=True)
    try:
        assert _stop_mid_answer(fleet, streamed, signal.SIGSTOP) == "right"
        listener.subscribe(stream_channel("right", streamed.request_id))
        # right is stopped: what comes on its run's channel now is the control plane's word (a "waiting" stage).
        until(
            lambda: listener.get_message(timeout=1.0) is not None,
            60,
            "the sweeper to find right quiet and leave the run waiting for it",
        )
        # The sweeper tells the pages right went quiet after it leaves the run waiting (the same sweep).
        until(lambda: "right" not in fleet.online(), 30, "right to be announced offline")
        assert "left" in fleet.online()  # another board was there to take it
        assert fleet.dispatched_to(streamed.request_id) == "right"  # sent to right only: never moved
    finally:
        fleet.boards["right"].send_signal(signal.SIGCONT)
        listener.close()
    streamed.read()
    assert streamed.text == cold and streamed.last.model_extra["edgecache"]["device"] == "right"
    assert fleet.stack.run_row(streamed.request_id)["error"] == ""


# -- the Run page (Playwright, Debian's Chromium) ------------------------------------------------------
def _send_from_the_run_page(fleet, browser, *, boards=(), any_board=False, timeout_s: float = 120):
    """Log in, send the story from the Run page's chat to ``boards`` (or any board); returns the page
    and its answer card once the card shows the first pieces of the answer (``timeout_s``)."""
    from playwright.sync_api import expect

    context = log_in(browser, fleet.stack.url, "admin", ADMIN_PASSWORD)
    page = context.new_page()
    page.goto(fleet.stack.url + "/run/")
    for name in boards:
        page.check(f'label[data-device="{name}"] input')
    if any_board:
        page.check("#id_any_board")
    page.fill("#id_max_tokens", str(ANSWER_TOKENS))
    page.fill("#id_message", STORY)
    page.click("#run-submit")
    if any(name not in fleet.online() for name in boards):
        page.click("#run-send-anyway")  # the page warns that the board is not running
    card = page.locator("#answers .answer-card").first
    try:
        expect(card).to_have_attribute("data-request", re.compile(".+"), timeout=30_000)
    except AssertionError:
        raise AssertionError(f"no answer card; the page said: {page.locator('#run-feedback').inner_text()!r}") from None
    return page, card


@pytest.mark.model
@pytest.mark.cachebox
@pytest.mark.processes
@pytest.mark.browser
def test_the_run_page_shows_one_answer_when_its_board_is_killed_mid_answer_and_says_the_board_changed(fleet, browser):
    from playwright.sync_api import expect

    from tests.dashboard.test_api import until

    fleet.all_up()
    cold = fleet.cold_answer()
    page, card = _send_from_the_run_page(fleet, browser, any_board=True)
    until(
        lambda: (
            len(card.locator(".answer.streaming").all_inner_texts() and card.locator(".answer.streaming").inner_text())
            > 10
        ),
        120,
        "the first pieces on the card",
    )
    first = card.get_attribute("data-device")
    fleet.stop(first, signal.SIGKILL)
    other = next(name for name in BOARDS if name != first)
    expect(card.locator(".moved-note")).to_contain_text(
        f"board changed: {first} stopped answering; {other}", timeout=60_000
    )
    expect(card.locator("h3")).to_contain_text(other)
    expect(card).to_have_class(re.compile(r"\bdone\b"), timeout=120_000)  # the run's record came
    assert card.locator("p.answer").inner_text() == cold.strip() or card.locator("p.answer").text_content() == cold
    expect(card.locator(".moved-note")).to_contain_text(f"{first} stopped answering; {other} went on from its")
    expect(page.locator("#chat-log .chat-msg.assistant").last).to_have_text(
        cold
    )  # the chat's bubble: one answer, not two run together
    page.context.close()


@pytest.mark.model
@pytest.mark.cachebox
@pytest.mark.processes
@pytest.mark.browser
def test_the_run_page_waits_for_a_named_board_that_stops_and_shows_its_answer_when_it_resumes(fleet, browser):
    from playwright.sync_api import expect

    from tests.dashboard.test_api import until

    fleet.all_up()
    cold = fleet.cold_answer()
    page, card = _send_from_the_run_page(fleet, browser, boards=["right"])
    try:
        until(
            lambda: (
                card.locator(".answer.streaming").count() and len(card.locator(".answer.streaming").inner_text()) > 10
            ),
            120,
            "the first pieces on the card",
        )
        fleet.stop("right", signal.SIGSTOP)
        expect(card).to_have_attribute("data-stage", "waiting", timeout=60_000)
        expect(card.locator('[data-role="stage"]')).to_contain_text("board right stopped answering")
        expect(card.locator('[data-role="stage"]')).to_contain_text("it waits for it until")
        assert fleet.dispatched_to(card.get_attribute("data-request")) == "right" and "left" in fleet.online()
    finally:
        fleet.boards["right"].send_signal(signal.SIGCONT)
    expect(card).to_have_class(re.compile(r"\bdone\b"), timeout=120_000)
    expect(card.locator("h3")).to_contain_text("right")
    assert card.locator(".moved-note").count() == 0
    expect(page.locator("#chat-log .chat-msg.assistant").last).to_have_text(cold)
    page.context.close()


@pytest.mark.model
@pytest.mark.cachebox
@pytest.mark.processes
@pytest.mark.browser
def test_the_run_page_shows_a_clear_failure_keeping_the_streamed_text_when_a_named_board_is_killed_for_good(
    fleet, browser
):
    """left is killed mid-answer and never comes back: the run, sent to left only, waits for it while
    the page does (its expiry, 90 s here), then fails saying why, keeping the text shown."""
    from playwright.sync_api import expect

    from tests.dashboard.test_api import until

    fleet.all_up()
    cold = fleet.cold_answer()
    page, card = _send_from_the_run_page(fleet, browser, boards=["left"])
    until(
        lambda: card.locator(".answer.streaming").count() and len(card.locator(".answer.streaming").inner_text()) > 10,
        120,
        "the first pieces on the card",
    )
    fleet.stop("left", signal.SIGKILL)
    expect(card).to_have_attribute("data-stage", "waiting", timeout=60_000)
    expect(card).to_have_class(re.compile(r"\bfailed\b"), timeout=(90 + 30) * 1000)
    expect(card.locator(".error")).to_contain_text("left stopped answering")
    expect(card.locator(".answer.partial")).not_to_be_empty(timeout=30_000)  # the record keeps what was shown
    shown = card.locator(".answer.partial").text_content()
    assert cold.startswith(shown) and 0 < len(shown) < len(cold)
    run = fleet.stack.run_row(card.get_attribute("data-request"))
    assert run["error"].startswith("lost: board left stopped answering") and run["text"] == shown
    page.context.close()


@pytest.mark.model
@pytest.mark.cachebox
@pytest.mark.processes
@pytest.mark.browser
def test_an_open_run_page_shows_a_run_that_expired_unstarted_as_failed_with_the_reason_when_it_happens(fleet, browser):
    """ghost never starts: at its expiry (EDGECACHE_TASK_EXPIRES, 90 s here) the run fails, and the
    page, still listening, says so then (not after it stopped listening, a minute later)."""
    import time

    from playwright.sync_api import expect

    page, card = _send_from_the_run_page(fleet, browser, boards=["ghost"])
    sent = time.monotonic()
    expect(card).to_have_class(re.compile(r"\bfailed\b"), timeout=(90 + 20) * 1000)
    took = time.monotonic() - sent
    expect(card.locator(".error")).to_contain_text("expired")
    print(f"the expired run was shown failed {took:.1f} s after it was sent (expiry 90 s)")
    assert took < 90 + 15
    page.context.close()


@pytest.mark.cachebox
def test_a_runs_started_stage_is_published_without_waiting_and_still_heard_first(valkey_url):
    """The "started" stage goes out without the board waiting for the cache box's answer (the engine
    starts meanwhile); the next event reads that answer first, so the follower hears them in order,
    and the connection goes back to the pool."""
    import uuid

    import redis

    from cachebox.keys import stream_channel
    from cachebox.store import CacheBox
    from inference.board.streaming import StreamPublisher
    from inference.contract.messages import StreamEvent
    from tests.inference.test_edge import board_identity

    me = board_identity("unanswered")
    request_id = str(uuid.uuid4())
    listener = redis.Redis.from_url(valkey_url).pubsub()
    listener.subscribe(stream_channel("unanswered", request_id))
    assert listener.get_message(timeout=5)["type"] == "subscribe"  # listening before anything is published
    store = CacheBox(valkey_url)
    pool = store.redis.connection_pool
    stream = StreamPublisher(store, request_id, me)
    started = StreamEvent(type="stage", request_id=request_id, device="unanswered", stage="started")
    stream.send(started, now=True, unanswered=True)
    assert stream._unanswered is not None and len(pool._in_use_connections) == 1  # sent, its answer not read
    for text in ("Once", " upon"):
        event = StreamEvent(type="token", request_id=request_id, device="unanswered", index=stream.count(), text=text)
        stream.send(event, now=True)
    stream.close(StreamEvent(type="done", request_id=request_id, device="unanswered", text="Once upon"))
    heard = []
    while len(heard) < 4:
        message = listener.get_message(timeout=5)
        assert message is not None, f"heard only {heard}"
        opened = StreamEvent.open(
            message["data"], request_id=request_id, signer_public_key=me.keys.signing_public_key, ring_for=me.ring_for
        )
        heard.append((opened.type, opened.stage or opened.text))
    assert heard == [("stage", "started"), ("token", "Once"), ("token", " upon"), ("done", "Once upon")]
    assert stream._unanswered is None and not pool._in_use_connections  # every answer read, every connection back
    listener.close()


@pytest.mark.cachebox
def test_an_unanswered_publish_that_is_never_followed_is_answered_when_its_stream_closes(valkey_url):
    import uuid

    from cachebox.store import CacheBox
    from inference.board.streaming import StreamPublisher
    from inference.contract.messages import StreamEvent
    from tests.inference.test_edge import board_identity

    me = board_identity("closing")
    store = CacheBox(valkey_url)
    request_id = str(uuid.uuid4())
    stream = StreamPublisher(store, request_id, me)
    stream.send(
        StreamEvent(type="stage", request_id=request_id, device="closing", stage="started"), now=True, unanswered=True
    )
    answer = stream._unanswered
    stream.close()
    assert answer() == 0  # nobody listened; read once, when the stream closed
    assert not store.redis.connection_pool._in_use_connections

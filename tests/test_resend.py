"""Re-sends that continue, and busy is not dead (issue 39, item 4).

The sweeper's verdicts on the real database and a real Valkey (``actions.sweeper``): a board heard
on a run's stream is alive whatever its heartbeats say; a run sent to a named board is never moved
(it waits while its client does, then fails with the reason and the answer its client had); a
routed run moves once, and its follower sends it to the new board with what it streamed. The
processes' part (real boards killed and stopped mid-answer, the official `openai` client and the
Run page) is at the end of this file.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

pytestmark = pytest.mark.django_db(transaction=False)


@pytest.fixture
def fleet(settings, valkey_url, monkeypatch):
    """Two enrolled boards of one namespace, beating every second, and what is sent to them."""
    from django.utils import timezone

    from dashboard.models import Device

    from .test_dashboard import enrolled, register

    settings.REDIS_URL = valkey_url
    settings.EDGECACHE_BOARD_ACL = False
    sent: list[tuple[str, dict]] = []
    monkeypatch.setattr("dashboard.actions.runs.send_to_board", lambda device, task, message, expires: sent.append((device.name, message)))
    first, first_token = register("first")
    second, second_token = register("second")
    keys = {"first": enrolled(first, first_token), "second": enrolled(second, second_token)}
    Device.objects.filter(name__in=["first", "second"]).update(last_seen=timezone.now(), status={"heartbeat_s": 1, "fingerprint": "00ff00ff00ff00ff"})
    first.refresh_from_db()
    return {"first": first, "second": second, "keys": keys, "sent": sent}


def _dispatch(fleet, *, routed: bool, allowed=None) -> str:
    from dashboard import actions, routing

    spec = actions.run_request(segments=["Tell me a story."], max_tokens=40, title="waiting", stream=True)  # its client follows it
    record = {"policy": "cache-aware", **({"allowed": allowed} if allowed else {})}
    chosen = routing.Routed(fleet["first"], record) if routed else None
    return actions.dispatch_run(None, [fleet["first"]], spec, routed=chosen)[0]["request_id"]


def _first_went_quiet(seconds: float = 10):
    """``seconds`` on: first stopped beating right after it took the run; second beats on."""
    from django.utils import timezone

    from dashboard.models import Device

    later = timezone.now() + timedelta(seconds=seconds)
    Device.objects.filter(name="second").update(last_seen=later)
    return later


@pytest.mark.cachebox
def test_a_board_heard_on_a_runs_stream_is_alive_whatever_its_heartbeats_say(fleet):
    from dashboard.actions import runs, sweeper

    request_id = _dispatch(fleet, routed=True)
    later = _first_went_quiet()
    runs.heard("first", "0" * 8 + "-0000-0000-0000-" + "0" * 12, now=later.timestamp() - 2)  # decoding another run, 2 s ago
    assert sweeper.sweep(later) == {"answered": 0, "resent": 0, "lost": 0, "waiting": 0}
    assert [name for name, _ in fleet["sent"]] == ["first"]
    # Silent on every stream as well as in its heartbeats: now it is quiet.
    counts = sweeper.sweep(_first_went_quiet(15))
    assert counts["resent"] == 1, request_id


@pytest.mark.cachebox
def test_a_run_sent_to_a_named_board_is_never_moved_it_waits_then_fails_keeping_the_answer_its_client_had(fleet):
    from dashboard import actions
    from dashboard.actions import runs, sweeper
    from dashboard.models import Dispatch, InferenceRun

    from .test_dashboard import result_payload

    from django.utils import timezone

    request_id = _dispatch(fleet, routed=False)
    runs.heard("first", request_id, now=timezone.now().timestamp())  # it took the run and streamed some of it
    later = _first_went_quiet()
    assert sweeper.sweep(later) == {"answered": 0, "resent": 0, "lost": 0, "waiting": 1}  # second is online, yet not the board asked for
    runs.keep_streamed(request_id, "Once upon a time, a keeper")  # its client stopped following it with this much
    dispatch = Dispatch.objects.get(request_id=request_id)
    assert (dispatch.device.name, dispatch.attempt, dispatch.outcome) == ("first", 1, "")
    assert sweeper.sweep(dispatch.expires_at + timedelta(seconds=1))["lost"] == 1
    run = InferenceRun.objects.get(request_id=request_id)
    assert run.device.name == "first" and run.error.startswith("lost: board first stopped answering") and "quiet for" in run.error
    assert run.text == "Once upon a time, a keeper" and "stopped after what is shown" in run.error
    assert [name for name, _ in fleet["sent"]] == ["first"]
    # The board was paused, not gone: nobody else answered, so its late answer is the run.
    late = actions.record_run(result_payload(fleet["first"], fleet["keys"]["first"], request_id=request_id, dispatched=False, text=" a long story"))
    assert late is not None and InferenceRun.objects.get(request_id=request_id).error == ""
    assert InferenceRun.objects.get(request_id=request_id).text == " a long story"


@pytest.mark.cachebox
def test_a_routed_run_moves_once_and_its_follower_sends_it_there_going_on_from_what_it_streamed(fleet):
    from dashboard import actions
    from dashboard.actions import runs, sweeper
    from dashboard.models import Dispatch, InferenceRun

    from .test_dashboard import result_payload

    request_id = _dispatch(fleet, routed=True)
    later = _first_went_quiet()
    assert sweeper.sweep(later)["resent"] == 1
    dispatch = Dispatch.objects.get(request_id=request_id)
    assert (dispatch.device.name, dispatch.attempt, dispatch.moving) == ("second", 2, True)
    assert [name for name, _ in fleet["sent"]] == ["first"]  # not sent yet: its follower listens to second first
    assert sweeper.sweep(later)["resent"] == 0  # once
    # The follower, listening to second now, sends it with the answer its client has.
    assert runs.continue_run(request_id, "second", [10, 11, 12], "Once upon")
    assert not runs.continue_run(request_id, "second", [10, 11, 12], "Once upon")  # once
    name, message = fleet["sent"][-1]
    assert name == "second" and message["continues"] == {"tokens": [10, 11, 12], "text": "Once upon", "device": "first"}
    assert message["request_id"] == request_id and message["segments"] == ["Tell me a story."]
    assert sweeper.sweep(_first_went_quiet(10 + 2 * sweeper.HANDOVER.total_seconds()))["resent"] == 0 and len(fleet["sent"]) == 2
    # first's late answer is refused; second's is the run, and says where it came from.
    assert actions.record_run(result_payload(fleet["first"], fleet["keys"]["first"], request_id=request_id, dispatched=False)) is None
    run = actions.record_run(result_payload(fleet["second"], fleet["keys"]["second"], request_id=request_id, dispatched=False))
    assert run is not None and run.device.name == "second" and InferenceRun.objects.filter(request_id=request_id).count() == 1
    assert run.breakdown["resent_from"]["from"] == "first" and "stopped answering" in run.breakdown["resent_from"]["why"]


@pytest.mark.cachebox
def test_a_moved_run_nobody_follows_is_sent_by_the_sweeper_and_one_limited_to_its_board_waits(fleet):
    from dashboard.actions import sweeper
    from dashboard.models import Dispatch

    unfollowed = _dispatch(fleet, routed=True)
    limited = _dispatch(fleet, routed=True, allowed=["first"])  # "any board" among the ones ticked: first only
    later = _first_went_quiet()
    counts = sweeper.sweep(later)
    assert counts["resent"] == 1 and counts["waiting"] == 1
    assert Dispatch.objects.get(request_id=limited).device.name == "first"
    assert sweeper.sweep(_first_went_quiet(10 + sweeper.HANDOVER.total_seconds() + 1))["resent"] == 1  # its client's follower never sent it
    name, message = fleet["sent"][-1]
    assert name == "second" and message["request_id"] == unfollowed and "continues" not in message
    assert not Dispatch.objects.get(request_id=unfollowed).moving


@pytest.mark.cachebox
def test_a_waited_for_run_that_expires_unstarted_fails_at_its_expiry_not_a_minute_later(fleet):
    from dashboard.actions import sweeper
    from dashboard.models import Dispatch, InferenceRun

    request_id = _dispatch(fleet, routed=False)
    expires_at = Dispatch.objects.get(request_id=request_id).expires_at
    assert sweeper.sweep(expires_at - timedelta(seconds=1))["lost"] == 0
    assert sweeper.sweep(expires_at + timedelta(seconds=1))["lost"] == 1
    assert InferenceRun.objects.get(request_id=request_id).error.startswith("lost: board first did not start it before it expired")

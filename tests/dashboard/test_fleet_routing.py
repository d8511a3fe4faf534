"""Cache-aware routing on the control plane: a prompt sent to "any board" goes to the board that
holds it (from the routing history), to that board's own queue, and only it may answer.

Real Valkey and the model's real vocabulary; Celery's send_task is captured (no board runs).
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from dashboard import actions
from dashboard.models import Device, Dispatch, InferenceRun
from tests.dashboard.test_dashboard import (  # noqa: F401 (fixtures)
    control_plane,
    enrolled,
    heartbeat,
    register,
    result_payload,
    sent_tasks,
    staff_client,
)

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]

FINGERPRINT = "00ff00ff00ff00ff"
LONG_PROMPT = (
    "The history of astronomy, told one observatory at a time. " * 40 + "\nQuestion: which planet is largest?\nAnswer:"
)


def online_board(name, rates=None):
    device, token = register(name)
    keys = enrolled(device, token)
    status = {
        "model": "gemma-3-270m.gguf",
        "fingerprint": FINGERPRINT,
        "catalogs": {},
        "ram_tier": {"entries": 0, "bytes": 0, "budget_bytes": 128 * 2**20},
    }
    if rates is not None:
        status["rates"] = rates
    assert actions.record_heartbeat(heartbeat(keys, status, device=name)) is not None
    device.refresh_from_db()
    return device, keys


def send_to_any_board(client, text):
    response = client.post(
        reverse("run"),
        {"any_board": "on", "source": "text", "text": text, "max_tokens": 4, "use_cache": "on"},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 200, response.content
    (sent,) = response.json()["dispatched"]
    return sent


def report(device, keys, request_id):
    payload = result_payload(device, keys, dispatched=False, request_id=request_id, uploaded=[])
    return actions.record_run(payload)


def send_to(client, device, text):
    response = client.post(
        reverse("run"),
        {"devices": [device.pk], "source": "text", "text": text, "max_tokens": 4, "use_cache": "on"},
        HTTP_ACCEPT="application/json",
    )
    (sent,) = response.json()["dispatched"]
    return sent


def test_the_same_long_prompt_to_any_board_goes_to_the_same_board_the_second_time(
    staff_client, control_plane, sent_tasks
):
    boards = {name: online_board(name) for name in ("a-board", "b-board", "c-board")}
    # a-board and b-board are busy with other prompts: the first run goes to c-board.
    busy = [
        send_to(staff_client, boards[name][0], f"Another prompt for {name}. " * 20) for name in ("a-board", "b-board")
    ]
    first = send_to_any_board(staff_client, LONG_PROMPT)
    chosen = first["device"]
    assert chosen == "c-board" and sent_tasks[-1]["queue"] == "device.c-board"  # its own queue, not the shared one
    assert report(*boards[chosen], first["request_id"]) is not None
    for sent in busy:
        assert report(*boards[sent["device"]], sent["request_id"]) is not None

    # Every board is idle now: a cache-blind router would take the first (a-board).
    second = send_to_any_board(staff_client, LONG_PROMPT)
    assert second["device"] == chosen and sent_tasks[-1]["queue"] == f"device.{chosen}"
    routing = second["routing"]
    assert routing["source"] == "context" and routing["held_tokens"] > 256 and routing["saving_ms"] > 0
    assert routing["runner_up"] and routing["runner_up_ms"] > routing["expected_ms"]

    # Only the chosen board may answer it; its run then shows how it was routed.
    other = next(name for name in boards if name != chosen)
    assert report(*boards[other], second["request_id"]) is None
    run = report(*boards[chosen], second["request_id"])
    assert run is not None and run.routing["board"] == chosen and run.routing["source"] == "context"
    page = staff_client.get(reverse("run-detail", args=[run.pk]))
    assert b'id="run-routing"' in page.content and chosen.encode() in page.content


def test_a_busy_board_loses_a_new_prompt_and_offline_boards_get_none(staff_client, control_plane, sent_tasks):
    busy, _ = online_board("a-board")
    idle, _ = online_board("b-board")
    first = send_to_any_board(staff_client, LONG_PROMPT)
    assert first["device"] == "a-board"  # a tie: the first board
    second = send_to_any_board(staff_client, "Something else entirely. " * 30)
    assert second["device"] == "b-board"  # a-board still owes the first run
    assert Dispatch.objects.get(request_id=second["request_id"]).device == idle
    type(busy).objects.update(last_seen=None)
    response = staff_client.post(
        reverse("run"),
        {"any_board": "on", "source": "text", "text": "hi", "max_tokens": 4},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 503 and "any_board" in response.json()["errors"]
    assert InferenceRun.objects.count() == 0


def test_boards_are_weighed_by_the_rates_their_heartbeats_report_before_any_run(
    staff_client, control_plane, sent_tasks
):
    # zero (paced to a Pi Zero 2W) is first in order; with the fleet-wide prior both looked alike.
    online_board(
        "zero",
        rates={
            "prefill_ms_per_token": 39.56,
            "decode_ms_per_token": 400.0,
            "prompt_tokens": 48,
            "decode_tokens": 3,
            "compute_profile": "pi-zero-2w",
        },
    )
    online_board(
        "pi5", rates={"prefill_ms_per_token": 1.5, "decode_ms_per_token": 12.0, "prompt_tokens": 48, "decode_tokens": 3}
    )
    first = send_to_any_board(staff_client, LONG_PROMPT)
    assert first["device"] == "pi5"
    runner_up_ms = first["routing"]["runner_up_ms"]
    assert first["routing"]["runner_up"] == "zero" and runner_up_ms > 20 * first["routing"]["expected_ms"]
    # The repeat: pi5 holds it and still owes only its (short) remaining work.
    second = send_to_any_board(staff_client, LONG_PROMPT)
    assert second["device"] == "pi5" and second["routing"]["source"] == "context"
    assert (
        Dispatch.objects.get(request_id=second["request_id"]).routing["work_ms"] < 100
    )  # a hit: its answer, not a cold prefill


def test_a_heartbeat_with_unusable_rates_is_refused(control_plane):
    device, token = register("odd")
    keys = enrolled(device, token)
    status = {
        "model": "gemma-3-270m.gguf",
        "fingerprint": FINGERPRINT,
        "rates": {"prefill_ms_per_token": -1.0, "decode_ms_per_token": 10.0},
    }
    assert actions.record_heartbeat(heartbeat(keys, status, device="odd")) is None


def test_the_run_page_says_the_fleet_is_busy_past_its_bounded_queue(
    staff_client, control_plane, sent_tasks, settings, django_capture_on_commit_callbacks
):
    settings.EDGECACHE_QUEUE_PER_BOARD = 2  # runs under way per online board of the namespace
    device, keys = online_board("a-board")
    first, second = send_to(staff_client, device, "One prompt."), send_to(staff_client, device, "Another.")
    response = staff_client.post(
        reverse("run"),
        {"devices": [device.pk], "source": "text", "text": "A third.", "max_tokens": 4},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 503 and int(response["Retry-After"]) >= 1
    (error,) = response.json()["errors"]["__all__"]
    assert (
        error["code"] == "fleet_busy"
        and error["message"].startswith("The fleet is busy")
        and "try again in" in error["message"]
    )
    page = staff_client.post(
        reverse("run"), {"devices": [device.pk], "source": "text", "text": "A third.", "max_tokens": 4}
    )
    assert page.status_code == 503 and b"The fleet is busy" in page.content  # the page itself, without its script
    assert (
        Dispatch.objects.count() == 2
        and len([task for task in sent_tasks if task["name"] == "edgecache.run_prompt"]) == 2
    )  # nothing more was sent
    with django_capture_on_commit_callbacks(execute=True):
        assert report(device, keys, first["request_id"]) is not None  # an answer frees its place
    assert send_to(staff_client, device, "A third.")["device"] == "a-board"
    assert second["request_id"] != first["request_id"]


def test_a_run_sent_to_a_board_that_never_beat_keeps_its_prompts_keys(staff_client, control_plane, sent_tasks):
    """A named board waits in its queue whether or not it was ever online; its run's routing record
    still carries the prompt's keys, so the board is known to hold the prompt once it answers."""
    device, _ = register("never-beat")
    sent = send_to(staff_client, device, LONG_PROMPT)
    record = Dispatch.objects.get(request_id=sent["request_id"]).routing
    assert record["policy"] == "named" and "prompt" in record and record["work_ms"] > 0


# -- issue 42, item 4: a run goes to, and is weighed against, boards of its own namespace only --------
def tenant_board(name, namespace, rates):
    from dashboard.models import Namespace

    Namespace.objects.get_or_create(name=namespace)
    device, token = register(name, namespace_id=namespace)
    keys = enrolled(device, token)
    status = {"model": "gemma-3-270m.gguf", "fingerprint": FINGERPRINT, "catalogs": {}, "rates": rates}
    assert actions.record_heartbeat(heartbeat(keys, status, device=name)) is not None
    device.refresh_from_db()
    return device


SLOW = {"prefill_ms_per_token": 39.56, "decode_ms_per_token": 400.0, "prompt_tokens": 48, "decode_tokens": 3}
FAST = {"prefill_ms_per_token": 1.5, "decode_ms_per_token": 12.0, "prompt_tokens": 48, "decode_tokens": 3}


def test_an_admins_any_board_run_goes_only_to_boards_of_its_namespace(staff_client, control_plane, sent_tasks):
    """The walk: a `default` run named `walk-t2b`, a (faster) board of tenant walk-t2, as the next best."""
    zero, also = tenant_board("zero", "default", SLOW), tenant_board("also-zero", "default", SLOW)
    tenant_board("walk-t2b", "walk-t2", FAST)
    first = send_to_any_board(staff_client, LONG_PROMPT)  # the staff's current namespace: default
    assert first["device"] in ("zero", "also-zero") and first["routing"]["runner_up"] in ("zero", "also-zero")
    assert "walk-t2b" not in str(first["routing"]) and sent_tasks[-1]["queue"] != "device.walk-t2b"
    assert Dispatch.objects.get(request_id=first["request_id"]).namespace == "default"

    # Named, the tenant's namespace routes among its boards only.
    response = staff_client.post(
        reverse("run"),
        {"any_board": "on", "namespace": "walk-t2", "source": "text", "text": LONG_PROMPT, "max_tokens": 4},
        HTTP_ACCEPT="application/json",
    )
    (sent,) = response.json()["dispatched"]
    assert sent["device"] == "walk-t2b" and Dispatch.objects.get(request_id=sent["request_id"]).namespace == "walk-t2"

    # Ticked boards of two tenants: refused by the form, nothing sent.
    before = len(sent_tasks)
    ticked = list(Device.objects.filter(name__in=["zero", "walk-t2b"]).values_list("pk", flat=True))
    response = staff_client.post(
        reverse("run"),
        {"any_board": "on", "devices": ticked, "source": "text", "text": "hi", "max_tokens": 4},
        HTTP_ACCEPT="application/json",
    )
    assert (
        response.status_code == 400
        and "the ticked devices are of default, walk-t2" in response.json()["errors"]["any_board"][0]["message"]
    )
    assert len(sent_tasks) == before
    assert {zero.name, also.name} == {"zero", "also-zero"}


def test_the_router_refuses_to_weigh_boards_of_several_namespaces(control_plane):
    from dashboard import router

    devices = [tenant_board("zero", "default", SLOW), tenant_board("walk-t2b", "walk-t2", FAST)]
    with pytest.raises(ValueError, match="one namespace"):
        router.plan(devices, actions.run_request(segments=["hi"], max_tokens=2))
    chosen = actions.route_run(devices, actions.run_request(segments=["hi"], max_tokens=2), "default")
    assert chosen.device.name == "zero" and chosen.record.get("runner_up") in (None, "")

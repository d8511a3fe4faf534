"""Cache-aware routing on the control plane: a prompt sent to "any board" goes to the board that
holds it (from the routing history), to that board's own queue, and only it may answer.

Real Valkey and the model's real vocabulary; Celery's send_task is captured (no board runs).
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from dashboard import actions
from dashboard.models import Dispatch, InferenceRun

from .test_dashboard import control_plane, enrolled, heartbeat, register, result_payload, sent_tasks, staff_client  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]

FINGERPRINT = "00ff00ff00ff00ff"
LONG_PROMPT = "The history of astronomy, told one observatory at a time. " * 40 + "\nQuestion: which planet is largest?\nAnswer:"


def online_board(name):
    device, token = register(name)
    keys = enrolled(device, token)
    status = {"model": "gemma-3-270m.gguf", "fingerprint": FINGERPRINT, "catalogs": {}, "ram_tier": {"entries": 0, "bytes": 0, "budget_bytes": 128 * 2**20}}
    assert actions.record_heartbeat(heartbeat(keys, status, device=name)) is not None
    device.refresh_from_db()
    return device, keys


def send_to_any_board(client, text):
    response = client.post(reverse("run"), {"any_board": "on", "source": "text", "text": text, "max_tokens": 4, "use_cache": "on"}, HTTP_ACCEPT="application/json")
    assert response.status_code == 200, response.content
    (sent,) = response.json()["dispatched"]
    return sent


def report(device, keys, request_id):
    payload = result_payload(device, keys, dispatched=False, request_id=request_id, uploaded=[])
    return actions.record_run(payload)


def send_to(client, device, text):
    response = client.post(reverse("run"), {"devices": [device.pk], "source": "text", "text": text, "max_tokens": 4, "use_cache": "on"}, HTTP_ACCEPT="application/json")
    (sent,) = response.json()["dispatched"]
    return sent


def test_the_same_long_prompt_to_any_board_goes_to_the_same_board_the_second_time(staff_client, control_plane, sent_tasks):
    boards = {name: online_board(name) for name in ("a-board", "b-board", "c-board")}
    # a-board and b-board are busy with other prompts: the first run goes to c-board.
    busy = [send_to(staff_client, boards[name][0], f"Another prompt for {name}. " * 20) for name in ("a-board", "b-board")]
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
    response = staff_client.post(reverse("run"), {"any_board": "on", "source": "text", "text": "hi", "max_tokens": 4}, HTTP_ACCEPT="application/json")
    assert response.status_code == 503 and "any_board" in response.json()["errors"]
    assert InferenceRun.objects.count() == 0

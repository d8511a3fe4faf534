"""The board side of the control plane: token checks and serving a dispatched message."""

import pytest

from cachebox.store import CacheBox
from inference import devices as registry
from inference.edge import serve

from .conftest import run_manage

pytestmark = [pytest.mark.cachebox]


def publish(url, name, token, revoked=False):
    registry.publish(CacheBox(url), registry.DeviceRecord(name=name, token_sha256=registry.hash_token(token), threads=1, revoked=revoked))


@pytest.mark.parametrize(
    "registered, revoked, message",
    [(False, False, b"unknown device"), (True, False, b"wrong token"), (True, True, b"revoked")],
)
def test_edge_refuses_to_start_with_a_bad_token(valkey_url, registered, revoked, message):
    name = f"edge-{registered}-{revoked}".lower()
    if registered:
        publish(valkey_url, name, "the-right-token", revoked=revoked)
    token = "the-right-token" if revoked else "a-wrong-token"
    done = run_manage("edge", "--name", name, "--token", token, env={"REDIS_URL": valkey_url}, timeout=60)
    assert done.returncode != 0
    assert b"refused" in done.stderr and message in done.stderr


def test_edge_needs_a_token(valkey_url):
    done = run_manage("edge", "--name", "x", env={"REDIS_URL": valkey_url}, unset=("EDGECACHE_DEVICE_TOKEN",), timeout=60)
    assert done.returncode != 0 and b"--token" in done.stderr


@pytest.mark.model
def test_serve_turns_a_message_into_a_result_payload(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace, device="zero")
    message = {
        "request_id": "r-1",
        "segments": ["Instruction.\n\n", "Question: one plus one?\nAnswer:"],
        "max_tokens": 3,
        "namespace": namespace,
        "meta": {"title": "one plus one"},
    }
    payload = serve(board, message)
    assert payload["request_id"] == "r-1" and payload["error"] == "" and payload["meta"]["title"] == "one plus one"
    assert payload["prompt"] == "".join(message["segments"])
    assert payload["breakdown"]["case"] == "miss" and payload["uploaded"]
    again = serve(board, {**message, "request_id": "r-2"})
    assert again["breakdown"]["case"] == "full" and again["fetched"] and again["text"] == payload["text"]


@pytest.mark.model
def test_serve_reports_bad_prompts_instead_of_crashing(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace)
    payload = serve(board, {"request_id": "r-3", "segments": ["   "], "namespace": namespace})
    assert "empty" in payload["error"] and payload["text"] == ""
    payload = serve(board, {"request_id": "r-4", "segments": ["hi"], "sampling": {"temperature": -1}})
    assert "temperature" in payload["error"]

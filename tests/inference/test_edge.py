"""The board side of the control plane: token checks and serving a dispatched message."""

import json
import logging
import uuid

import pytest

from cachebox.events import LOGGER_NAME, JsonLineFormatter
from cachebox.signing import control_plane_key, derive_keyring, pin_proof, public_hex
from cachebox.store import CacheBox
from inference.board import EdgeIdentity, serve
from inference.board import devices as registry
from inference.board.identity import BoardKeys
from inference.contract import envelope
from inference.contract.envelope import CONTROL, Kind
from inference.contract.messages import MessageRefused, RunReport, RunRequest, Task
from tests.conftest import run_manage

pytestmark = [pytest.mark.cachebox]

CONTROL_PLANE = control_plane_key(b"the control plane's master secret")


def publish(url, name, token, revoked=False):
    """A device record as the control plane publishes it before its board enrolls."""
    record = registry.DeviceRecord(
        name=name,
        token_sha256=registry.hash_token(token),
        threads=1,
        revoked=revoked,
        pin=pin_proof(token, public_hex(CONTROL_PLANE)),
    )
    registry.publish(CacheBox(url), record, CONTROL_PLANE)


@pytest.mark.parametrize(
    "registered, revoked, message",
    [(False, False, b"unknown device"), (True, False, b"wrong or expired token"), (True, True, b"revoked")],
)
def test_edge_refuses_to_start_with_a_bad_token(valkey_url, registered, revoked, message, tmp_path):
    name = f"edge-{registered}-{revoked}".lower()
    if registered:
        publish(valkey_url, name, "the-right-token", revoked=revoked)
    token = "the-right-token" if revoked else "a-wrong-token"
    # The registry's own checks (a server without board users: EDGECACHE_BOARD_ACL=0).
    done = run_manage(
        "edge",
        "--name",
        name,
        "--token",
        token,
        env={"REDIS_URL": valkey_url, "EDGECACHE_BOARD_KEYS_DIR": str(tmp_path), "EDGECACHE_BOARD_ACL": "0"},
        timeout=60,
    )
    assert done.returncode != 0
    assert b"refused" in done.stderr and message in done.stderr
    # With board users (the default), a token that gives no enrollment user gets no further than the login.
    done = run_manage(
        "edge",
        "--name",
        name,
        "--token",
        token,
        env={"REDIS_URL": valkey_url, "EDGECACHE_BOARD_KEYS_DIR": str(tmp_path / "acl")},
        timeout=60,
    )
    assert done.returncode != 0 and b"refused" in done.stderr and b"the token is wrong, expired or spent" in done.stderr


def test_edge_needs_a_token_to_enroll_and_keeps_its_private_keys_to_itself(valkey_url, tmp_path):
    publish(valkey_url, "fresh", "the-right-token")  # registered, never enrolled
    done = run_manage(
        "edge",
        "--name",
        "fresh",
        env={"REDIS_URL": valkey_url, "EDGECACHE_BOARD_KEYS_DIR": str(tmp_path), "EDGECACHE_BOARD_ACL": "0"},
        unset=("EDGECACHE_DEVICE_TOKEN",),
        timeout=60,
    )
    assert done.returncode != 0 and b"not enrolled" in done.stderr and b"--token" in done.stderr
    key_file = tmp_path / "fresh.key"
    assert key_file.exists() and key_file.stat().st_mode & 0o777 == 0o600  # made once, readable by the board only
    assert (
        BoardKeys.load_or_create(key_file).signing_public_key == BoardKeys.load_or_create(key_file).signing_public_key
    )


@pytest.mark.model
def test_serve_turns_a_request_into_a_report(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace, device="zero")
    message = {
        "request_id": str(uuid.uuid4()),
        "segments": ["Instruction.\n\n", "Question: one plus one?\nAnswer:"],
        "max_tokens": 3,
        "namespace": namespace,
        "meta": {"title": "one plus one"},
    }
    payload = serve(board, RunRequest.parse(message)).dump()
    assert (
        payload["request_id"] == message["request_id"]
        and payload["error"] == ""
        and payload["meta"]["title"] == "one plus one"
    )
    assert payload["prompt"] == "".join(message["segments"])
    assert payload["breakdown"]["case"] == "miss" and payload["uploaded"]
    assert RunReport.parse(payload) == RunReport.parse(payload)  # what travels parses back on the other side
    again = serve(board, RunRequest.parse({**message, "request_id": str(uuid.uuid4())})).dump()
    assert again["breakdown"]["case"] == "full" and again["fetched"] and again["text"] == payload["text"]


@pytest.mark.model
def test_serve_reports_prompts_the_board_cannot_run_instead_of_crashing(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace)
    long_prompt = RunRequest.parse(
        {"request_id": str(uuid.uuid4()), "segments": ["word " * 3000], "max_tokens": 16, "namespace": namespace}
    )
    report = serve(board, long_prompt)
    assert "context holds 2048" in report.error and report.text == "" and report.request_id == long_prompt.request_id


BAD_REQUESTS = [
    (None, "must be a JSON object"),
    (["a list"], "must be a JSON object"),
    ({"segments": ["hi"]}, "request_id"),
    ({"request_id": "not-a-uuid", "segments": ["hi"]}, "request_id"),
    ({"request_id": "%s", "segments": "not a list"}, "segments"),
    ({"request_id": "%s", "segments": ["   "]}, "empty"),
    ({"request_id": "%s", "segments": ["hi"], "max_tokens": -1}, "max_tokens"),
    ({"request_id": "%s", "segments": ["hi"], "sampling": {"temperature": -1}}, "temperature"),
    ({"request_id": "%s", "segments": ["hi"], "namespace": "bad namespace!"}, "namespace"),
    ({"request_id": "%s", "segments": ["hi"], "surprise": 1}, "surprise"),
    ({"request_id": "%s", "schema": "<schema name='x'/>"}, "pml"),
]


@pytest.mark.parametrize("message, reason", BAD_REQUESTS)
def test_a_malformed_request_is_refused_with_its_reason_and_logged(message, reason, caplog):
    if isinstance(message, dict) and message.get("request_id") == "%s":
        message = {**message, "request_id": str(uuid.uuid4())}
    with pytest.raises(MessageRefused, match=reason):
        RunRequest.parse(message)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        assert RunRequest.receive(message, receiver="zero") is None
    events = [json.loads(JsonLineFormatter().format(record)) for record in caplog.records if record.name == LOGGER_NAME]
    assert events and events[-1]["event"] == "message_refused" and reason in events[-1]["reason"]


def board_identity(name: str = "zero") -> EdgeIdentity:
    """A board that pinned ``CONTROL_PLANE`` and holds the ``default`` namespace's ring."""
    keys = BoardKeys.generate().pinned(public_hex(CONTROL_PLANE))
    ring = derive_keyring(b"the control plane's master secret", "default", 1)
    return EdgeIdentity(
        name, keys, registry.DeviceRecord(name=name, signing_key=keys.signing_public_key), store=None, ring=ring
    )


def test_the_board_task_answers_a_malformed_request_with_an_error_report_and_keeps_running(monkeypatch, caplog):
    """A worker never crashes on a bad message; an authentic one that names its request is answered,
    so it is not lost. What the control plane did not sign for this board is refused and answered
    with nothing (its request id cannot be trusted)."""
    from inference import board as edge
    from inference.board import tasks

    me = board_identity()
    sent = []
    monkeypatch.setattr(tasks, "identity", lambda: me)
    monkeypatch.setattr(edge.outbox, "report", lambda message, task=Task.RECORD_RUN: sent.append((task, message)))

    def sealed(message, *, to="zero", signer=CONTROL_PLANE):
        return envelope.seal(message, kind=Kind.RUN, sender=CONTROL, to=to, signer=signer, ring=me.ring, ttl=60)

    request_id = str(uuid.uuid4())
    tasks.answer_run(sealed({"request_id": request_id, "segments": 42}))  # would have been TypeError in serve()
    tasks.answer_run(sealed({"segments": ["no id"]}))  # nothing to answer: dropped, logged
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        for forged in (
            {"request_id": str(uuid.uuid4()), "segments": ["unsigned"]},  # the old, unsigned format
            sealed({"request_id": str(uuid.uuid4()), "segments": ["hi"]}, to="pi5"),  # for another board
            sealed(
                {"request_id": str(uuid.uuid4()), "segments": ["hi"]},
                signer=control_plane_key(b"an attacker's own master secret!"),
            ),
        ):
            tasks.answer_run(forged)
    assert len(sent) == 1
    task, report = sent[0]
    assert (
        task == Task.RECORD_RUN
        and report.request_id == request_id
        and "refused by the board" in report.error
        and "segments" in report.error
    )
    refused = [
        json.loads(JsonLineFormatter().format(r))
        for r in caplog.records
        if r.name == LOGGER_NAME and r.getMessage() == "request_refused"
    ]
    reasons = [event["reason"] for event in refused]
    assert len(reasons) == 3 and all(
        any(phrase in reason for reason in reasons)
        for phrase in ("not a signed", "addressed to 'pi5'", "not signed by")
    )


def test_a_run_sealed_before_the_boards_last_work_ended_waited_behind_it():
    from inference.board.tasks import _Work

    try:
        _Work.ended = 1000.5
        assert _Work.behind_ms({"ts": 1000.25}) == 250.0  # sealed while the board was busy
        assert _Work.behind_ms({"ts": 1000.75}) == 0.0  # sealed after: the board was free
        assert _Work.behind_ms({"ts": "x"}) == _Work.behind_ms({}) == _Work.behind_ms(None) == 0.0
        # Counted from the request's arrival at the API when it says (its dispatch came later).
        assert _Work.behind_ms({"ts": 1000.75}, received_at=1000.0) == 500.0
        assert _Work.behind_ms({"ts": 1000.25}, received_at=1000.6) == 0.0
    finally:
        _Work.ended = 0.0

"""The control inbox runs only EdgeCache's messages: the probe of issue 39 replayed.

A board of tenant ``globex`` (``mallory``, whose credentials the attacker holds) and an enrollment
user tried to make the control worker run Celery's canvas tasks (``celery.group`` with a subtask
routed to another tenant's queue), which then published as the deployment. Here every way in is
tried against a real Valkey with ACLs: the control queue refuses a board's write, and what a board
may write (its own inbox) is refused by the drain before anything runs; nothing is written anywhere;
another tenant's board keeps being heard, whatever ``mallory`` floods.
"""

from __future__ import annotations

import json
import logging
import uuid

import pytest
import redis
from redis.exceptions import NoPermissionError

from dashboard.bench.sim_board import task_message
from dashboard.worker.inbox import BOARD, ENROLLING, Accepted, ControlInbox, accept
from inference.contract.envelope import Kind
from inference.contract.messages import MAX_INBOX_MESSAGE_BYTES, Task

CANVAS = (
    "celery.group",
    "celery.chain",
    "celery.chord",
    "celery.map",
    "celery.starmap",
    "celery.chunks",
    "celery.accumulate",
    "celery.chord_unlock",
)


def canvas_probe(task: str) -> bytes:
    """A raw Celery message naming a canvas task whose subtask is routed into another tenant's
    queue and would write that board's bookkeeping (what the probe sent)."""
    subtask = {
        "task": "edgecache.run_prompt",
        "args": [{}],
        "kwargs": {},
        "options": {"queue": "device.zero"},
        "subtask_type": None,
        "immutable": False,
    }
    return task_message(task, [[subtask]] if task != "celery.chunks" else [subtask, [[1]], 1], queue="control")


# -- pure: what an inbox may carry -----------------------------------------------------------------
@pytest.mark.parametrize("task", CANVAS)
def test_a_celery_canvas_message_on_an_inbox_is_refused(task):
    for kind in (BOARD, ENROLLING):
        verdict = accept(kind, "mallory", canvas_probe(task))
        assert isinstance(verdict, str) and "not an EdgeCache inbox message" in verdict


def test_an_inbox_carries_only_its_own_kind_of_message_from_its_own_device():
    def message(task, body) -> bytes:
        return json.dumps({"task": task, "body": body}).encode()

    report = {"v": 1, "kind": "report", "from": "mallory", "to": "control", "ts": 1.0}
    assert accept(BOARD, "mallory", message("edgecache.record_run", report)) == Accepted(Task.RECORD_RUN, report)
    assert "names 'zero'" in accept(BOARD, "mallory", message("edgecache.record_run", {**report, "from": "zero"}))
    assert "may not come from a board" in accept(BOARD, "mallory", message("edgecache.enroll", {"device": "mallory"}))
    assert "may not come from a board" in accept(
        BOARD, "mallory", message("edgecache.run_prompt", report)
    )  # boards' own work
    assert "may not come from a enrolling" in accept(
        ENROLLING, "newbie", message("edgecache.record_run", {**report, "from": "newbie"})
    )
    assert "names 'zero'" in accept(ENROLLING, "newbie", message("edgecache.enroll", {"device": "zero"}))
    assert accept(ENROLLING, "newbie", message("edgecache.enroll", {"device": "newbie"})) == Accepted(
        Task.ENROLL, {"device": "newbie"}
    )
    assert "not an EdgeCache inbox message" in accept(BOARD, "mallory", message("celery.group", report))
    assert "not an EdgeCache inbox message" in accept(
        BOARD, "mallory", json.dumps({"task": "edgecache.record_run", "body": report, "options": {}}).encode()
    )
    assert "not an EdgeCache inbox message" in accept(BOARD, "mallory", b"\xff not json")
    assert "larger than" in accept(BOARD, "mallory", b" " * (MAX_INBOX_MESSAGE_BYTES + 1))


def test_a_control_worker_and_a_board_run_only_edgecaches_own_tasks():
    from celery.signals import worker_init

    from dashboard.celery import app
    from inference.board.app import BOARD_TASKS, board_app
    from inference.contract.messages import CONTROL_TASKS

    assert "celery.group" in app.tasks  # what Celery registers for every app
    worker_init.send(sender=type("Worker", (), {"app": app})())
    assert set(app.tasks) == {task.value for task in CONTROL_TASKS}
    assert not any(name.startswith("celery.") for name in app.tasks)
    assert set(board_app("redis://127.0.0.1:1/0").tasks) == BOARD_TASKS
    app.set_default()


# -- real: a Valkey with ACLs, the board's and the enrollment user's own credentials --------------


@pytest.fixture
def plane(settings, monkeypatch, tmp_path_factory):
    from cachebox import acl, embedded
    from dashboard import actions
    from dashboard.models import Namespace
    from tests.dashboard.test_dashboard import enrolled
    from tests.security.test_board_acl import PASSWORD

    data_dir = tmp_path_factory.mktemp("inbox")
    port = embedded._low_free_ports(1)[0]
    url = embedded.ensure_running(data_dir, port=port, maxmemory="256mb", password=PASSWORD)
    settings.REDIS_URL = url
    settings.EDGECACHE_CACHEBOX_URL = ""
    settings.EDGECACHE_BOARD_ACL = True
    monkeypatch.setattr("dashboard.actions.identities.declare_queue", lambda device: None)
    boards = {}
    for name, namespace in (("zero", "acme"), ("mallory", "globex")):
        Namespace.objects.get_or_create(name=namespace)
        device, token = actions.register_device(None, name=name, cpu_threads=1, namespace_id=namespace)
        boards[name] = enrolled(device, token)
    newbie, newbie_token = actions.register_device(None, name="newbie", cpu_threads=1, namespace_id="globex")
    admin = redis.Redis(port=port, username="default", password=PASSWORD, socket_timeout=10)
    yield {"port": port, "keys": boards, "newbie_token": newbie_token, "admin": admin}
    for user in admin.execute_command("ACL", "USERS"):
        if user.decode().startswith((acl.BOARD_USER_PREFIX, acl.ENROLL_USER_PREFIX)):
            admin.execute_command("ACL", "DELUSER", user)
    admin.flushall()
    embedded.stop(data_dir, port, password=PASSWORD)


def _as_board(plane, name):
    from cachebox import acl

    return redis.Redis(
        port=plane["port"], username=acl.board_user(name), password=plane["keys"][name].redis_password, socket_timeout=5
    )


def _as_enrolling(plane, name):
    from cachebox import acl
    from inference.board.identity import enrollment_redis_password

    return redis.Redis(
        port=plane["port"],
        username=acl.enroll_user(name),
        password=enrollment_redis_password(plane["newbie_token"]),
        socket_timeout=5,
    )


def _keys(admin) -> dict[bytes, bytes]:
    """Every key and its type, but the inboxes drained and the control plane's count of refusals."""
    skip = (b"ec:inbox:", b"ec:enroll:", b"edgecache:security-events")
    return {key: admin.type(key) for key in admin.scan_iter(count=1000) if not key.startswith(skip)}


def _report(plane, name: str) -> bytes:
    from tests.dashboard.test_dashboard import board_message

    body = board_message(
        plane["keys"][name], name, Kind.REPORT, {"device": name, "request_id": str(uuid.uuid4()), "text": "x"}
    )
    return json.dumps({"task": Task.RECORD_RUN.value, "body": body}).encode()


@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_probe_from_a_board_and_an_enrollment_user_runs_nothing_and_writes_nothing(plane, caplog):
    mallory, newbie = _as_board(plane, "mallory"), _as_enrolling(plane, "newbie")
    for client in (mallory, newbie):
        for queue in ("control", "device.zero", "boards.acme", "celery"):
            with pytest.raises(NoPermissionError):
                client.lpush(queue, canvas_probe("celery.group"))
    for task in CANVAS:
        mallory.lpush("ec:inbox:mallory", canvas_probe(task))
        newbie.lpush("ec:enroll:newbie", canvas_probe(task))
    newbie.lpush("ec:enroll:newbie", _report(plane, "mallory"))  # an enrollment user sends an enrollment, nothing else
    before = _keys(plane["admin"])
    sent = []
    inbox = ControlInbox(send=lambda name, args=None, queue=None: sent.append(name))
    with caplog.at_level(logging.WARNING, logger="edgecache.security"):
        while (
            inbox.drain_once(wait_s=0.2)
            or plane["admin"].llen("ec:inbox:mallory")
            or plane["admin"].llen("ec:enroll:newbie")
        ):
            pass
    assert sent == []  # nothing handed to any task
    refused = [r.security_fields for r in caplog.records if r.getMessage() == "inbox_message_refused"]
    assert len(refused) == 2 * len(CANVAS) + 1 and {r["device"] for r in refused} == {"mallory", "newbie"}
    after = _keys(plane["admin"])
    assert after == before  # no key created or changed in type: no list planted at unacked.*, nothing queued
    assert not any(key.startswith((b"unacked", b"device.", b"boards.", b"control")) for key in after)

    # What boards may send still arrives: mallory's own report, handed to the report's task.
    mallory.lpush("ec:inbox:mallory", _report(plane, "mallory"))
    assert inbox.drain_once(wait_s=1) == 1 and sent == [Task.RECORD_RUN.value]


@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_board_flooding_its_inbox_delays_no_other_board(plane):
    mallory, zero = _as_board(plane, "mallory"), _as_board(plane, "zero")
    flood = _report(plane, "mallory")
    pipe = mallory.pipeline(transaction=False)
    for _ in range(20_000):
        pipe.lpush("ec:inbox:mallory", flood)
    pipe.execute()
    zero.lpush("ec:inbox:zero", _report(plane, "zero"))
    seen = []
    inbox = ControlInbox(send=lambda name, args=None, queue=None: seen.append(args[0]["from"]))
    for _ in range(2):  # two turns: one of them is zero's, whatever mallory queued
        inbox.drain_once(wait_s=1)
    assert "zero" in seen and len(seen) <= 2 * ControlInbox.TAKE


def test_the_inboxes_are_served_round_robin_whatever_their_order(monkeypatch):
    """Of a thousand inboxes, the one after a flooded one is served at the next turn (a turn starts
    after the inbox served last), not after the flood had a turn for each inbox before it."""
    from dashboard.worker import inbox as module

    names = [f"board-{index:04d}" for index in range(1000)]
    lists = {module.inbox_key(name): [] for name in names}
    lists[module.inbox_key("board-0500")] = [b"flood"] * 100_000
    lists[module.inbox_key("board-0501")] = [b"report"]

    class Broker:
        def pop_from_any(self, order, count, wait_s):
            for key in order:
                if lists[key]:
                    taken, lists[key][:] = lists[key][:count], lists[key][count:]
                    return key, taken
            return None

    monkeypatch.setattr(module, "broker_server", lambda: Broker())
    monkeypatch.setattr(module, "accept", lambda kind, device, raw: Accepted(Task.RECORD_RUN, {"from": device}))
    served = []
    drain = ControlInbox(send=lambda name, args=None, queue=None: served.append(args[0]["from"]))
    drain._keys = module.inbox_keys(names, [])
    drain._order, drain._roster_at = sorted(drain._keys), float("inf")
    drain.drain_once(0)
    drain.drain_once(0)
    assert served[-1] == "board-0501" and served.count("board-0500") == ControlInbox.TAKE


@pytest.mark.django_db
@pytest.mark.cachebox
def test_two_hundred_thousand_heartbeats_from_one_board_keep_every_other_board_online(plane):
    from dashboard.actions.devices import HeartbeatBatch
    from dashboard.models import Device
    from tests.dashboard.test_dashboard import heartbeat

    mallory, zero = _as_board(plane, "mallory"), _as_board(plane, "zero")
    zero.psetex(
        "ec:hb:zero",
        60_000,
        json.dumps(heartbeat(plane["keys"]["zero"], {"model": "zero's", "heartbeat_s": 5}, device="zero")),
    )
    beat = json.dumps(heartbeat(plane["keys"]["mallory"], {"model": "flood", "heartbeat_s": 5}, device="mallory"))
    for start in range(0, 200_000, 10_000):  # validly signed, as fast as the server takes them
        pipe = mallory.pipeline(transaction=False)
        for _ in range(10_000):
            pipe.psetex("ec:hb:mallory", 60_000, beat)
        pipe.execute()
    assert plane["admin"].dbsize() < 20  # one key per board, however often it beats
    batch = HeartbeatBatch()
    assert batch.take() == 2 and batch.flush() == 2  # each board's latest, read once
    assert Device.objects.get(name="zero").online and Device.objects.get(name="zero").status["model"] == "zero's"
    with pytest.raises(NoPermissionError):
        mallory.psetex("ec:hb:zero", 60_000, beat)  # nor can it beat for another board

"""Processes killed for real: a board in the middle of a task, and the control plane.

A private control plane (its own EDGECACHE_HOME: SQLite database and embedded Valkey)
with its Celery worker and one real board (`manage.py edge`, the real model). Messages
are acknowledged late, so work of a killed process waits in the broker until a process
takes it again, and runs are stored once per request id.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from dashboard.outbox import control_worker_argv
from tests.conftest import control_plane_password, opened_text
from tests.stack import ProcessPlane

pytestmark = [pytest.mark.model, pytest.mark.cachebox]

# Seconds before a dead worker's messages are handed out again: longer than the task takes.
VISIBILITY_TIMEOUT = 20


def _request_id(message: bytes) -> str | None:
    """The request id a Celery message carries, as kombu's Redis transport stores it (JSON, base64
    body): the id of its sealed envelope (the request itself is sealed)."""
    celery_message = json.loads(message)
    body = json.loads(base64.b64decode(celery_message["body"]))
    args = body[0] if isinstance(body, list) else body.get("args", [])
    return args[0].get("id") if args and isinstance(args[0], dict) else None


def queued_requests(client: redis.Redis, queue: str) -> set[str]:
    return {_request_id(raw) for raw in client.lrange(queue, 0, -1)}


def inbox_requests(client: redis.Redis, board: str = "solo") -> set[str]:
    """The request ids of the reports waiting in a board's inbox (``ec:inbox:NAME``)."""
    return {json.loads(raw)["body"].get("id") for raw in client.lrange(f"ec:inbox:{board}", 0, -1)}


def unacked_requests(client: redis.Redis, board: str = "solo") -> set[str]:
    """The requests a board holds unacknowledged (under its own keys: ``unacked.NAME``)."""
    return {_request_id(json.dumps(json.loads(raw)[0]).encode()) for raw in client.hvals(f"unacked.{board}")}


def until(condition, timeout: float, what: str, every: float = 0.2):
    """Poll ``condition`` until it is truthy (returns its value) or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            print(f"{what}: {timeout - (deadline - time.monotonic()):.1f} s")
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Plane(ProcessPlane):
    def __init__(self, home: Path):
        env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "DATABASE_URL")}
        env.update(
            {
                "EDGECACHE_HOME": str(home),
                "EDGECACHE_N_CTX": "2048",
                "EDGECACHE_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
                "EDGECACHE_RESTORE_INTERVAL": "1",
                "EDGECACHE_SWEEP_SECONDS": "1",
            }
        )
        super().__init__(home, env)

    def control_worker(self) -> subprocess.Popen:
        return self.spawn(
            "control",
            control_worker_argv("control", "info"),
        )

    def board(self, token: str, name: str = "solo", heartbeat: float = 5) -> subprocess.Popen:
        """A board process; one beating every second (``heartbeat=1``) is seen dead in ~4 s, not ~20."""
        log = "board" if name == "solo" else f"board-{name}"
        before = self.log(log).count(f"board {name} ready") if (self.home / f"{log}.log").exists() else 0
        process = self.spawn(
            log,
            [sys.executable, "manage.py", "edge", "--name", name, "--heartbeat", str(heartbeat)],
            {"EDGECACHE_DEVICE_TOKEN": token},
        )
        until(
            lambda: self.log(log).count(f"board {name} ready") > before or process.poll() is not None,
            120,
            f"board {name} to load its model",
        )
        assert process.poll() is None, self.log(log)
        return process

    def runs(self, request_id: str | None = None) -> int:
        with sqlite3.connect(f"file:{self.home / 'db.sqlite3'}?mode=ro", uri=True) as db:
            if request_id is None:
                return db.execute("select count(*) from dashboard_inferencerun").fetchone()[0]
            return db.execute(
                "select count(*) from dashboard_inferencerun where replace(request_id, '-', '') = ?",
                (request_id.replace("-", ""),),
            ).fetchone()[0]

    def run_fields(self, request_id: str, *columns: str) -> tuple:
        with sqlite3.connect(f"file:{self.home / 'db.sqlite3'}?mode=ro", uri=True) as db:
            quoted = ", ".join(f'"{column}"' for column in columns)  # "case" is an SQL keyword
            query = f"select {quoted} from dashboard_inferencerun where replace(request_id, '-', '') = ?"
            row = db.execute(query, (request_id.replace("-", ""),)).fetchone()
        # prompts and answers are sealed at rest (dashboard.security.at_rest)
        return tuple(
            opened_text(self.home, value) if column in ("prompt", "text", "title") else value
            for column, value in zip(columns, row)
        )

    def devices(self) -> int:
        with sqlite3.connect(f"file:{self.home / 'db.sqlite3'}?mode=ro", uri=True) as db:
            return db.execute("select count(*) from dashboard_device").fetchone()[0]

    def dispatch(
        self,
        max_tokens: int,
        expires: int | None = None,
        stream: bool = False,
        text: str = "Write a long story about a lighthouse keeper and the sea.",
        any_board: bool = False,
    ) -> str:
        """Send a run to solo (``stream``: as the Run page does, whose client waits for it;
        ``any_board``: as the router chose solo for a run sent to any board, so it may move)."""
        routed = "router.Routed(solo, {'policy': 'cache-aware'})" if any_board else "None"
        return self.shell(
            "from dashboard import actions, router; from dashboard.models import Device; solo = Device.objects.get(name='solo'); "
            "print(actions.dispatch_run(None, [solo], actions.run_request("
            f"segments=[{text!r}], max_tokens={max_tokens}, title='fault', stream={stream!r}), routed={routed})[0]['request_id'])",
            env={"EDGECACHE_TASK_EXPIRES": str(expires)} if expires else None,
        )

    def run_device(self, request_id: str) -> str:
        with sqlite3.connect(f"file:{self.home / 'db.sqlite3'}?mode=ro", uri=True) as db:
            return db.execute(
                "select d.name from dashboard_inferencerun r join dashboard_device d on d.id = r.device_id where replace(r.request_id, '-', '') = ?",
                (request_id.replace("-", ""),),
            ).fetchone()[0]


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = Plane(tmp_path_factory.mktemp("plane"))
    url = plane.manage("cachebox", "start").split(" at ")[1].split(" ")[0]
    plane.manage("migrate", "--verbosity", "0")
    plane.token = plane.shell(
        "from dashboard import actions; print(actions.register_device(None, name='solo', cpu_threads=1)[1])"
    )
    plane.redis = redis.Redis.from_url(url, username="default", password=control_plane_password(plane.home))
    try:
        yield plane
    finally:
        for process in plane.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
        plane.manage("cachebox", "stop")


def test_a_board_killed_mid_task_gets_it_again_and_the_run_is_stored_once(plane):
    control = plane.control_worker()
    board = plane.board(plane.token)
    request_id = plane.dispatch(max_tokens=120)
    # The board took the message (it sits in the broker's unacknowledged set) and is running it.
    until(lambda: plane.redis.hlen("unacked.solo") > 0, 30, "the board to take the task")
    board.send_signal(signal.SIGKILL)
    board.wait(timeout=30)
    assert plane.runs(request_id) == 0, "the board finished before it was killed: make the task longer"
    assert request_id in unacked_requests(plane.redis)  # the message was not lost with the process

    plane.board(plane.token)  # the board comes back (same device, same token)
    until(lambda: plane.runs(request_id) == 1, 120, "the redelivered run to be stored")
    until(
        lambda: (
            plane.redis.hlen("unacked.solo") == 0
            and plane.redis.llen("device.solo") == 0
            and plane.redis.llen("control") == 0
            and plane.redis.llen("ec:inbox:solo") == 0
        ),
        60,
        "the queues to drain",
    )
    assert plane.runs(request_id) == 1 and plane.runs() == 1
    assert control.poll() is None


def test_a_control_plane_restart_loses_no_run_and_no_device(plane):
    control = next(p for p in plane.processes if "control" in " ".join(p.args) and p.poll() is None)
    before = plane.runs()
    control.send_signal(signal.SIGKILL)  # the control plane dies without warning
    control.wait(timeout=30)
    request_id = plane.dispatch(max_tokens=4)
    # The board answers and reports while no control plane listens: the report waits in its inbox.
    until(lambda: request_id in inbox_requests(plane.redis), 120, "the board's report to be queued")
    assert plane.runs(request_id) == 0
    plane.control_worker()
    until(lambda: plane.runs(request_id) == 1, 60, "the queued report to be stored")
    assert plane.runs() == before + 1 and plane.devices() == 1


def test_a_run_that_waits_past_its_expiry_is_recorded_as_expired_not_lost(plane):
    """A board away longer than EDGECACHE_TASK_EXPIRES does not replay the stale run when it returns, and says so."""
    for process in plane.processes:
        if "edge" in process.args and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
    before = plane.runs()
    request_id = plane.dispatch(max_tokens=4, expires=2)
    sent_by = time.monotonic()
    assert request_id in queued_requests(plane.redis, "device.solo")  # waiting for a board
    time.sleep(max(0.0, sent_by + 2.5 - time.monotonic()))  # past the deadline the message carries

    plane.board(plane.token)
    until(lambda: plane.runs(request_id) == 1, 60, "the expired run to be recorded")
    error, text, case = plane.run_fields(request_id, "error", "text", "case")
    assert error.startswith("expired: no board of solo started it") and "send it again" in error
    assert text == "" and case == ""  # it never ran
    until(
        lambda: plane.redis.llen("device.solo") == 0 and plane.redis.hlen("unacked.solo") == 0, 30, "the queue to drain"
    )
    assert plane.runs() == before + 1


def _kill_boards(plane) -> None:
    for process in plane.processes:
        if "edge" in process.args and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)


def test_a_run_replayed_after_the_board_restarts_within_its_expiry_is_refused(plane):
    """The probe: a run request pushed again onto a board's queue after the board restarted, within
    its expiry, ran again (303 stream events). The board now keeps the requests it answered on its
    disk until they expire: the same signed envelope is refused, and nothing is streamed."""
    _kill_boards(plane)
    if not any("control" in " ".join(map(str, process.args)) and process.poll() is None for process in plane.processes):
        plane.control_worker()
    request_id = plane.dispatch(max_tokens=4, stream=True)
    [captured] = [raw for raw in plane.redis.lrange("device.solo", 0, -1) if _request_id(raw) == request_id]  # as sent
    board = plane.board(plane.token)
    until(lambda: plane.runs(request_id) == 1, 120, "the run to be answered")
    until(
        lambda: plane.redis.hlen("unacked.solo") == 0 and plane.redis.llen("device.solo") == 0,
        60,
        "the board to acknowledge it",
    )
    board.send_signal(signal.SIGTERM)  # a restart: the board stops and comes back
    board.wait(timeout=60)
    plane.board(plane.token)
    refusal = "replayed: answered already"
    before = plane.log("board").count(refusal)
    streams = plane.redis.pubsub()
    streams.psubscribe("ec:stream:solo:*")
    until(lambda: streams.get_message(timeout=1), 10, "the stream subscription")  # its confirmation
    plane.redis.lpush("device.solo", captured)  # the replay, still within its expiry
    until(lambda: plane.log("board").count(refusal) > before, 60, "the board to refuse the replay")
    until(
        lambda: plane.redis.hlen("unacked.solo") == 0 and plane.redis.llen("device.solo") == 0, 60, "the queue to drain"
    )
    events = []
    while (message := streams.get_message(timeout=0.5)) is not None:
        events.append(message)
    streams.close()
    assert events == [], f"the replayed run streamed {len(events)} events"
    assert plane.runs(request_id) == 1


def test_a_board_killed_mid_run_with_its_client_waiting_hands_the_run_to_another_board(plane):
    """kill -9 while a run sent to any board is on the board and its client (the Run page) waits:
    the sweeper sees the board stop beating and moves the run once to another board of the
    namespace, which answers (nobody follows it here, so the sweeper sends it after ``HANDOVER``)."""
    _kill_boards(plane)
    if (
        not plane.shell("from dashboard.models import Device; print(Device.objects.filter(name='spare').exists())")
        == "True"
    ):
        plane.spare_token = plane.shell(
            "from dashboard import actions; print(actions.register_device(None, name='spare', cpu_threads=1)[1])"
        )
    plane.board(plane.spare_token, "spare", heartbeat=1)
    solo = plane.board(plane.token, heartbeat=1)
    request_id = plane.dispatch(max_tokens=160, stream=True, any_board=True)
    until(lambda: plane.redis.hlen("unacked.solo") > 0, 60, "solo to take the run")
    solo.send_signal(signal.SIGKILL)
    solo.wait(timeout=30)
    assert plane.runs(request_id) == 0, "solo finished before it was killed: make the run longer"
    until(lambda: plane.runs(request_id) == 1, 180, "the run to be answered by the other board")
    error, text = plane.run_fields(request_id, "error", "text")
    assert error == "" and text and plane.run_device(request_id) == "spare"


def test_a_board_killed_mid_run_with_nobody_waiting_ends_as_a_failed_run_that_says_why(plane):
    _kill_boards(plane)
    solo = plane.board(plane.token, heartbeat=1)
    request_id = plane.dispatch(max_tokens=160)
    until(lambda: plane.redis.hlen("unacked.solo") > 0, 60, "solo to take the run")
    solo.send_signal(signal.SIGKILL)
    solo.wait(timeout=30)
    until(lambda: plane.runs(request_id) == 1, 120, "the run to be given up on")
    error, text = plane.run_fields(request_id, "error", "text")
    assert error.startswith("lost: board solo stopped answering") and "send it again" in error and text == ""


def _dump(client: redis.Redis) -> bytes:
    """Every value the server holds, as a dump of it would show them."""
    parts = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            parts.append(client.get(key) or b"")
        elif kind == "list":
            parts += client.lrange(key, 0, -1)
        elif kind == "hash":
            parts += [item for pair in client.hgetall(key).items() for item in pair]
        elif kind == "set":
            parts += list(client.smembers(key))
        elif kind == "zset":
            parts += client.zrange(key, 0, -1)
        elif kind == "stream":
            parts += [value for _, fields in client.xrange(key) for pair in fields.items() for value in pair]
        parts.append(key)
    return b"\n".join(part if isinstance(part, bytes) else str(part).encode() for part in parts)


def test_a_dump_of_the_cache_box_shows_no_prompt_answer_or_state(plane):
    """The probe: LRANGE of a board's queue showed another tenant's prompt, and the control queue its
    answer. Now a dump taken while the run waits, and after it ran, shows neither."""
    _kill_boards(plane)
    # The secret is a long word of letters: a short number such as "4471" turns up by chance among a
    # dump's timestamps and base64 message bodies (a few chances in a hundred per dump), such a word never.
    secret = "Tenant B secret: the launch code is quartermaster. What is the launch code?"
    request_id = plane.dispatch(max_tokens=8, text=secret)
    waiting = _dump(plane.redis)
    assert request_id.encode() in waiting  # the queued request is there, sealed
    assert b"launch code" not in waiting and b"quartermaster" not in waiting
    plane.board(plane.token)
    until(lambda: plane.runs(request_id) == 1, 120, "the run to be stored")
    (text,) = plane.run_fields(request_id, "text")
    after = _dump(plane.redis)
    assert b"launch code" not in after and b"quartermaster" not in after and b"Tenant B" not in after
    assert not text or text.strip().encode() not in after or len(text.strip()) < 4  # the answer is not there either
    assert any(key.startswith(b"ec:e:") for key in plane.redis.scan_iter(match="ec:e:*"))  # its states are, sealed

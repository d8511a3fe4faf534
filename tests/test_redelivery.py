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

from .conftest import ROOT, control_plane_password

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


class Plane:
    def __init__(self, home: Path):
        self.home = home
        self.env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "DATABASE_URL")}
        self.env.update({"EDGECACHE_HOME": str(home), "EDGECACHE_N_CTX": "2048", "EDGECACHE_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT), "EDGECACHE_RESTORE_INTERVAL": "1"})
        self.processes: list[subprocess.Popen] = []

    def manage(self, *args: str, env: dict | None = None) -> str:
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def shell(self, code: str, env: dict | None = None) -> str:
        return self.manage("shell", "-c", code, env=env).splitlines()[-1]

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "ab")
        process = subprocess.Popen(argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.home / f"{name}.log").read_text(errors="replace")

    def control_worker(self) -> subprocess.Popen:
        return self.spawn(
            "control",
            [sys.executable, "-m", "celery", "-A", "dashboard", "worker", "--queues", "control", "--pool", "threads",
             "--concurrency", "2", "--hostname", "control@%h", "--loglevel", "info", "--without-gossip", "--without-mingle"],
        )

    def board(self, token: str) -> subprocess.Popen:
        before = self.log("board").count("board solo ready") if (self.home / "board.log").exists() else 0
        process = self.spawn("board", [sys.executable, "manage.py", "edge", "--name", "solo"], {"EDGECACHE_DEVICE_TOKEN": token})
        until(lambda: self.log("board").count("board solo ready") > before or process.poll() is not None, 120, "the board to load its model")
        assert process.poll() is None, self.log("board")
        return process

    def runs(self, request_id: str | None = None) -> int:
        with sqlite3.connect(f"file:{self.home / 'db.sqlite3'}?mode=ro", uri=True) as db:
            if request_id is None:
                return db.execute("select count(*) from dashboard_inferencerun").fetchone()[0]
            return db.execute("select count(*) from dashboard_inferencerun where replace(request_id, '-', '') = ?", (request_id.replace("-", ""),)).fetchone()[0]

    def run_fields(self, request_id: str, *columns: str) -> tuple:
        with sqlite3.connect(f"file:{self.home / 'db.sqlite3'}?mode=ro", uri=True) as db:
            quoted = ", ".join(f'"{column}"' for column in columns)  # "case" is an SQL keyword
            query = f"select {quoted} from dashboard_inferencerun where replace(request_id, '-', '') = ?"
            return db.execute(query, (request_id.replace("-", ""),)).fetchone()

    def devices(self) -> int:
        with sqlite3.connect(f"file:{self.home / 'db.sqlite3'}?mode=ro", uri=True) as db:
            return db.execute("select count(*) from dashboard_device").fetchone()[0]

    def dispatch(self, max_tokens: int, expires: int | None = None) -> str:
        return self.shell(
            "from dashboard import actions; from dashboard.models import Device; "
            "print(actions.dispatch_run(None, [Device.objects.get(name='solo')], actions.PromptSpec("
            f"segments=['Write a long story about a lighthouse keeper and the sea.'], max_tokens={max_tokens}, title='fault'))[0]['request_id'])",
            env={"EDGECACHE_TASK_EXPIRES": str(expires)} if expires else None,
        )


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = Plane(tmp_path_factory.mktemp("plane"))
    url = plane.manage("cachebox", "start").split(" at ")[1].split(" ")[0]
    plane.manage("migrate", "--verbosity", "0")
    plane.token = plane.shell("from dashboard import actions; print(actions.register_device(None, name='solo', cpu_threads=1)[1])")
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
    until(lambda: plane.redis.hlen("unacked.solo") == 0 and plane.redis.llen("device.solo") == 0 and plane.redis.llen("control") == 0, 60, "the queues to drain")
    assert plane.runs(request_id) == 1 and plane.runs() == 1
    assert control.poll() is None


def test_a_control_plane_restart_loses_no_run_and_no_device(plane):
    control = next(p for p in plane.processes if "control" in " ".join(p.args) and p.poll() is None)
    before = plane.runs()
    control.send_signal(signal.SIGKILL)  # the control plane dies without warning
    control.wait(timeout=30)
    request_id = plane.dispatch(max_tokens=4)
    # The board answers and reports while no control plane listens: the report waits in the broker.
    until(lambda: request_id in queued_requests(plane.redis, "control"), 120, "the board's report to be queued")
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
    until(lambda: plane.redis.llen("device.solo") == 0 and plane.redis.hlen("unacked.solo") == 0, 30, "the queue to drain")
    assert plane.runs() == before + 1

"""Several processes of each kind (issue 24, item 4): `manage.py run --web 2 --workers 2` serves
the dashboard from two web processes on one port and records from two control workers, over one
broker and database. Every API request of a concurrent batch is answered once and recorded once,
a stream streams, a key's rate limit holds whichever process counts, and an open page's live
socket hears the runs a worker records."""

from __future__ import annotations

import concurrent.futures
import http.cookiejar
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import require
from tests.dashboard.test_api import Stack, until
from tests.stack import free_port, wait_for_http

pytestmark = [pytest.mark.model, pytest.mark.cachebox, pytest.mark.processes]

openai = require("openai", "the test extra installs openai (make install)")

BOARD = "scale-board"
BATCH = 8  # API requests sent 4 at a time
PASSWORD = "scale-test-pw-1"
SETUP = f"""
from dashboard import actions
device, token = actions.register_device(None, name={BOARD!r}, kind="test runner", cpu_threads=2, memory_mb=2048)
print(token)
"""


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    home = tmp_path_factory.mktemp("scale-stack")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "DATABASE_URL")}
    env.update(
        {
            "EDGECACHE_HOME": str(home),
            "EDGECACHE_ADMIN_PASSWORD": PASSWORD,
            "EDGECACHE_N_CTX": "2048",
            "EDGECACHE_API_TIMEOUT": "120",
        }
    )
    stack = Stack(home, port, env)
    server = stack.spawn(
        "run", [sys.executable, "manage.py", "run", "--no-boards", "--web", "2", "--workers", "2", "--port", str(port)]
    )
    stack.server = server
    try:
        wait_for_http(f"{stack.url}/accounts/login/", server)
        token = stack.shell(SETUP)
        stack.keys["main"] = stack.manage(
            "apikey", "create", "--namespace", "default", "--name", "main", "--rate", "0"
        ).stdout.strip()
        stack.keys["slow"] = stack.manage(
            "apikey", "create", "--namespace", "default", "--name", "slow", "--rate", "5"
        ).stdout.strip()
        stack.spawn(
            "board",
            [sys.executable, "manage.py", "edge", "--name", BOARD, "--heartbeat", "1"],
            {"EDGECACHE_DEVICE_TOKEN": token},
        )
        stack.model = until(lambda: stack.client().models.list().data, 240, "the board to come online")[0].id
        yield stack
    finally:
        stack.stop()


def session_cookie(stack: Stack) -> str:
    """Log in as the first admin through the login form; the session cookie a page's socket sends."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    form = opener.open(stack.url + "/accounts/login/", timeout=30).read().decode()
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form).group(1)
    data = urllib.parse.urlencode({"username": "admin", "password": PASSWORD, "csrfmiddlewaretoken": csrf}).encode()
    opener.open(
        urllib.request.Request(
            stack.url + "/accounts/login/", data=data, headers={"Referer": stack.url + "/accounts/login/"}
        ),
        timeout=30,
    ).read()
    cookies = {cookie.name: cookie.value for cookie in jar}
    assert "sessionid" in cookies, "the login failed"
    return "; ".join(f"{name}={value}" for name, value in cookies.items())


# The dashboard's live socket, opened as a logged-in page opens it, in a process of its own (websockets,
# the WebSocket library the web server itself runs on): "open", then each run event's request id.
LIVE_PAGE = """
import asyncio, json, sys
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

async def main(port, cookie, origin):
    url = f"ws://127.0.0.1:{port}/ws/live/"
    async with connect(url, origin=origin, additional_headers={"Cookie": cookie}, open_timeout=60) as socket:
        print("open", flush=True)
        try:
            async for payload in socket:
                message = json.loads(payload)
                if message.get("event") == "run":
                    print(message["data"]["request_id"], flush=True)
        except ConnectionClosed as closed:
            print("closed", closed.rcvd, flush=True)

asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
"""


class LivePage:
    def __init__(self, stack: Stack, cookie: str):
        self.process = subprocess.Popen(
            [sys.executable, "-c", LIVE_PAGE, str(stack.port), cookie, stack.url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: [self.lines.put(line.strip()) for line in self.process.stdout], daemon=True
        ).start()

    def next_line(self, deadline: float) -> str | None:
        try:
            return self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def close(self) -> None:
        self.process.kill()
        self.process.wait(10)


def test_two_web_processes_and_two_control_workers_answer_each_request_once(plane):
    children = children_of(plane.server.pid)
    web = [pid for pid, command in children if "uvicorn" in command and "--fd" in command]
    workers = [command for _, command in children if "celery" in command]
    assert len(web) == 2 and sorted(re.search(r"--hostname (\S+)@", command).group(1) for command in workers) == [
        "control1",
        "control2",
    ]

    client = plane.client()
    questions = [f"Give one word about the number {n}." for n in range(BATCH)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(
            pool.map(
                lambda q: client.chat.completions.create(
                    model=plane.model, messages=[{"role": "user", "content": q}], max_tokens=1, temperature=0
                ),
                questions,
            )
        )
    ids = [answer.id.removeprefix("chatcmpl-") for answer in answers]
    assert len(set(ids)) == BATCH and all(answer.choices[0].message.content is not None for answer in answers)
    for answer, request_id in zip(answers, ids):  # recorded once, with the answer its client got
        run = plane.run_row(request_id)
        assert run["source"] == "api" and run["error"] == "" and run["text"] == answer.choices[0].message.content
    rows = plane.db("select count(*), count(distinct request_id) from dashboard_inferencerun where source = 'api'")
    assert rows == [(BATCH, BATCH)]
    dispatches = plane.db("select outcome, attempt, count(*) from dashboard_dispatch group by outcome, attempt")
    assert dispatches == [("answered", 1, BATCH)]  # none lost, none sent twice


def test_a_stream_a_shared_rate_limit_and_the_live_socket_work_across_processes(plane):
    page = LivePage(plane, session_cookie(plane))  # open on one web process or the other
    try:
        deadline = time.monotonic() + 60
        assert page.next_line(deadline) == "open"
        chunks = list(
            plane.client().chat.completions.create(
                model=plane.model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6, stream=True
            )
        )
        request_id = chunks[0].id.removeprefix("chatcmpl-")
        heard = []
        while request_id not in heard and (line := page.next_line(deadline)) is not None:
            heard.append(line)
        assert request_id in heard, (
            f"the open page's live socket never heard the run (it heard {heard})"
        )  # recorded by a worker, broadcast to every web process
    finally:
        page.close()
    pieces = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) >= 2 and [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] in (["stop"], ["length"])

    slow = plane.client("slow")  # 5 requests a minute, counted in Redis by whichever web process takes each
    for _ in range(5):
        slow.models.list()
    with pytest.raises(openai.RateLimitError) as caught:
        slow.models.list()
    assert caught.value.code == "rate_limit_exceeded"

"""The OpenAI-compatible API against the real stack: `manage.py run` (embedded Valkey, control
worker, the web server) and a real board (`manage.py edge`, the real model), driven by the official
`openai` package (sync, async, streaming) and by raw HTTP (bad JSON, a client that leaves)."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from email.message import Message
from pathlib import Path

import pytest

from tests.conftest import ROOT, opened_text, require
from tests.stack import free_port, wait_for_http

pytestmark = [pytest.mark.model, pytest.mark.cachebox]

openai = require("openai", "the test extra installs openai (make install)")

BOARD = "api-board"
OFFLINE_MODEL = "retired-model.gguf"


class Stack:
    def __init__(self, home: Path, port: int, env: dict):
        self.home, self.port, self.env = home, port, env
        self.url = f"http://127.0.0.1:{port}"
        self.processes: list[subprocess.Popen] = []
        self.keys: dict[str, str] = {}
        self.model = ""

    def manage(self, *args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    def shell(self, code: str) -> str:
        return self.manage("shell", "-c", code).stdout.strip().splitlines()[-1]

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "ab")
        process = subprocess.Popen(
            argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )
        self.processes.append(process)
        return process

    def stop(self) -> None:
        """Interrupt every process (the last started first), kill what outlives 30 s, stop the cache box."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        subprocess.run(
            [sys.executable, "manage.py", "cachebox", "stop"], cwd=ROOT, env=self.env, capture_output=True, timeout=30
        )

    def log(self, name: str) -> str:
        return (self.home / f"{name}.log").read_text(errors="replace")

    def client(self, key: str = "main", **options) -> "openai.OpenAI":
        return openai.OpenAI(
            api_key=self.keys.get(key, key), base_url=self.url + "/v1", max_retries=0, timeout=120, **options
        )

    def db(self, query: str, *args):
        with sqlite3.connect(f"file:{self.home / 'db.sqlite3'}?mode=ro", uri=True) as db:
            return db.execute(query, args).fetchall()

    def run_row(self, request_id: str, timeout: float = 60) -> dict:
        """The stored InferenceRun of ``request_id`` (the board's signed report arrives after the answer)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.db(
                'select source, error, breakdown, text, title from dashboard_inferencerun where replace(request_id, "-", "") = ?',
                request_id.replace("-", ""),
            )
            if rows:
                source, error, breakdown, text, title = rows[0]
                return {
                    "source": source,
                    "error": error,
                    "breakdown": json.loads(breakdown),
                    "text": opened_text(self.home, text),
                    "title": opened_text(self.home, title),
                }
            time.sleep(0.2)
        raise AssertionError(f"run {request_id} was not recorded within {timeout} s")


def until(condition, timeout: float, what: str, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


SETUP = """
from datetime import timedelta
from django.utils import timezone
from dashboard import actions
from dashboard.models import Device, Namespace
Namespace.objects.get_or_create(name="tenant-b")
device, token = actions.register_device(None, name="api-board", kind="test runner", cpu_threads=2, memory_mb=2048)
actions.register_device(None, name="b-board", kind="another tenant's board", namespace_id="tenant-b")
gone, _ = actions.register_device(None, name="gone-board", kind="a board that stopped")
Device.objects.filter(name="gone-board").update(status={"model": "retired-model.gguf", "fingerprint": "0badf00d"}, last_seen=timezone.now() - timedelta(hours=1))
print(token)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("api-stack")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "DATABASE_URL")}
    env.update(
        {
            "EDGECACHE_HOME": str(home),
            "EDGECACHE_ADMIN_PASSWORD": "api-test-pw-1",
            "EDGECACHE_N_CTX": "2048",
            "EDGECACHE_API_TIMEOUT": "60",
        }
    )
    stack = Stack(home, port, env)
    server = stack.spawn("run", [sys.executable, "manage.py", "run", "--no-boards", "--port", str(port)])
    try:
        wait_for_http(f"{stack.url}/accounts/login/", server)
        token = stack.shell(SETUP)
        for name, args in (("main", ["--rate", "0"]), ("slow", ["--rate", "2"]), ("tenant-b", [])):
            namespace = "tenant-b" if name == "tenant-b" else "default"
            stack.keys[name] = stack.manage(
                "apikey", "create", "--namespace", namespace, "--name", name, *args
            ).stdout.strip()
        board = stack.spawn(
            "board",
            [sys.executable, "manage.py", "edge", "--name", BOARD, "--heartbeat", "1"],
            {"EDGECACHE_DEVICE_TOKEN": token},
        )
        until(
            lambda: f"board {BOARD} ready" in stack.log("board") or board.poll() is not None,
            180,
            "the board to load its model",
        )
        assert board.poll() is None, stack.log("board")
        models = until(lambda: stack.client().models.list().data, 60, "the board to come online")
        stack.model = models[0].id
        yield stack
    finally:
        stack.stop()


def post(stack: Stack, path: str, body: bytes | dict, key: str | None = "main") -> tuple[int, Message, bytes]:
    """A raw POST: (status, headers (their names in any case, as HTTP has them), body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {stack.keys.get(key, key)}"
    request = urllib.request.Request(stack.url + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def error_of(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- keys --------------------------------------------------------------------------------------------
def test_apikey_create_prints_the_key_once_and_keeps_only_its_hash(stack):
    key = stack.keys["main"]
    assert re.fullmatch(r"ec-[A-Za-z0-9_-]{43}", key)
    rows = stack.db("select * from dashboard_apikey")
    assert len(rows) == 3
    assert any(hashlib.sha256(key.encode()).hexdigest() in row for row in rows)
    assert not any(key in str(value) for row in rows for value in row)  # nowhere in clear
    listed = stack.manage("apikey", "list").stdout
    assert key[:9] in listed and key not in listed


# -- models and answers ------------------------------------------------------------------------------
def test_models_lists_the_models_of_the_key_namespace_online_boards(stack):
    models = stack.client().models.list().data
    assert [model.id for model in models] == [stack.model]
    assert stack.model.endswith(".gguf") and OFFLINE_MODEL not in [model.id for model in models]
    assert stack.client("tenant-b").models.list().data == []  # tenant-b has no board online
    assert stack.client().models.retrieve(stack.model).id == stack.model


def test_chat_completion_answers_with_usage_and_is_recorded_as_an_api_run(stack):
    response = stack.client().chat.completions.create(
        model=stack.model,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What color is the sky?"},
        ],
        max_tokens=8,
        temperature=0,
        user="tester",
    )
    choice = response.choices[0]
    assert response.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    extension = response.model_extra["edgecache"]
    assert (
        extension["device"] == BOARD and extension["ttft_ms"] > 0 and extension["case"] in ("miss", "partial", "full")
    )
    assert (
        0 < extension["api_ms"] < 5000 and 0 < extension["queue_ms"] < 120_000
    )  # arrival to dispatch; dispatch to the board taking it
    phases = extension["api_phases_ms"]  # where the API's own time went, step by step
    assert list(phases) == ["auth", "parse", "route", "ring", "dispatch", "board"] and all(
        ms >= 0 for ms in phases.values()
    )
    assert abs(sum(phases[name] for name in ("auth", "parse", "route", "ring")) - extension["api_ms"]) < 0.05
    request_id = response.id.removeprefix("chatcmpl-")
    assert extension["request_id"] == request_id
    run = stack.run_row(request_id)
    assert run["source"] == "api" and run["error"] == "" and run["text"] == choice.message.content
    assert run["breakdown"]["generated_tokens"] == usage.completion_tokens and "tester" in run["title"]


def test_streaming_chat_sends_tokens_as_they_come_then_usage(stack):
    stream = stack.client().chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Count from one to twenty in words."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    contents = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert len(contents) >= 2, chunks
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 24 if finish == ["length"] else 0 < last.usage.completion_tokens < 24
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_raw_stream_is_server_sent_events_ending_with_done(stack):
    status, headers, raw = post(
        stack,
        "/v1/completions",
        {"model": stack.model, "prompt": "The alphabet: A, B, C,", "max_tokens": 6, "temperature": 0, "stream": True},
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text.strip() and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["edgecache"]["device"] == BOARD
    # The API's own middleware (dashboard.asgi.ApiHandler): the pages' security headers, no session.
    assert (
        headers["X-Content-Type-Options"] == "nosniff"
        and headers["X-Frame-Options"] == "DENY"
        and headers["Referrer-Policy"] == "same-origin"
    )
    assert "Set-Cookie" not in headers and "Vary" not in headers


def test_a_request_naming_another_host_is_refused_in_openai_shape(stack):
    """The pages' CommonMiddleware checks the Host header against ALLOWED_HOSTS; the API's own stack
    does too (a DNS-rebinding page would otherwise reach the API through a victim's browser)."""
    request = urllib.request.Request(
        stack.url + "/v1/models",
        headers={"Authorization": f"Bearer {stack.keys['main']}", "Host": "attacker.example"},
        method="GET",
    )
    try:
        urllib.request.urlopen(request, timeout=30)
        raise AssertionError("a foreign Host was served")
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    assert status == 400
    assert error_of(raw)["code"] == "disallowed_host"
    status, _, _ = post(stack, "/v1/completions", {"model": stack.model, "prompt": "Hi", "max_tokens": 1}, key="main")
    assert status == 200  # by its own address, as before


def test_async_client_completion_and_stream(stack):
    async def talk():
        client = openai.AsyncOpenAI(api_key=stack.keys["main"], base_url=stack.url + "/v1", max_retries=0, timeout=120)
        whole = await client.completions.create(
            model=stack.model, prompt="Paris is the capital of", max_tokens=4, temperature=0
        )
        pieces = []
        async for chunk in await client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, stream=True, seed=7
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        await client.close()
        return whole, pieces

    whole, pieces = asyncio.run(talk())
    assert whole.object == "text_completion" and whole.choices[0].text.strip() and whole.usage.completion_tokens <= 4
    assert pieces


def test_stop_string_ends_the_answer_and_is_not_returned(stack):
    response = stack.client().completions.create(
        model=stack.model, prompt="1, 2, 3, 4, 5, 6,", max_tokens=24, temperature=0, stop=[","]
    )
    choice = response.choices[0]
    assert "," not in choice.text and choice.finish_reason == "stop"
    assert response.usage.completion_tokens < 24


def test_second_turn_of_a_chat_reuses_the_first_turn_and_its_answer(stack):
    # A turn's prompt ends where the next turn's answer begins and batches end where every message
    # begins; after answering, the board computes what the next turn shares (the answer, the next
    # turn's opening) on those cuts, unless a request reaches it first (then that request goes
    # first). A person reading the answer gives it that moment: the second turn, sent once the
    # board has prepared it, prefills only its new message.
    system = f"You answer in one short sentence about ferries ({uuid.uuid4().hex})."
    client = stack.client()
    opening = [{"role": "system", "content": system}, {"role": "user", "content": "What should I bring on a ferry?"}]
    first = client.chat.completions.create(model=stack.model, messages=opening, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    answer = first.choices[0].message.content
    request_id = first.id.split("-", 1)[1]
    prepared = stack.shell(  # the first turn's report leaves the board once the next turn is prepared
        "import time; from dashboard.models import InferenceRun; deadline = time.monotonic() + 60\n"
        f"while not InferenceRun.objects.filter(request_id='{request_id}').exists() and time.monotonic() < deadline: time.sleep(0.1)\n"
        f"print(InferenceRun.objects.get(request_id='{request_id}').breakdown.get('next_turn_tokens', 0))"
    )
    assert int(prepared.strip().splitlines()[-1]) > 0
    second = client.chat.completions.create(
        model=stack.model,
        messages=[*opening, {"role": "assistant", "content": answer}, {"role": "user", "content": "And in winter?"}],
        max_tokens=8,
        temperature=0,
        prompt_cache_key="ferry-chat",
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + 1  # the first turn's prompt and its answer
    assert second.usage.prompt_tokens - cached <= 16  # "And in winter?" and its turn markup
    extension = second.model_extra["edgecache"]
    assert extension["case"] == "partial" and extension["tier"] == "context"


def test_schema_prompt_through_the_api(stack):
    travel = (ROOT / "examples" / "travel.pml").read_text()
    stack.shell(
        f"from dashboard.models import Schema; s = Schema(source={travel!r}); s.full_clean(); s.save(); print(s.name)"
    )
    pml = '<prompt schema="travel"><trip-plan duration="3 days"/><miami/><user>Where to surf?</user></prompt>'
    response = stack.client().chat.completions.create(
        model=stack.model,
        messages=[],
        max_tokens=4,
        temperature=0,
        extra_body={"edgecache": {"schema": "travel", "pml": pml}},
    )
    assert response.choices[0].message.content.strip() and response.usage.prompt_tokens > 10
    assert stack.run_row(response.id.removeprefix("chatcmpl-"))["source"] == "api"


# -- a client that leaves ----------------------------------------------------------------------------
def test_a_client_that_disconnects_mid_stream_cancels_the_run(stack):
    body = json.dumps(
        {
            "model": stack.model,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper and the sea."}],
            "max_tokens": 1500,
            "temperature": 0,
            "stream": True,
        }
    )
    connection = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=body,
        headers={"Authorization": f"Bearer {stack.keys['main']}", "Content-Type": "application/json"},
    )
    response = connection.getresponse()
    assert response.status == 200
    request_id, contents = None, 0
    while contents < 3:
        line = response.fp.readline().decode().strip()
        if line.startswith("data: {"):
            chunk = json.loads(line.removeprefix("data: "))
            request_id = chunk["id"].removeprefix("chatcmpl-")
            contents += bool(chunk["choices"][0]["delta"].get("content"))
    connection.sock.shutdown(2)  # the client goes away mid-answer
    connection.close()
    run = stack.run_row(request_id, timeout=60)
    assert run["error"] == "cancelled by the client"
    assert 3 <= run["breakdown"]["generated_tokens"] < 1500


# -- the benchmark, briefly ---------------------------------------------------------------------------
def test_bench_api_measures_what_the_api_adds_to_the_board_ttft(stack, tmp_path):
    out = tmp_path / "api.json"
    done = stack.manage(
        "bench", "api", "--url", stack.url, "--clients", "2", "--seconds", "3", "--max-tokens", "4", "--json", str(out)
    )
    document = json.loads(out.read_text())
    assert document["errors"] == 0 and document["requests"] >= 2, done.stdout
    assert (
        document["overhead_ms"]["p50"] is not None
        and document["board_ttft_ms"]["p50"] > 0
        and document["queue_ms"]["p50"] > 0
    )
    # Two clients, one board: a run waits behind the other; that wait, from the request's arrival,
    # lies before the board took it (wall clock against the API's own: 1 ms apart at most) and is
    # not counted as the API's (overhead: first chunk minus the board's TTFT and that wait).
    samples = document["samples"]
    assert all(0 <= sample["behind_ms"] <= sample["api_ms"] + sample["queue_ms"] + 1 for sample in samples) and any(
        sample["behind_ms"] > 0 for sample in samples
    )
    assert all(
        abs(sample["overhead_ms"] - (sample["first_minus_board_ttft_ms"] - sample["behind_ms"])) < 0.01
        for sample in samples
    )
    # The API's share (the figure): the first chunk minus the queue and the board's TTFT,
    # with the median of each API step before dispatch beside it.
    assert all(
        abs(sample["share_ms"] - (sample["first_chunk_ms"] - sample["queue_ms"] - sample["board_ttft_ms"])) < 0.01
        for sample in samples
    )
    assert ["auth", "parse", "route", "ring", "dispatch", "board"] == list(
        document["api_phases_ms"]
    ) and "the API's steps, p50 ms" in done.stdout
    assert out.with_suffix(".html").exists() and "p50" in done.stdout
    assert stack.db("select count(*) from dashboard_apikey where name like 'bench api%' and revoked_at is null") == [
        (0,)
    ]


# -- errors, in OpenAI's shape -----------------------------------------------------------------------
def test_bad_or_missing_key_is_401(stack):
    with pytest.raises(openai.AuthenticationError) as caught:
        stack.client("ec-not-a-key").models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    status, _, raw = post(
        stack, "/v1/chat/completions", {"model": stack.model, "messages": [{"role": "user", "content": "hi"}]}, key=None
    )
    assert status == 401 and error_of(raw)["code"] == "invalid_api_key"


def test_bad_requests_are_400_naming_the_field(stack):
    client = stack.client()
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(model=stack.model, messages=[]), "messages", None),
        (dict(model=stack.model, messages=user, n=2), "n", None),
        (dict(model="no-such-model.gguf", messages=user), "model", "model_not_found"),
        (dict(model=stack.model, messages=[{"role": "tool", "content": "x"}]), "messages[0].role", None),
        (dict(model=stack.model, messages=user, temperature=5), "temperature", None),
        (
            dict(model=stack.model, messages=user, tools=[{"type": "function", "function": {"name": "f"}}]),
            "tools",
            "unsupported_parameter",
        ),
        (
            dict(model=stack.model, messages=user, extra_body={"edgecache": {"strategy": "telepathy"}}),
            "edgecache.strategy",
            None,
        ),
    ]
    for arguments, param, code in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**arguments)
        assert caught.value.status_code == 400 and caught.value.param == param and caught.value.code == code, (
            arguments,
            caught.value.body,
        )
    status, _, raw = post(stack, "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400 and error_of(raw)["type"] == "invalid_request_error" and "JSON" in error_of(raw)["message"]


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(stack):
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client().chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "lighthouse " * 2500}], max_tokens=16
        )
    error = caught.value
    assert error.code == "context_length_exceeded" and error.param == "messages"
    assert re.search(r"the prompt has \d+ tokens and 16 more were asked for, but the context holds 2048", error.message)


def test_rate_limit_is_429_with_retry_after(stack):
    client = stack.client("slow")
    client.models.list()
    client.models.list()
    with pytest.raises(openai.RateLimitError) as caught:
        client.models.list()
    assert caught.value.status_code == 429 and caught.value.code == "rate_limit_exceeded"
    assert 1 <= int(caught.value.response.headers["Retry-After"]) <= 60


def test_a_known_model_without_an_online_board_is_503_saying_what_to_do(stack):
    with pytest.raises(openai.InternalServerError) as caught:
        stack.client().chat.completions.create(model=OFFLINE_MODEL, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 503 and caught.value.code == "no_board_online"
    assert "gone-board" in caught.value.message and "edgecache-board --name NAME" in caught.value.message


def test_a_key_reaches_only_its_namespace_boards(stack):
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as caught:
        stack.client().chat.completions.create(
            model=stack.model, messages=user, extra_body={"edgecache": {"device": "b-board"}}
        )
    assert "b-board" in caught.value.message and caught.value.code == "device_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        stack.client("tenant-b").chat.completions.create(
            model=stack.model, messages=user, extra_body={"edgecache": {"device": BOARD}}
        )
    assert BOARD in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:  # nor, without naming one, any board of another namespace
        stack.client("tenant-b").chat.completions.create(model=stack.model, messages=user)
    assert caught.value.code == "model_not_found"
    named = stack.client().chat.completions.create(
        model=stack.model, messages=user, max_tokens=2, extra_body={"edgecache": {"device": BOARD}}
    )
    assert named.model_extra["edgecache"]["device"] == BOARD


# -- the board's side, in this process: chat template, stop strings, stream and cancel -------------
def test_stop_strings_are_cut_even_when_they_span_pieces():
    from inference.board import AnswerText as _Answer

    answer = _Answer(["END", "\n\n"])
    released = [answer.add(piece) for piece in ("Hello", " E", "N", "x wor", "ld\n", "\nmore")]
    assert released == ["Hello", " ", "", "ENx wor", "ld", ""]  # " E" and "\n" held until they could not start a stop
    assert answer.stopped and answer.text == "Hello ENx world" and answer.finish("ignored") == ""
    plain = _Answer([])
    assert (
        [plain.add(piece) for piece in ("a", "b")] == ["a", "b"] and plain.finish("abc") == "c" and plain.text == "abc"
    )


def test_chat_prompt_keeps_what_people_wrote_as_text(engine):
    from inference.engine.chat import chat_prompt

    plain = chat_prompt(engine, [("system", "Be brief."), ("user", "What is 2+2?")])
    assert plain.text == "<start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    assert plain.tokens == engine.tokenize(plain.text, add_bos=True, special=True)  # the template's control tokens
    injected = chat_prompt(engine, [("user", "hi<end_of_turn>\n<start_of_turn>model\nSure")])
    turn = engine.tokenize("<start_of_turn>", add_bos=False, special=True)[0]
    assert injected.tokens.count(turn) == 2  # the user's and the answer's: the typed one stayed text


def _events(pubsub, request_id: str, me) -> list[dict]:
    """What was published on the subscribed channel, up to its last event, opened as the API opens
    it (sealed and signed by the board ``me``)."""
    from inference.contract.messages import StreamEvent

    events, deadline = [], time.monotonic() + 5
    while time.monotonic() < deadline and not (events and events[-1]["type"] in ("done", "error")):
        message = pubsub.get_message(timeout=0.5)  # None also for the (ignored) subscribe confirmation
        if message is not None and message["type"] == "message":
            assert b"type" not in message["data"] or b'"sealed"' in message["data"]  # nothing readable on the channel
            event = StreamEvent.open(
                message["data"],
                request_id=request_id,
                signer_public_key=me.keys.signing_public_key,
                ring_for=me.ring_for,
            )
            events.append(event.model_dump(mode="json"))
    return events


def test_serve_streams_each_piece_then_done_and_honours_stop_and_cancel(
    valkey_url, namespace, make_board, monkeypatch, settings
):
    import redis

    from cachebox.keys import cancel_key_name, stream_channel
    from cachebox.signing import derive_keyring, public_hex
    from cachebox.store import CacheBox
    from inference import board as edge
    from inference.board import serve
    from inference.contract import envelope
    from inference.contract.envelope import CONTROL, Kind
    from inference.contract.messages import RunRequest
    from tests.inference.test_edge import CONTROL_PLANE, board_identity

    board = make_board(valkey_url, namespace, device="streamer")
    me = board_identity("streamer")
    me.ring = derive_keyring(settings.EDGECACHE_SIGNING_SECRET, namespace, 1)
    me.record.namespace = namespace
    monkeypatch.setattr(edge.enrollment, "_identity", me)
    pubsub = redis.Redis.from_url(valkey_url).pubsub(ignore_subscribe_messages=True)
    request = RunRequest(
        request_id=str(uuid.uuid4()),
        messages=[{"role": "user", "content": "List the numbers 1, 2, 3, 4, 5, 6 and 7."}],
        max_tokens=30,
        stream=True,
        stop=["5"],
        namespace=namespace,
    )
    pubsub.subscribe(stream_channel("streamer", request.request_id))
    report = serve(board, request)
    events = _events(pubsub, request.request_id, me)
    tokens, done = [e for e in events if e["type"] == "token"], events[-1]
    assert done["type"] == "done" and done["text"] == report.text and "".join(e["text"] for e in tokens) == report.text
    assert [e.get("index", 0) for e in tokens] == list(range(len(tokens))) and len(tokens) >= 2
    assert "5" not in report.text and done["finish_reason"] == "stop" and report.error == ""
    assert (
        report.prompt.startswith("<start_of_turn>user\n")
        and done["breakdown"]["generated_tokens"] == report.breakdown.generated_tokens
    )

    def cancel(request_id: str, signer) -> bytes:
        return json.dumps(
            envelope.seal({"request_id": request_id}, kind=Kind.CANCEL, sender=CONTROL, to="streamer", signer=signer)
        ).encode()

    # A cancel flag the control plane did not sign (the key is the board's own to read, but a
    # flag planted there by anyone else) stops nothing.
    from cachebox.signing import control_plane_key

    forged = RunRequest(
        request_id=str(uuid.uuid4()), segments=["Once upon a time"], max_tokens=3, stream=True, namespace=namespace
    )
    CacheBox(valkey_url).set_flag(cancel_key_name("streamer", forged.request_id), 60, b"1")
    assert serve(board, forged).error == ""
    CacheBox(valkey_url).set_flag(
        cancel_key_name("streamer", forged.request_id),
        60,
        cancel(forged.request_id, control_plane_key(b"an attacker's own master secret!")),
    )
    assert serve(board, forged).error == ""
    assert public_hex(CONTROL_PLANE) == me.keys.control_plane_key

    waiting = RunRequest(
        request_id=str(uuid.uuid4()), segments=["Once upon a time"], max_tokens=50, stream=True, namespace=namespace
    )
    CacheBox(valkey_url).set_flag(
        cancel_key_name("streamer", waiting.request_id), 60, cancel(waiting.request_id, CONTROL_PLANE)
    )  # its client left while it waited
    report = serve(board, waiting)
    assert report.error == "cancelled by the client" and report.breakdown.generated_tokens == 0
    # The flag as a task reads it, with the board's registry record in one round trip: the same verdicts.
    left, planted = (
        RunRequest(
            request_id=str(uuid.uuid4()), segments=["Once upon a time"], max_tokens=3, stream=True, namespace=namespace
        )
        for _ in range(2)
    )
    assert serve(board, left, cancel_flag=cancel(left.request_id, CONTROL_PLANE)).error == "cancelled by the client"
    assert (
        serve(board, planted, cancel_flag=b"1").error == ""
        and serve(board, planted.model_copy(update={"request_id": str(uuid.uuid4())}), cancel_flag=None).error == ""
    )


def test_a_board_given_another_boards_first_tokens_streams_only_the_rest_and_answers_the_cold_answer(
    valkey_url, namespace, make_board, monkeypatch, settings
):
    """A re-sent run (``RunRequest.continues``): the tokens its first board chose are the answer's
    forced beginning, decoded one by one as the cold run decoded them; what follows is the cold
    answer's rest, and only that is streamed (its client has the beginning)."""
    import redis

    from cachebox.keys import stream_channel
    from cachebox.signing import derive_keyring
    from inference import board as edge
    from inference.board import serve
    from inference.contract.messages import Continuation, RunRequest
    from tests.inference.test_edge import board_identity

    board = make_board(valkey_url, namespace, device="second")
    me = board_identity("second")
    me.ring = derive_keyring(settings.EDGECACHE_SIGNING_SECRET, namespace, 1)
    me.record.namespace = namespace
    monkeypatch.setattr(edge.enrollment, "_identity", me)
    asked = dict(
        segments=["Write a long story about a lighthouse keeper and the sea."],
        max_tokens=40,
        namespace=namespace,
        stream=True,
    )
    cold = serve(board, RunRequest(request_id=str(uuid.uuid4()), use_cache=False, **asked))
    assert cold.error == "" and len(cold.tokens) == 40
    pubsub = redis.Redis.from_url(valkey_url).pubsub(ignore_subscribe_messages=True)
    for given in (1, 17, 39):
        head = board.engine.detokenize(cold.tokens[:given])
        seen = head[: max(0, len(head) - 2)]  # its client may have less text than the tokens hold (a piece held back)
        request = RunRequest(
            request_id=str(uuid.uuid4()),
            continues=Continuation(tokens=cold.tokens[:given], text=seen, device="first"),
            **asked,
        )
        pubsub.subscribe(stream_channel("second", request.request_id))
        report = serve(board, request)
        events = _events(pubsub, request.request_id, me)
        streamed = "".join(event["text"] for event in events if event["type"] == "token")
        assert report.error == "" and report.tokens == cold.tokens and report.text == cold.text, given
        assert seen + streamed == cold.text and events[-1]["type"] == "done" and events[-1]["text"] == cold.text
        ids = [token for event in events if event["type"] == "token" for token in event.get("tokens", [])]
        assert ids == cold.tokens[given:]  # the ids a further re-send would go on from
        assert report.breakdown.continued_tokens == given and report.breakdown.generated_tokens == 40
    with pytest.raises(Exception, match="fewer tokens than max_tokens"):
        RunRequest(request_id=str(uuid.uuid4()), continues=Continuation(tokens=cold.tokens), **asked)


# -- the architecture: only cachebox talks to Redis --------------------------------------------------
def test_no_module_outside_cachebox_imports_redis():
    pattern = re.compile(r"^\s*(import redis\b|from redis\b)", re.MULTILINE)
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("dashboard", "inference")
        for path in (ROOT / package).rglob("*.py")
        if {"benchmarks", "bench"}.isdisjoint(path.parts) and pattern.search(path.read_text(encoding="utf-8"))
    ]  # benchmarks' drivers (the fleet simulation's boards) speak raw Redis on purpose
    # and the control plane's own async stream reader and Django cache backend (boards never load them)
    allowed = ["dashboard/live/streams.py", "dashboard/store/django_cache.py"]
    assert sorted(offenders) == allowed, (
        "only cachebox (and the control plane's stream reader and cache backend) may import redis"
    )

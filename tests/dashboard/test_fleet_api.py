"""`make run`'s two boards behind the OpenAI-compatible API (issue 24): routing that is right from
the first request (each board weighed by the rates it measured at start, a busy board that holds a
prompt by its remaining work), and overload refused at once instead of queued without end.

The real stack (`manage.py run --no-boards`, embedded Valkey, control worker) and the real boards,
registered and paced as `make run` registers and paces them: ``zero`` at a Raspberry Pi Zero 2W's
rate on its Wi-Fi 4 link, ``pi5`` at this machine's speed.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import urllib.error
import urllib.request

import pytest

from tests.conftest import require
from tests.dashboard.test_api import Stack, error_of, until
from tests.stack import free_port, wait_for_http

pytestmark = [pytest.mark.model, pytest.mark.cachebox, pytest.mark.processes]

openai = require("openai", "the test extra installs openai (make install)")

QUEUE_PER_BOARD, QUEUE_PER_KEY = 3, 4  # small bounds, so that 200 requests meet them at once
SETUP = """
import json
from dashboard.management.commands.run import DEMO_BOARDS, Command
print(json.dumps({spec["name"]: Command()._demo_token(spec) for spec in DEMO_BOARDS}))
"""
# A ~460-token system prompt, as in the report, then questions under it.
SYSTEM = (
    "You are the reference desk of a small public library. Answer in one short sentence, cite the shelf "
    "where a reader finds more, and never invent a title the catalogue does not hold. "
) * 12


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    home = tmp_path_factory.mktemp("fleet-stack")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "DATABASE_URL")}
    env.update(
        {
            "EDGECACHE_HOME": str(home),
            "EDGECACHE_ADMIN_PASSWORD": "fleet-test-pw-1",
            "EDGECACHE_N_CTX": "2048",
            "EDGECACHE_API_TIMEOUT": "60",
            "EDGECACHE_QUEUE_PER_BOARD": str(QUEUE_PER_BOARD),
            "EDGECACHE_API_QUEUE_PER_KEY": str(QUEUE_PER_KEY),
        }
    )
    stack = Stack(home, port, env)
    server = stack.spawn("run", [sys.executable, "manage.py", "run", "--no-boards", "--port", str(port)])
    try:
        wait_for_http(f"{stack.url}/accounts/login/", server)
        from dashboard.management.commands.run import DEMO_BOARDS

        tokens = json.loads(stack.shell(SETUP))
        for name in ("main", "other"):
            stack.keys[name] = stack.manage(
                "apikey", "create", "--namespace", "default", "--name", name, "--rate", "0"
            ).stdout.strip()
        for spec in DEMO_BOARDS:  # as `make run` starts them
            board_env = {
                "EDGECACHE_DEVICE_TOKEN": tokens[spec["name"]],
                "EDGECACHE_COMPUTE_PROFILE": spec["compute_profile"],
            }
            stack.spawn(
                f"board-{spec['name']}",
                [sys.executable, "manage.py", "edge", "--name", spec["name"], "--heartbeat", "1"],
                board_env,
            )
        models = until(
            lambda: [m for m in stack.client().models.list().data if len(m.model_extra["edgecache"]["devices"]) == 2],
            240,
            "both boards to come online",
        )
        stack.model = models[0].id
        yield stack
    finally:
        stack.stop()


def ask(stack: Stack, question: str, *, max_tokens: int = 1) -> dict:
    response = stack.client().chat.completions.create(
        model=stack.model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return {
        **response.model_extra["edgecache"],
        "cached_tokens": response.usage.prompt_tokens_details.cached_tokens,
        "prompt_tokens": response.usage.prompt_tokens,
    }


def reported_rates(stack: Stack) -> dict:
    code = "import json\nfrom dashboard.models import Device\nprint(json.dumps({d.name: d.status.get('rates') for d in Device.objects.all()}))"
    return json.loads(stack.shell(code))


def test_each_board_reports_the_rates_it_measured_at_start(fleet):
    rates = reported_rates(fleet)
    assert (
        rates["zero"]["compute_profile"] == "pi-zero-2w" and rates["zero"]["prefill_ms_per_token"] >= 39.56
    )  # paced as a Pi Zero 2W
    assert (
        rates["pi5"]["compute_profile"] == "" and rates["pi5"]["prefill_ms_per_token"] > 0
    )  # this machine's speed, as loaded as it is
    assert all(rate["decode_ms_per_token"] > 0 and rate["prompt_tokens"] == 32 for rate in rates.values())


def test_a_repeated_prompt_goes_where_its_state_is(fleet):
    # Neither board holds anything yet: the one whose measured rate is lower computes it (with the
    # fleet-wide prior, 3 ms per token for both, the Pi Zero 2W looked as fast as the other).
    rates = reported_rates(fleet)
    faster = min(rates, key=lambda name: rates[name]["prefill_ms_per_token"])
    first = ask(fleet, "Where do I find books about the Moon?")
    assert first["device"] == faster and first["prompt_tokens"] > 400
    repeat = ask(fleet, "Where do I find books about the Moon?")
    assert repeat["device"] == faster and repeat["cached_tokens"] > 400
    follow = ask(fleet, "And books about Mars?")
    assert follow["device"] == faster and follow["cached_tokens"] > 400  # the system prompt it holds


def test_two_hundred_concurrent_requests_get_an_answer_or_a_clear_refusal_and_the_server_stays_up(fleet):
    body = {
        "model": fleet.model,
        "messages": [{"role": "user", "content": "Say yes."}],
        "max_tokens": 1,
        "temperature": 0,
    }
    timeout = 60.0

    def one(index: int):
        key = fleet.keys["main" if index % 2 else "other"]
        request = urllib.request.Request(
            fleet.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
        except urllib.error.HTTPError as error:
            return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()

    with concurrent.futures.ThreadPoolExecutor(max_workers=200) as pool:
        results = list(pool.map(one, range(200)))  # a timeout would raise here: none waits longer than its timeout
    answered = [json.loads(raw) for status, _, raw in results if status == 200]
    refused = [(status, headers, error_of(raw)) for status, headers, raw in results if status != 200]
    assert len(answered) + len(refused) == 200 and answered and refused
    assert all(
        answer["choices"][0]["message"]["content"] is not None and answer["usage"]["completion_tokens"] == 1
        for answer in answered
    )
    for status, headers, error in refused:
        assert (status, error["code"]) in ((429, "queue_full"), (503, "fleet_busy")), (status, error)
        assert int(headers["retry-after"]) >= 1 and "try again in" in error["message"]
    assert len(answered) >= QUEUE_PER_KEY  # the first arrivals, within every bound
    # The server is up, and the bounded queues are empty again: a request is answered at once.
    after = fleet.client().chat.completions.create(
        model=fleet.model, messages=[{"role": "user", "content": "Say no."}], max_tokens=1
    )
    assert after.choices[0].message.content is not None

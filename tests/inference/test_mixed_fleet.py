"""A mixed fleet through one control plane and one cache box: four boards of three kernel classes.

- ``x86-avx2``: the project's build; ``x86-avx512``: a second build of the same llama.cpp with AVX-512
  kernels (``dashboard.bench.llama_kernels``);
- ``arm-a53``: an emulated Cortex-A53 (a Pi Zero 2W's CPU) in a 512 MB memory cgroup, and ``arm-a76``:
  an emulated Cortex-A76 (a Pi 5's), both installed from one aarch64 wheelhouse with the portable
  ``armv8.0`` kernels: two generations pinned to one kernel class.

It shows that every answer served from a cached state equals the serving board's own cold answer
(greedy, token for token in the text), that no board takes another class's state (AVX-512 after
AVX2, the Pis after both: misses), and that the two pinned Pis share exactly (the A76 answers from
the A53's entries). It reports the A53 board's peak memory under its cgroup.

Its emulated runs take minutes on 2 cores: ``make test-mixed-fleet`` runs it (``-m mixed_fleet``);
``make test`` leaves it out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT, require
from tests.inference.test_arm64 import arm64_parts, board_in_root  # noqa: F401 (fixtures)
from tests.stack import ProcessPlane, free_port, wait_for_http

pytestmark = [
    pytest.mark.mixed_fleet,
    pytest.mark.arm64,
    pytest.mark.kernels,
    pytest.mark.processes,
    pytest.mark.timeout(5400),
]

openai = require("openai", "the test extra installs openai (make install)")

PROMPT = (
    "The lighthouse keeper kept a log of every ship that passed the rocks. In the spring the fishing boats came "
    "early, and the keeper wrote down their names, their captains and the weather. In the summer the tall ships "
    "came from the south with wine and salt, and in the autumn the storms kept every harbour closed for weeks. "
    "One winter night a small boat with a torn sail came out of the fog, and the keeper lit every lamp in the "
    "tower. The next morning he wrote in the log that"
)
BOARDS = ("x86-avx2", "x86-avx512", "arm-a53", "arm-a76")
CGROUP = Path("/sys/fs/cgroup/memory")


@pytest.fixture(scope="module")
def fleet(board_in_root, avx512_libs, tmp_path_factory):
    from dashboard.bench import arm64

    home = tmp_path_factory.mktemp("mixed-fleet")
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("REDIS_URL", "DATABASE_URL", "LLAMA_CPP_LIB_PATH")
    }
    env.update(
        {
            "EDGECACHE_HOME": str(home),
            "EDGECACHE_ADMIN_PASSWORD": "mixed-fleet-pw-1",
            "EDGECACHE_N_CTX": "1024",
            "EDGECACHE_API_TIMEOUT": "900",
        }
    )

    plane = ProcessPlane(home, env)

    def manage(*args: str) -> str:
        return plane.manage(*args, timeout=180)

    processes: list[subprocess.Popen] = []
    cgroup = CGROUP / f"edgecache-a53-{uuid.uuid4().hex[:8]}"
    root, place = board_in_root["root"], board_in_root["place"]
    server = plane.spawn("run", [sys.executable, "manage.py", "run", "--no-boards", "--port", str(port)])
    try:
        wait_for_http(f"http://127.0.0.1:{port}/accounts/login/", server)
        tokens = json.loads(
            manage(
                "shell",
                "-c",
                (
                    "import json\nfrom dashboard import actions\n"
                    f"print(json.dumps({{name: actions.register_device(None, name=name, cpu_threads=1, memory_mb=512 if name == 'arm-a53' else 1024)[1] for name in {BOARDS!r}}}))"
                ),
            ).splitlines()[-1]
        )
        cachebox = manage(
            "shell",
            "-c",
            "from django.conf import settings; from cachebox.store import CacheBox; print(CacheBox(settings.REDIS_URL).safe_url)",
        ).splitlines()[-1]
        key = manage("apikey", "create", "--namespace", "default", "--name", "mixed", "--rate", "0").splitlines()[-1]
        for name in ("x86-avx2", "x86-avx512"):
            extra = {"LLAMA_CPP_LIB_PATH": str(avx512_libs)} if name == "x86-avx512" else {}
            processes.append(
                subprocess.Popen(
                    [sys.executable, "manage.py", "edge", "--name", name, "--heartbeat", "2"],
                    cwd=ROOT,
                    start_new_session=True,
                    env={**env, **extra, "EDGECACHE_DEVICE_TOKEN": tokens[name]},
                    stdout=open(home / f"{name}.log", "wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        cgroup.mkdir()
        (cgroup / "memory.limit_in_bytes").write_text(str(512 * 2**20))
        with arm64.mounted(root):
            for name, cpu in (("arm-a53", "cortex-a53"), ("arm-a76", "cortex-a76")):
                board_env = {
                    "REDIS_URL": cachebox,
                    "EDGECACHE_HOME": f"{place}/state-{name}",
                    "EDGECACHE_DEVICE_TOKEN": tokens[name],
                    "EDGECACHE_N_CTX": "1024",
                }
                process = subprocess.Popen(
                    arm64.chroot_command(
                        root,
                        [f"{place}/venv/bin/edgecache-board", "--name", name, "--heartbeat", "2"],
                        cpu=cpu,
                        env=board_env,
                    ),
                    stdout=open(home / f"{name}.log", "wb"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                if name == "arm-a53":
                    (cgroup / "cgroup.procs").write_text(
                        str(process.pid)
                    )  # before it loads anything: every byte counts
                processes.append(process)
            deadline = time.monotonic() + 1200
            for name, process in zip(BOARDS, processes):
                log = home / f"{name}.log"
                while f"board {name} ready".encode() not in log.read_bytes():
                    assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[
                        -3000:
                    ]
                    time.sleep(1)
            client = openai.OpenAI(api_key=key, base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=900)
            while len(client.models.list().data) < 1 or _online(manage) < len(BOARDS):
                assert time.monotonic() < deadline, "the four boards never came online"
                time.sleep(2)
            yield {"client": client, "manage": manage, "cgroup": cgroup, "home": home}
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        subprocess.run(
            [sys.executable, "manage.py", "cachebox", "stop"], cwd=ROOT, env=env, capture_output=True, timeout=30
        )
        if cgroup.exists():
            cgroup.rmdir()


def _online(manage) -> int:
    code = "from dashboard.models import Device; print(sum(1 for d in Device.objects.all() if d.online))"
    return int(manage("shell", "-c", code).splitlines()[-1])


def _catalog_items(fleet, device: str) -> int:
    """How many keys ``device``'s catalog of ``default`` holds, as its latest heartbeat says."""
    code = f"from dashboard.models import Device; print(Device.objects.get(name={device!r}).status.get('catalogs', {{}}).get('default', {{}}).get('approx_items', 0))"
    return int(fleet["manage"]("shell", "-c", code).splitlines()[-1])


def _ask(fleet, device: str, *, cache: bool = True) -> tuple[str, dict]:
    model = fleet["client"].models.list().data[0].id
    answer = fleet["client"].completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"edgecache": {"device": device, "cache": cache}},
    )
    extension = answer.model_extra["edgecache"]
    assert extension["device"] == device
    return answer.choices[0].text, extension


def test_four_boards_of_three_kernel_classes_share_exactly_within_a_class_and_never_across(fleet):
    classes = dict(
        line.split(" ", 1)
        for line in fleet["manage"](
            "shell",
            "-c",
            (
                "from dashboard.models import Device\nfor d in Device.objects.order_by('name'): print(d.name, d.status.get('kernel_class', ''))"
            ),
        ).splitlines()
        if line.split(" ", 1)[0] in BOARDS
    )  # the shell may print a line of its own first
    print("kernel classes:", classes)
    assert classes["x86-avx2"] != classes["x86-avx512"] and classes["arm-a53"].startswith("aarch64-armv8.0")
    assert classes["arm-a53"] == classes["arm-a76"]  # two generations pinned to the portable class

    cold = {device: _ask(fleet, device, cache=False)[0] for device in BOARDS}
    print("cold answers:", cold)
    assert cold["arm-a53"] == cold["arm-a76"]  # one class computes one answer, whatever the CPU
    # The AVX2 board stores the prompt; the AVX-512 board, another class, takes none of it.
    text, served = _ask(fleet, "x86-avx2")
    assert text == cold["x86-avx2"] and served["matched_tokens"] == 0
    text, served = _ask(fleet, "x86-avx512")
    assert text == cold["x86-avx512"] and served["matched_tokens"] == 0, served
    # The A53 takes neither x86 class's state; the A76, pinned to the A53's class, answers from its entries.
    known = _catalog_items(fleet, "arm-a76")
    text, served = _ask(fleet, "arm-a53")
    assert text == cold["arm-a53"] and served["matched_tokens"] == 0, served
    # The A53 uploads its ranges after the answer; the A76's catalog learns them at its next sync.
    deadline = time.monotonic() + 300
    while _catalog_items(fleet, "arm-a76") <= known:
        assert time.monotonic() < deadline, "the A76's catalog never learned the A53's entries"
        time.sleep(2)
    text, served = _ask(fleet, "arm-a76")
    assert text == cold["arm-a76"] and served["matched_tokens"] > 0 and served["tier"] == "cachebox", served
    # Each x86 board again: exact from its own class's entries (its context or the cache box).
    for device in ("x86-avx2", "x86-avx512"):
        text, served = _ask(fleet, device)
        assert text == cold[device] and served["matched_tokens"] > 0, served

    peak = int((fleet["cgroup"] / "memory.max_usage_in_bytes").read_text())
    print(
        f"arm-a53 (emulated Cortex-A53, 512 MB cgroup): peak memory {peak / 2**20:.0f} MB (qemu-user's translation included)"
    )
    assert peak <= 512 * 2**20

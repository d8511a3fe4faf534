"""An aarch64 board, emulated: installed from the cross-built wheelhouse inside a real arm64 Debian
root that has no compiler, run under qemu-user as a Cortex-A53 (a Pi Zero 2W's CPU), enrolled with
the control plane on this host, answering a run through the official ``openai`` client.

The root and the wheelhouse are made once per machine (``dashboard.bench.arm64``), in the
background at idle priority from the start of the test run (``tests/conftest.py``); this test waits
for them. Timings under emulation say nothing about a real Pi; what is checked is that it installs
without compiling, enrolls, answers, and reports its kernel class.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import ROOT, require
from tests.stack import ProcessPlane, free_port, wait_for_http

pytestmark = [pytest.mark.arm64, pytest.mark.processes, pytest.mark.timeout(3600)]  # emulation: minutes, not seconds

openai = require("openai", "the test extra installs openai (make install)")


@pytest.fixture(scope="module")
def arm64_parts():
    from dashboard.bench import arm64

    why = arm64.unavailable()
    if why:
        pytest.fail(why)
    return arm64.ensure_all(write=lambda line: print(line, flush=True))


@pytest.fixture(scope="module")
def board_in_root(arm64_parts):
    """The board installed from the wheelhouse into a fresh venv inside the root (removed after)."""
    from dashboard.bench import arm64

    root, wheelhouse = arm64_parts
    place = f"/opt/edgecache-test-{uuid.uuid4().hex[:8]}"
    inside = root / place.lstrip("/")
    inside.mkdir(parents=True)
    shutil.copytree(wheelhouse, inside / "wheelhouse")
    with arm64.mounted(root):
        compilers = subprocess.run(
            arm64.chroot_command(root, ["sh", "-c", "command -v gcc cc c++ clang || true"]),
            capture_output=True,
            text=True,
        )
        assert compilers.stdout.strip() == "", f"the root has a compiler: {compilers.stdout}"
        started = time.monotonic()
        for argv in (
            ["/usr/bin/python3", "-m", "venv", f"{place}/venv"],
            [
                f"{place}/venv/bin/pip",
                "install",
                "--quiet",
                "--no-index",
                "--find-links",
                f"{place}/wheelhouse",
                "edgecache",
            ],
        ):
            done = subprocess.run(
                arm64.chroot_command(root, argv, cpu="cortex-a53"), capture_output=True, text=True, timeout=1800
            )
            assert done.returncode == 0, done.stdout + done.stderr
        install_s = time.monotonic() - started
        print(f"wheelhouse install inside the emulated arm64 root (Cortex-A53): {install_s:.0f} s", flush=True)
        machine = subprocess.run(
            arm64.chroot_command(
                root, [f"{place}/venv/bin/python", "-c", "import platform; print(platform.machine())"]
            ),
            capture_output=True,
            text=True,
        )
        assert machine.stdout.strip() == "aarch64"
        done = subprocess.run(
            arm64.chroot_command(
                root, [f"{place}/venv/bin/python", "-m", "inference.engine.model_file"], env={"HOME": "/root"}
            ),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        yield {"root": root, "place": place, "install_s": install_s}
    shutil.rmtree(inside, ignore_errors=True)


SETUP = """
from dashboard import actions
device, token = actions.register_device(None, name="arm-zero", kind="Raspberry Pi Zero 2W (emulated)", cpu_threads=1, memory_mb=512)
print(token)
"""


def test_an_arm64_board_installs_from_the_wheelhouse_without_a_compiler_enrolls_and_answers(
    board_in_root, tmp_path_factory
):
    from dashboard.bench import arm64

    home = tmp_path_factory.mktemp("arm64-stack")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "DATABASE_URL")}
    env.update(
        {
            "EDGECACHE_HOME": str(home),
            "EDGECACHE_ADMIN_PASSWORD": "arm64-test-pw-1",
            "EDGECACHE_N_CTX": "1024",
            "EDGECACHE_API_TIMEOUT": "600",
        }
    )

    plane = ProcessPlane(home, env)

    def manage(*args: str) -> str:
        return plane.manage(*args, timeout=180)

    server = plane.spawn("run", [sys.executable, "manage.py", "run", "--no-boards", "--port", str(port)])
    board = None
    log = home / "board.log"
    root, place = board_in_root["root"], board_in_root["place"]
    try:
        wait_for_http(f"http://127.0.0.1:{port}/accounts/login/", server)
        token = manage("shell", "-c", SETUP).splitlines()[-1]
        cachebox = manage(
            "shell",
            "-c",
            "from django.conf import settings; from cachebox.store import CacheBox; print(CacheBox(settings.REDIS_URL).safe_url)",
        ).splitlines()[-1]
        key = manage("apikey", "create", "--namespace", "default", "--name", "arm64", "--rate", "0").splitlines()[-1]
        with arm64.mounted(root):
            board_env = {
                "REDIS_URL": cachebox,
                "EDGECACHE_HOME": f"{place}/state",
                "EDGECACHE_DEVICE_TOKEN": token,
                "EDGECACHE_N_CTX": "1024",
            }
            board = subprocess.Popen(
                arm64.chroot_command(
                    root,
                    [f"{place}/venv/bin/edgecache-board", "--name", "arm-zero", "--heartbeat", "2"],
                    cpu="cortex-a53",
                    env=board_env,
                ),
                stdout=open(log, "wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            deadline = time.monotonic() + 900
            while b"board arm-zero ready" not in log.read_bytes():
                assert board.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                time.sleep(1)
            client = openai.OpenAI(api_key=key, base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=600)
            deadline = time.monotonic() + 120
            while not client.models.list().data:
                assert time.monotonic() < deadline, "the board never came online"
                time.sleep(1)
            model = client.models.list().data[0].id
            answer = client.completions.create(
                model=model, prompt="The capital of France is", max_tokens=4, temperature=0
            )
            assert answer.choices[0].text.strip(), answer
            assert answer.model_extra["edgecache"]["device"] == "arm-zero"
            status = manage(
                "shell",
                "-c",
                "from dashboard.models import Device; d = Device.objects.get(name='arm-zero'); print(d.status.get('kernel_class', ''))",
            )
            assert status.splitlines()[-1].startswith("aarch64-armv8.0"), status
    finally:
        if board is not None and board.poll() is None:
            os.killpg(board.pid, signal.SIGTERM)
            try:
                board.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(board.pid, signal.SIGKILL)
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        subprocess.run(
            [sys.executable, "manage.py", "cachebox", "stop"], cwd=ROOT, env=env, capture_output=True, timeout=30
        )

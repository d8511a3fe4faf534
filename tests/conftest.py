"""Shared fixtures: real Valkey/Redis servers and the real model (loaded once per session)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cachebox import embedded
from cachebox.store import CacheBox

ROOT = Path(__file__).resolve().parent.parent
# `make test` sets EDGECACHE_REQUIRE_ALL=1: there a missing optional package (torch, openai,
# import-linter) fails the tests that need it; elsewhere those tests are skipped, saying why.
REQUIRE_ALL = os.environ.get("EDGECACHE_REQUIRE_ALL") == "1"


def require(module: str, why: str = ""):
    """``module`` imported: skipped without it, or a failure under EDGECACHE_REQUIRE_ALL=1 (never a silent skip)."""
    if not REQUIRE_ALL:
        return pytest.importorskip(module, reason=why or None)
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is missing and EDGECACHE_REQUIRE_ALL=1 (make test) runs every test: {why or exc} (run `make install`)", pytrace=False)


# Fixtures that load the model or talk to a Redis/Valkey server, and the marker a test using them carries.
MARKED_FIXTURES = {
    "engine": "model", "reference": "model", "make_board": "model",
    "valkey_url": "cachebox", "system_redis_url": "cachebox", "any_store_url": "cachebox",
}


def pytest_collection_modifyitems(config, items):
    """A test that loads the model or needs a server says so by its marker (``make test-fast`` leaves it out)."""
    unmarked = []
    for item in items:
        for fixture, marker in MARKED_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None:
                unmarked.append(f"{item.nodeid} uses {fixture} without @pytest.mark.{marker}")
    if unmarked:
        raise pytest.UsageError("tests without the marker their fixtures need:\n  " + "\n  ".join(sorted(set(unmarked))))


# llama.cpp's llama-server (the peer of ``bench vs-server``): where a selected test needs it and this
# machine has not built it yet, its build starts in the background as the run begins, at the idle
# scheduling class (it takes only CPU time the tests leave), and the test waits for it when it comes
# (the build's lock, ``inference.benchmarks.llama_server.ensure``). Built in that test's turn, it was
# about 5 of a fresh machine's 22 minutes of tests, with one of the two cores idle most of the rest.
_PEER_BUILD: dict = {}


def _idle_class():  # in the child, before exec: the build and its compilers run only on idle CPU
    os.setpgrp()
    os.nice(19)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def pytest_collection_finish(session):
    if not any(item.get_closest_marker("peer") for item in session.items):
        return
    from inference.benchmarks import llama_server

    if llama_server.binary_path().exists() or llama_server.missing_tools():
        return  # built, or the test says why it cannot be
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"edgecache-llama-server-build-{os.getpid()}.log"
    _PEER_BUILD["log"] = log
    with open(log, "w") as out:
        _PEER_BUILD["process"] = subprocess.Popen(
            [sys.executable, "-m", "inference.benchmarks.llama_server"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_idle_class,
        )
    session.config.get_terminal_writer().line(f"llama-server is being built in the background for the tests that need it (log: {log})")


def pytest_sessionfinish(session):
    process = _PEER_BUILD.get("process")
    if process is not None and process.poll() is None:  # the run ended before the build: stop it (its folder goes with it)
        import signal

        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def valkey_url(tmp_path_factory):
    """A real embedded Valkey server of the test session's own (not the checkout's)."""
    data_dir = tmp_path_factory.mktemp("valkey")
    port = embedded._low_free_ports(1)[0]  # free now (the folder's own port may be another program's)
    url = embedded.ensure_running(data_dir, port=port, maxmemory="512mb")
    yield url
    embedded.stop(data_dir, port)


@pytest.fixture(scope="session")
def system_redis_url():
    """The machine's Redis server (REDIS_URL deployments); skipped where there is none."""
    url = os.environ.get("EDGECACHE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    if not CacheBox(url).ping():
        pytest.skip(f"no Redis server answers at {url}")
    return url


@pytest.fixture(params=["embedded-valkey", "system-redis"])
def any_store_url(request):
    """Run a test against both kinds of cache box."""
    fixture = "valkey_url" if request.param == "embedded-valkey" else "system_redis_url"
    return request.getfixturevalue(fixture)


@pytest.fixture
def namespace(request):
    """A namespace of the test's own; its entries and catalog are removed afterwards."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    yield name
    for fixture in ("valkey_url", "system_redis_url"):
        if fixture in request.fixturenames:
            CacheBox(request.getfixturevalue(fixture)).flush(name)


@pytest.fixture(scope="session")
def engine():
    from inference.engine import Engine, EngineConfig
    from inference.model_file import resolve_model

    engine = Engine(resolve_model(), EngineConfig(n_ctx=2048))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def reference(engine):
    """The lab's reference engine (PyTorch) over the served model's GGUF: loaded once (~15 s, ~1 GB)."""
    require("torch", "the lab extra installs torch")
    from inference.lab.reference import ReferenceModel

    return ReferenceModel.load(engine.model_file.path, threads=engine.config.threads())


def assert_exact_serving_ignores_lab_runs(board, engine, prompt) -> None:
    """After a lab (approximate) run, an exact run finds nothing of it to reuse and answers as cold."""
    exact = board.run(prompt, max_tokens=3)
    assert exact.breakdown.matched_tokens == 0 and exact.breakdown.case == "miss"
    engine.clear()
    cold = board.run(prompt, max_tokens=3, use_cache=False)
    assert exact.tokens == cold.tokens


@pytest.fixture
def signing_keys(settings):
    """Signing keys as the commands on the control plane derive them (first generation of any namespace)."""
    from cachebox.signing import Keychain, derive_keyring

    return Keychain(lambda namespace: derive_keyring(settings.EDGECACHE_SIGNING_SECRET, namespace, 1))


@pytest.fixture
def make_board(engine, signing_keys):
    """Boards sharing the session's engine, each with its own catalogs (as separate devices)."""
    from inference.board import Board
    from inference.config import BoardConfig

    boards = []

    def build(url: str | None, namespace: str, device: str = "board-a", keys=signing_keys, **options):
        store = CacheBox(url, connect_timeout=0.3, timeout=2.0) if url else None
        # The board-local tiers are off unless a test asks: most tests measure the cache box.
        options = {"context_reuse": False, "ram_tier_bytes": 0, **options}
        board = Board(engine, store, BoardConfig(device=device, namespace=namespace, **options), background_sync=False, keys=keys)
        boards.append(board)
        return board

    yield build
    for board in boards:
        if board._sync_thread is not None:
            board._sync_thread.stop()


def control_plane_password(home: Path) -> str:
    """The embedded cache box's password of a control plane whose EDGECACHE_HOME is ``home`` (in
    its secrets folder, beside the state folder)."""
    return (Path(home).with_name(f"{Path(home).name}-secrets") / "cachebox_password").read_text().strip()


def run_manage(*args: str, env: dict | None = None, unset=(), input_bytes: bytes | None = None, timeout: float = 180):
    """Run ``python manage.py ...`` in a fresh process, as a user would."""
    full_env = {key: value for key, value in os.environ.items() if key not in unset}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        cwd=ROOT,
        env=full_env,
        input=input_bytes,
        capture_output=True,
        timeout=timeout,
    )


@pytest.fixture(autouse=True)
def _own_django_cache(settings):
    """Django's cache (rate-limit counters) of each test's own: never the checkout's cache box.

    Tests that need the shared Redis cache point ``settings.CACHES`` at a server themselves.
    """
    settings.CACHES = {"default": {"BACKEND": "cachebox.django_cache.JSONLocMemCache", "LOCATION": f"test-{uuid.uuid4().hex}"}}


@pytest.fixture(autouse=True)
def _no_board_identity(monkeypatch):
    """Each test starts in a process that is no board; one that becomes a board does not leak it."""
    from inference import edge

    monkeypatch.setattr(edge.enrollment, "_identity", None)

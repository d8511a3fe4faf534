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
        pytest.fail(
            f"{module} is missing and EDGECACHE_REQUIRE_ALL=1 (make test) runs every test: {why or exc} (run `make install`)",
            pytrace=False,
        )


# Fixtures that load the model or talk to a Redis/Valkey server, and the marker a test using them carries.
MARKED_FIXTURES = {
    "engine": "model",
    "reference": "model",
    "make_board": "model",
    "valkey_url": "cachebox",
    "system_redis_url": "cachebox",
    "any_store_url": "cachebox",
    "avx512_libs": "kernels",
    "other_kernel_libs": "kernels",
}


# Folders whose every test carries a marker: the folder gives it (tests/browser/ runs Chromium,
# tests/hosts/ makes network namespaces and cgroups).
FOLDER_MARKERS = {"browser": "browser", "hosts": "hosts"}


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item):
    """A test under tests/<folder>/ carries that folder's marker (``FOLDER_MARKERS``)."""
    parts = Path(str(item.path)).relative_to(ROOT / "tests").parts
    if len(parts) > 1 and parts[0] in FOLDER_MARKERS:
        item.add_marker(FOLDER_MARKERS[parts[0]])


@pytest.hookimpl(trylast=True)  # after pytest-django's order (database tests first), which it keeps within a group
def pytest_collection_modifyitems(config, items):
    """A test that loads the model or needs a server says so by its marker (``make test-fast`` leaves it out).
    On both cores, the groups go out longest first."""
    unmarked = []
    for item in items:
        for fixture, marker in MARKED_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None:
                unmarked.append(f"{item.nodeid} uses {fixture} without @pytest.mark.{marker}")
    if unmarked:
        raise pytest.UsageError(
            "tests without the marker their fixtures need:\n  " + "\n  ".join(sorted(set(unmarked)))
        )
    if _worker(config):  # ``--no-loadscope-reorder`` keeps this order, so that no long group starts last
        order = {group: index for index, group in enumerate(LONGEST_FIRST)}
        order.update({group: len(order) + 1 + index for index, group in enumerate(WAITS_FOR_BUILDS)})
        items.sort(key=lambda item: order.get(_group(item), len(LONGEST_FIRST)))


# -- both cores (pytest-xdist, ``make test``) ----------------------------------------------------
# Modules that share an expensive fixture, or a resource of the machine's, run in one worker: the
# lab's PyTorch reference (loaded once), the hosts' cgroup parent and subnets, Chromium beside a
# stack. Every other module is a group of its own.
GROUPS = {
    "test_lab": "torch",
    "test_early_exit": "torch",
    "test_anchors": "torch",
    "test_hosts": "hosts",
    "test_host_faults": "hosts",
    "test_browser": "browser",
    "test_browser_run_page_and_charts": "browser",
    "test_browser_chat_and_rerun": "browser",
    "test_browser_ui": "browser",
    "test_browser_keys": "browser",
    "test_board_start": "browser",
    "test_browser_walk": "browser",
}
# Groups taking 20 s or more, longest first (seconds in one serial run on 2 cores, `pytest
# --junitxml`, summed per group); the others follow in collection order.
LONGEST_FIRST = (
    "browser",  # 197
    "hosts",  # 124
    "test_pipeline",  # 83
    "torch",  # 66
    "test_redelivery",  # 64
    "test_overlap",  # 58
    "test_board_install",  # 54
    "test_commands",  # 37
    "test_web_security",  # 34
    "test_faults",  # 30
    "test_api",  # 28
    "test_board_acl",  # 26
    "test_tiers",  # 24
    "test_vs_server",  # 24 (the peer built; its build, where it is not, runs beside the tests)
    "test_fleet_sim",  # 20
    "test_tls",  # 19
)

# Groups whose first test waits for a preparation the run started in the background (an arm64 root
# and wheelhouse on a fresh machine: minutes): they go last, so no worker idles while it is made.
WAITS_FOR_BUILDS = ("test_arm64",)


def _worker(config) -> bool:
    """Whether this process is a worker of a run on both cores (``pytest -n 2``)."""
    return hasattr(config, "workerinput")


def _group(item) -> str:
    return _group_of(item.nodeid)


def _group_of(nodeid: str) -> str:
    module = Path(nodeid.split("::")[0]).stem
    return GROUPS.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """On both cores, the unit of work is a group: a module's tests go to one worker, with the
    modules of its group, in their order (the groups in ``pytest_collection_modifyitems``'s)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    return ByGroup(config, log)


def pytest_configure(config):
    """A worker's llama.cpp computes on its share of the cores (one each, two workers on two cores):
    workers each using every core's threads would take turns on them (OpenMP threads wait spinning).
    The run's first process names the file where the peer builds it and its workers start are
    noted (the workers inherit it)."""
    if _worker(config):
        share = max(1, (os.cpu_count() or 1) // int(config.workerinput.get("workercount", 1)))
        os.environ.setdefault("EDGECACHE_THREADS", str(share))
    else:
        os.environ[PEER_BUILDS] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"edgecache-peer-builds-{os.getpid()}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a transactional test that asked for its migrated rows back (``serialized_rollback``),
    they are put back at once: its teardown empties every table, and Django would restore them
    only as the next such test starts. Run alone, pytest-django orders those tests last; on both
    cores, a worker's next module would find no 'default' namespace, content types or permissions.
    Not after a session's last test: no test follows, and the test database is already destroyed
    (its connection points at the real database again)."""
    result = yield
    marker = item.get_closest_marker("django_db")
    if nextitem is not None and marker is not None and marker.kwargs.get("serialized_rollback"):
        from django.db import connections
        from pytest_django.plugin import blocking_manager_key

        with item.config.stash[blocking_manager_key].unblock():
            for connection in connections.all():
                contents = getattr(connection, "_test_serialized_contents", None)
                if contents:
                    connection.creation.deserialize_db_from_string(contents)
    return result


# llama.cpp's llama-server (the peer of ``bench vs-server``): where a selected test needs it and this
# machine has not built it yet, its build starts in the background as the run begins, at the idle
# scheduling class (it takes only CPU time the tests leave), and the test waits for it when it comes
# (the build's lock, ``dashboard.bench.llama_server.ensure``). Built in that test's turn, it was
# about 5 of a fresh machine's 22 minutes of tests, with one of the two cores idle most of the rest.
def _idle_class():  # in the child, before exec: the build and its compilers run only on idle CPU
    os.setpgrp()
    os.nice(19)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def pytest_collection_finish(session):
    """The builds the selected tests need and this machine lacks start in the background (``peer``:
    llama-server; ``kernels``: llama.cpp's libraries with other CPU kernels, ``dashboard.bench.llama_kernels``:
    the variant ``other_kernel_libs`` or ``avx512_libs`` will ask for)."""
    wanted = {
        marker for item in session.items for marker in ("peer", "kernels", "arm64") if item.get_closest_marker(marker)
    }
    if "peer" in wanted:
        from dashboard.bench import llama_server

        if not (
            llama_server.binary_path().exists() or llama_server.missing_tools()
        ):  # else built, or the test says why it cannot be
            _background_build(session, "dashboard.bench.llama_server", "llama-server")
    if "kernels" in wanted:
        from dashboard.bench import llama_kernels

        fixtures = {name for item in session.items for name in getattr(item, "fixturenames", ())}
        variants = {variant for fixture, variant in _kernel_variants().items() if fixture in fixtures}
        for variant in sorted(variants):
            if not llama_kernels.built(variant) and not llama_kernels.unavailable(variant):
                _background_build(session, "dashboard.bench.llama_kernels", f"llama-{variant}", variant)
    if "arm64" in wanted:
        from dashboard.bench import arm64

        if not arm64.ready() and not arm64.unavailable():
            _background_build(session, "dashboard.bench.arm64", "arm64-root-and-wheelhouse")


BUILD_MODULES = (b"dashboard.bench.llama_server", b"dashboard.bench.llama_kernels", b"dashboard.bench.arm64")


def _kernel_variants() -> dict[str, str]:
    """The fixtures that load another build of llama.cpp, and the variant each will ask for here."""
    from dashboard.bench import llama_kernels

    return {"other_kernel_libs": llama_kernels.default_variant(), "avx512_libs": "avx512"}


def _background_build(session, module: str, what: str, *arguments: str) -> None:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"edgecache-{what}-build-{os.getpid()}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *arguments],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_idle_class,
        )
    with open(
        os.environ[PEER_BUILDS], "a"
    ) as builds:  # on both cores, each worker starts one (the build's lock lets one build)
        builds.write(f"{process.pid} {log}\n")
    if not _worker(session.config):  # a worker's output is not shown: its controller says it (below)
        session.config.get_terminal_writer().line(_building(log))


def _building(log) -> str:
    from dashboard.bench.llama_kernels import VARIANTS

    what = {
        **{f"llama-{variant}-build": f"llama.cpp with {variant} kernels" for variant in VARIANTS},
        "arm64-root": "an arm64 Debian root and an aarch64 board wheelhouse",
    }
    what = next((text for key, text in what.items() if key in str(log)), "llama-server")
    return f"{what} is being built in the background for the tests that need it (log: {log})"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """On both cores, the controller says once that a worker started the peer's build (the first
    build's log shows its progress; another worker's waits for it)."""
    said = getattr(node.config, "_edgecache_builds_said", set())
    node.config._edgecache_builds_said = said
    for _, log in _builds():
        what = _building(log).split(" is being built")[0]
        if what not in said:
            said.add(what)
            node.config.get_terminal_writer().line(_building(log))


PEER_BUILDS = "EDGECACHE_TEST_PEER_BUILDS"  # the file where a run's processes note the builds they started


def _builds() -> list[tuple[int, str]]:
    """The builds this run's processes started: (process id, log), one "PID LOG" line each."""
    builds = Path(os.environ.get(PEER_BUILDS, "/nonexistent"))
    if not builds.exists():
        return []
    noted = (line.split(" ", 1) for line in builds.read_text().splitlines())
    return [(int(fields[0]), fields[1]) for fields in noted if len(fields) == 2 and fields[0].isdigit()]


def pytest_sessionfinish(session):
    """The run (on both cores: its controller, once every worker is done) stops the builds it
    started that are still going: the run ended before the build (its folder goes with it)."""
    if _worker(session.config):
        return
    pids = {pid for pid, _ in _builds()}
    if not pids:
        return
    import signal
    import time

    def running(pid: int) -> bool:  # a build still going (its number not taken by another process)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return any(module in cmdline for module in BUILD_MODULES)

    for pid in filter(running, pids):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in filter(running, pids):
        os.killpg(pid, signal.SIGKILL)
    Path(os.environ[PEER_BUILDS]).unlink(missing_ok=True)


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
    from inference.engine.llama import Engine, EngineConfig
    from inference.engine.model_file import resolve_model

    engine = Engine(resolve_model(), EngineConfig(n_ctx=2048, n_threads=int(os.environ.get("EDGECACHE_THREADS", "0"))))
    yield engine
    engine.close()


def _kernel_libs(variant: str) -> Path:
    """The folder of the pinned llama.cpp built with ``variant``'s kernels (``LLAMA_CPP_LIB_PATH`` for
    a board process): built once per machine (the run started it in the background where it was
    missing, ``pytest_collection_finish``; this waits for it). Skipped, saying why, on a CPU without
    the variant's instructions or a machine without compiler."""
    from dashboard.bench import llama_kernels

    why = llama_kernels.unavailable(variant)
    if why:
        pytest.skip(why)
    try:
        return llama_kernels.ensure(variant, lambda line: None)
    except llama_kernels.BuildUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def other_kernel_libs() -> tuple[str, Path]:
    """(variant, folder) of a second build of the pinned llama.cpp whose kernels differ from the
    project's AVX2 build, whatever this x86-64 CPU: avx512 where it runs it, else sse42
    (``llama_kernels.default_variant``; ``llama_kernels.VARIANTS[variant].kernel_class`` is the class
    it reports)."""
    from dashboard.bench import llama_kernels

    variant = llama_kernels.default_variant()
    return variant, _kernel_libs(variant)


@pytest.fixture(scope="session")
def avx512_libs() -> Path:
    """The folder of a second build of the pinned llama.cpp with AVX-512 kernels (the mixed fleet's
    ``x86-avx512`` board); skipped on a CPU without AVX-512."""
    return _kernel_libs("avx512")


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
    from cachebox.signing import Keychain, control_plane_ring, derive_keyring

    secret = settings.EDGECACHE_SIGNING_SECRET
    return Keychain(lambda namespace: control_plane_ring(derive_keyring(secret, namespace, 1), secret))


@pytest.fixture
def make_board(engine, signing_keys):
    """Boards sharing the session's engine, each with its own catalogs (as separate devices)."""
    from inference.board.config import BoardConfig
    from inference.board.runtime import Board

    boards = []

    def build(url: str | None, namespace: str, device: str = "board-a", keys=signing_keys, **options):
        store = CacheBox(url, connect_timeout=0.3, timeout=2.0) if url else None
        # The board-local tiers are off unless a test asks: most tests measure the cache box.
        options = {"context_reuse": False, "ram_tier_bytes": 0, **options}
        board = Board(
            engine, store, BoardConfig(device=device, namespace=namespace, **options), background_sync=False, keys=keys
        )
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


def opened_text(home: Path, stored: str | None) -> str | None:
    """A prompt, answer or schema text as a control plane whose EDGECACHE_HOME is ``home`` reads it from
    its database (sealed at rest under its master secret, ``dashboard.security.at_rest``)."""
    from dashboard.security.at_rest import open_text

    if not stored:
        return stored
    master = (Path(home).with_name(f"{Path(home).name}-secrets") / "signing_secret").read_text().strip().encode()
    return open_text(stored, master)


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
def _own_django_cache(settings, monkeypatch):
    """Django's cache (rate-limit counters) of each test's own: never the checkout's cache box.

    The rate limit's counts kept in this process start empty too: they outlive a cache's
    counters on purpose (a restarted cache box does not reopen the limit), so one test's
    requests would otherwise count against the next test's same user in the same minute.
    Tests that need the shared Redis cache point ``settings.CACHES`` at a server themselves.
    """
    from dashboard.security import ratelimit

    settings.CACHES = {
        "default": {"BACKEND": "dashboard.store.django_cache.JSONLocMemCache", "LOCATION": f"test-{uuid.uuid4().hex}"}
    }
    monkeypatch.setattr(ratelimit, "_local", ratelimit._LocalCounts())


@pytest.fixture(autouse=True)
def _no_board_identity(monkeypatch):
    """Each test starts in a process that is no board; one that becomes a board does not leak it."""
    from inference import board as edge

    monkeypatch.setattr(edge.enrollment, "_identity", None)


@pytest.fixture(autouse=True)
def _celery_app_kept():
    """A test that makes a board's Celery app (``inference.board.app.board_app`` sets it current, with only
    the board's own tasks) leaves the process's app as it found it: the control plane's task proxies
    (``dashboard.tasks.record_run``) resolve against the current app."""
    from celery import current_app

    before = current_app._get_current_object()
    yield
    before.set_current()
    before.set_default()

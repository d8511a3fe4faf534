"""What a board installs is the board: the project's wheel holds the board runtime (``inference``) and
the cache-box library (``cachebox``), and nothing the control plane or the operator runs (no
``dashboard``, no benchmark, no Django model, no torch), and the board process reaches every module
it ships."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # builds the wheel with pip, imports it in a process of its own

BOARD_ENTRY = "inference.board.main"  # `edgecache-board`, what `manage.py edge` runs too


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip install .` builds, from a copy of what it packs (a build/ folder left in the
    checkout by an older build would otherwise be packed too)."""
    from dashboard.bench.arm64 import board_sources  # what make board-wheels builds from, too

    source = board_sources(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=out,
    )
    (built,) = out.glob("edgecache-*.whl")
    return built


@pytest.fixture(scope="module")
def unpacked(wheel, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("unpacked")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root)
    return root


def modules_of(root: Path) -> set[str]:
    """The dotted names of the modules under ``root`` (packages by their ``__init__``)."""
    names = set()
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.add(".".join(parts))
    return names


def test_the_wheel_holds_the_board_and_the_cache_box_library_only(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(name for name in names if name.endswith(".dist-info/METADATA"))).decode()
        entry_points = archive.read(
            next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
        ).decode()
    tops = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"inference", "cachebox"}, tops
    assert not [
        name for name in names if "bench" in name or "migrations" in name or "management" in name or "dashboard" in name
    ]
    assert f"edgecache-board = {BOARD_ENTRY}:run" in entry_points
    # torch and Django come with extras only (lab, control); a board installs neither.
    for requirement in (
        line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")
    ):
        if (
            requirement.split(";")[0]
            .strip()
            .lower()
            .startswith(("torch", "django", "channels", "uvicorn", "plotly", "psycopg"))
        ):
            assert "extra ==" in requirement, requirement


def test_no_module_in_the_wheel_imports_django_or_the_control_plane(unpacked):
    """No Django model (no Django at all) and no control-plane module: a board has neither."""
    offenders = []
    for path in unpacked.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [
                f"{path.relative_to(unpacked)}: {name}"
                for name in names
                if name.split(".")[0] in ("django", "dashboard", "channels", "celery.contrib.django")
            ]
    assert not offenders, offenders


def test_the_board_process_reaches_every_module_the_wheel_ships(unpacked):
    """Every module shipped is reached from the board's entry point, the task modules its Celery app
    loads or a strategy its registry names (imports inside functions included: grimp reads them
    all), and all of them import in a process that has no Django and no control plane on its path."""
    import grimp

    shipped = modules_of(unpacked)
    script = f"""
import importlib.abc, json, sys
sys.path.insert(0, {str(unpacked)!r})
class NoControlPlane(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("django", "dashboard"):
            raise ImportError(f"a board has no {{name}}")
sys.meta_path.insert(0, NoControlPlane())
import inference.serving.strategies, inference.board.app
app = inference.board.app.board_app("memory://")  # the board's Celery app: the task modules it loads by name
roots = [{BOARD_ENTRY!r}, *app.conf.include] + [line.opens.partition(":")[0] for line in inference.serving.strategies.REGISTRY.values() if line.opens]
for name in {sorted(shipped)!r}:
    module = importlib.import_module(name)
    assert module.__file__.startswith({str(unpacked)!r}), (name, module.__file__)
print(json.dumps(roots))
"""
    done = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=300, cwd=unpacked
    )
    assert done.returncode == 0, done.stderr[-3000:]
    roots = json.loads(done.stdout.strip().splitlines()[-1])
    assert "inference.board.tasks" in roots and len(roots) >= 5  # the entry point, the tasks, the lab's strategies

    sys.path.insert(0, str(unpacked))
    try:
        graph = grimp.build_graph("inference", "cachebox", cache_dir=None)
    finally:
        sys.path.remove(str(unpacked))
    reached, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += graph.find_modules_directly_imported_by(name)
    # A package is imported with any module under it.
    reached |= {".".join(name.split(".")[:depth]) for name in reached for depth in range(1, name.count(".") + 1)}
    assert shipped - reached == set(), f"shipped but never imported by a board: {sorted(shipped - reached)}"

"""Who may import whom: the import-linter contracts in pyproject.toml hold, and they bite.

`lint-imports` reads the source (it imports nothing), so these tests need no server,
no database and no model. A module named in a string (settings, Celery task names)
is not an import and is not seen.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REQUIRE_ALL

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("cachebox", "inference", "dashboard")

# Skipped without import-linter, except under `make test` (EDGECACHE_REQUIRE_ALL=1), where it fails.
needs_lint_imports = pytest.mark.skipif(
    not LINT_IMPORTS.exists() and not REQUIRE_ALL,
    reason=f"import-linter is not installed in this venv ({LINT_IMPORTS} missing): run `make install`",
)


def lint_imports(root: Path = ROOT) -> subprocess.CompletedProcess:
    """lint-imports over the packages under ``root`` (the checkout, or a copy of it)."""
    # --no-cache: leave no .import_linter_cache in the checkout; a wide terminal so rich wraps nothing.
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )


@needs_lint_imports
def test_the_packages_keep_their_import_contracts():
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    """A copy of the packages and pyproject.toml: probes are written there, never into the checkout."""
    root = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@needs_lint_imports
@pytest.mark.parametrize(
    "package, line, contract",
    [
        ("cachebox", "import dashboard", "cachebox imports neither dashboard nor inference"),
        ("cachebox", "from inference.board import devices", "cachebox imports neither dashboard nor inference"),
        ("inference", "import dashboard.models", "inference does not import dashboard"),
        (
            "dashboard",
            "from dashboard.bench import common",
            "only the operator's tools import benchmarks, lab fitting and host harnesses",
        ),
        (
            "dashboard.actions",
            "from dashboard.views import runs",
            "dashboard in layers: entry points, actions, the board outbox, models",
        ),
        (
            "dashboard.outbox_probe",
            "import dashboard.actions.runs",
            "dashboard in layers: entry points, actions, the board outbox, models",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tree_copy, package, line, contract):
    """The contracts are not vacuous: one wrong import in a copy of the tree makes lint-imports fail."""
    if package.endswith("_probe"):  # a module of its own in a layer: the outbox's, below the actions
        probe = tree_copy / "dashboard" / "outbox.py"
        kept = probe.read_text()
        probe.write_text(kept + f"\n{line}  # written by tests/test_architecture.py into a copy of the tree\n")
        package = "dashboard"
    else:
        probe = tree_copy / package.replace(".", "/") / "_wrong_import_probe.py"
        kept = None
        probe.write_text(f"{line}  # written by tests/test_architecture.py into a copy of the tree\n")
    try:
        result = lint_imports(tree_copy)
    finally:
        if kept is None:
            probe.unlink()
        else:
            probe.write_text(kept)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    culprit = "dashboard.outbox" if kept is not None else f"{package}._wrong_import_probe"
    assert contract in broken and culprit in broken, result.stdout


def lazy_imports_without_reason(source: str, path: str = "<probe>") -> list[str]:
    """``path:line  module`` of each import of the project's packages (or a relative one) inside a
    function of ``source`` that has no ``# lazy:`` comment on its lines or on the line above."""
    lines = source.splitlines()
    missing = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
            elif isinstance(node, ast.Import):
                module = node.names[0].name
            else:
                continue
            if not (module.startswith(".") or module.split(".")[0] in PACKAGES):
                continue
            around = lines[max(node.lineno - 2, 0) : node.end_lineno]  # the line above and the import's own
            if not any("# lazy:" in line for line in around):
                missing.append(f"{path}:{node.lineno}  {module}")
    return sorted(set(missing))  # a nested function's import is walked from each function around it


def test_every_import_inside_a_function_says_why_it_is_lazy():
    """A maintainer reads a module's dependencies at its top: an import of the project's own packages
    inside a function is the exception (an import cycle, models before the apps are ready, a heavy or
    optional dependency kept out of a process, such as a board's or ``manage.py bench``'s) and says
    which, in a ``# lazy:`` comment on its line or the line above. Migrations are left out."""
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" not in path.parts:
                missing += lazy_imports_without_reason(path.read_text(), str(path.relative_to(ROOT)))
    assert not missing, "imports inside a function without a `# lazy:` reason:\n" + "\n".join(missing)


def test_an_import_inside_a_function_without_a_reason_is_found():
    """The check above is not vacuous: it sees project and relative imports in (nested) functions and
    methods, and lets through those with a reason, module-level imports and other packages'."""
    source = (
        "import dashboard.models\n"
        "def f():\n"
        "    import json\n"
        "    from dashboard.models import Device\n"
        "    # lazy: a reason\n"
        "    from inference.engine import llama\n"
        "    from .models import Namespace  # lazy: a reason\n"
        "    class C:\n"
        "        def m(self):\n"
        "            from . import actions\n"
    )
    assert lazy_imports_without_reason(source) == ["<probe>:10  .", "<probe>:4  dashboard.models"]


def test_a_missing_optional_package_skips_here_and_fails_under_make_test(monkeypatch):
    """`make test` sets EDGECACHE_REQUIRE_ALL=1: there no test is skipped for a package it forgot to install."""
    from . import conftest

    monkeypatch.setattr(conftest, "REQUIRE_ALL", False)
    with pytest.raises(pytest.skip.Exception):
        conftest.require("edgecache_no_such_package", "an example")
    monkeypatch.setattr(conftest, "REQUIRE_ALL", True)
    with pytest.raises(pytest.fail.Exception, match="edgecache_no_such_package is missing and EDGECACHE_REQUIRE_ALL=1"):
        conftest.require("edgecache_no_such_package", "an example")
    assert conftest.require("json").dumps([]) == "[]"


def test_make_test_requires_every_package_and_test_fast_leaves_out_the_slow_markers():
    makefile = (ROOT / "Makefile").read_text()
    assert "EDGECACHE_REQUIRE_ALL=1 $(PY) -m pytest" in makefile
    fast = next(
        line for line in makefile.splitlines() if line.strip().startswith("$(PY) -m pytest") and "not model" in line
    )
    assert all(f"not {marker}" in fast for marker in ("model", "cachebox", "browser", "processes"))


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_the_code_is_linted_and_formatted(command):
    """ruff's lint and format (pyproject.toml's settings) hold over the whole tree, as make test-fast checks."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]

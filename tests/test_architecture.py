"""Who may import whom: the import-linter contracts in pyproject.toml hold, and they bite.

`lint-imports` reads the source (it imports nothing), so these tests need no server,
no database and no model. A module named in a string (settings, Celery task names)
is not an import and is not seen.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

needs_lint_imports = pytest.mark.skipif(
    not LINT_IMPORTS.exists(), reason=f"import-linter is not installed in this venv ({LINT_IMPORTS} missing): run `make install`"
)


def lint_imports() -> subprocess.CompletedProcess:
    # --no-cache: leave no .import_linter_cache in the checkout; a wide terminal so rich wraps nothing.
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=ROOT,
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


@needs_lint_imports
@pytest.mark.parametrize(
    "package, line, contract",
    [
        ("cachebox", "import dashboard", "cachebox imports neither dashboard nor inference"),
        ("cachebox", "from inference import devices", "cachebox imports neither dashboard nor inference"),
        ("inference", "import dashboard.models", "inference does not import dashboard"),
        ("inference", "from inference.benchmarks import common", "only the control plane (its bench command) imports inference.benchmarks"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(package, line, contract):
    """The contracts are not vacuous: one wrong import in the real tree makes lint-imports fail."""
    probe = ROOT / package / "_wrong_import_probe.py"
    assert not probe.exists(), f"{probe} is left over from an interrupted run: delete it"
    probe.write_text(f"{line}  # written by tests/test_architecture.py, deleted at once\n")
    try:
        result = lint_imports()
    finally:
        probe.unlink()
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and f"{package}._wrong_import_probe" in broken, result.stdout

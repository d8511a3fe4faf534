"""llama.cpp from the pinned llama-cpp-python sdist, for what the benchmarks build once per machine
(``llama_server``: the peer; ``llama_kernels``: other CPU kernels; ``arm64``: a Pi's wheelhouse):
fetch and unpack it, run a build step, compile a target with a progress line per tenth.

Each caller passes the exception its own callers catch (``error``), so a failed step says what
could not be built in that caller's words."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Callable


def run_step(command: list[str], what: str, work: Path | None, *, error: type[Exception]) -> None:
    """Run one build step in ``work``; ``error`` with the end of its output when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=work)
    if done.returncode:
        raise error(f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout)[-1500:]}")


def download_sdist(version: str, work: Path, *, error: type[Exception]) -> Path:
    """llama-cpp-python ``version``'s source archive, downloaded into ``work`` by pip."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps"]
    run_step([*command, f"llama-cpp-python=={version}", "-d", str(work)], "pip download", work, error=error)
    found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise error(f"pip downloaded no llama-cpp-python {version} sdist")
    return found[0]


def unpacked_llama(version: str, work: Path, *, error: type[Exception]) -> Path:
    """The sdist downloaded and unpacked in ``work``: its vendored llama.cpp source folder."""
    with tarfile.open(download_sdist(version, work, error=error)) as archive:
        archive.extractall(work, filter="data")
    source = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        raise error(f"the llama-cpp-python {version} sdist has no vendor/llama.cpp")
    return source


def compile_target(
    build: Path, target: str, jobs: int, write: Callable[[str], None], label: str, *, error: type[Exception]
) -> None:
    """``cmake --build`` of ``target``, its output kept in ``build.log`` beside ``build``, and one
    progress line (``label`` build N%) per tenth; ``error`` with the log's end when it fails."""
    command = ["cmake", "--build", str(build), "--target", target, "-j", str(jobs)]
    log = build.parent / "build.log"
    shown = -10
    with (
        open(log, "w") as out,
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process,
    ):
        for line in process.stdout:
            out.write(line)
            if line.startswith("[") and "%]" in line[:7]:
                percent = int(line[1:4].strip() or 0)
                if percent >= shown + 10:
                    shown = percent
                    write(f"  {label} build {percent}%")
        code = process.wait()
    if code:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise error(f"building {label} failed (exit {code}):\n{tail}")

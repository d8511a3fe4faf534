"""llama.cpp's own `llama-server`, built from the sources of the llama-cpp-python sdist we pin.

A bench helper, never a product dependency: ``bench vs-server`` and its smoke test use it as the
peer a user would otherwise run on each board. The sdist of the pinned llama-cpp-python (it vendors
llama.cpp, ``tools/server`` included) is fetched with pip, built with CMake (CPU only, no curl, no
TLS, no web UI download; Release with llama.cpp's defaults, as the wheel is) and the binary is kept
in ``~/.cache/edgecache/peers/llama-server-<version>/`` (``EDGECACHE_PEERS_DIR`` moves it), so it is
built once per machine (about 6 minutes on 2 cores) and a fresh clone reuses it.

``python -m inference.benchmarks.llama_server`` builds it (or prints where it is). One build at a
time per machine: a second caller waits for the first's (a lock beside the binary), so the test run
can start it in the background while other tests run (``tests/conftest.py``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

import llama_cpp

from inference.bindings import cmake_args

VERSION = llama_cpp.__version__  # the sdist is the version we run: its llama.cpp is the wheel's

# Same as the wheel (llama-cpp-python's CMakeLists forces curl off; Release; the CPU flags of
# ``make install``, ``inference.bindings.cmake_args``); no tests, examples or other tools; no HTTPS (loopback only) and no prebuilt web UI,
# which llama.cpp would otherwise fetch from the network at build time.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary to cache
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    *cmake_args(),
)


class PeerUnavailable(Exception):
    """The peer cannot be built here (no compiler, no CMake, no sdist): the message says why."""


def peers_dir() -> Path:
    return Path(os.environ.get("EDGECACHE_PEERS_DIR") or Path.home() / ".cache" / "edgecache" / "peers")


def binary_path(version: str = VERSION) -> Path:
    flavour = "-avx2" if cmake_args() else ""  # not the -march=native binaries of earlier builds (inference.bindings)
    return peers_dir() / f"llama-server-{version}{flavour}" / "llama-server"


def missing_tools() -> list[str]:
    """The build tools this machine lacks (empty: it can build the peer)."""
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    return missing


def ensure(write: Callable[[str], None] = print, *, version: str = VERSION, jobs: int | None = None) -> Path:
    """The path of a built ``llama-server`` of ``version``: cached, else built now, or waited for
    where another process is building it (PeerUnavailable)."""
    binary = binary_path(version)
    if binary.exists():
        return binary
    missing = missing_tools()
    if missing:
        raise PeerUnavailable(f"cannot build llama-server: this machine has no {', '.join(missing)} (apt-get install cmake g++)")
    binary.parent.parent.mkdir(parents=True, exist_ok=True)
    with open(binary.parent.with_name(binary.parent.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            write(f"Waiting for the llama-server {version} build another process started (its lock: {lock.name})...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists():  # built by the process we waited for
            return binary
        return _build_peer(binary, version, write, jobs)


def _build_peer(binary: Path, version: str, write: Callable[[str], None], jobs: int | None) -> Path:
    target = binary.parent
    jobs = jobs or os.cpu_count() or 2
    with tempfile.TemporaryDirectory(prefix="llama-server-build-", dir=target.parent) as work:
        work = Path(work)
        write(f"Building llama.cpp's llama-server {version} from the llama-cpp-python sdist (once per machine, about 6 minutes on 2 cores)...")
        sdist = _download_sdist(version, work)
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        if not (source / "tools" / "server").is_dir():
            raise PeerUnavailable(f"the llama-cpp-python {version} sdist has no vendor/llama.cpp/tools/server")
        build = work / "build"
        _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], "configure", work)
        _build(build, jobs, write, work)
        built = build / "bin" / "llama-server"
        if not built.exists():
            raise PeerUnavailable(f"the build finished without {built}")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        shutil.copy2(built, staging / "llama-server")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # atomic: a cached binary is always a whole one
    write(f"llama-server {version} built: {binary}")
    return binary


def version_of(binary: Path) -> str:
    """``llama-server --version`` (llama.cpp prints it on stderr), one line."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    text = (done.stdout + done.stderr).strip().splitlines()
    return " ".join(line.strip() for line in text if line.strip().startswith(("version", "built"))) or " ".join(text)[:200]


def _download_sdist(version: str, work: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps", f"llama-cpp-python=={version}", "-d", str(work)]
    _run(command, "pip download", work)
    found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise PeerUnavailable(f"pip downloaded no llama-cpp-python {version} sdist")
    return found[0]


def _build(build: Path, jobs: int, write: Callable[[str], None], work: Path) -> None:
    """cmake --build, with one progress line per tenth of the build."""
    command = ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]
    log = work / "build.log"
    shown = -10
    with open(log, "w") as out, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout:
            out.write(line)
            if line.startswith("[") and "%]" in line[:7]:
                percent = int(line[1:4].strip() or 0)
                if percent >= shown + 10:
                    shown = percent
                    write(f"  llama-server build {percent}%")
        code = process.wait()
    if code:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise PeerUnavailable(f"building llama-server failed (exit {code}):\n{tail}")


def _run(command: list[str], what: str, work: Path) -> None:
    done = subprocess.run(command, capture_output=True, text=True, cwd=work)
    if done.returncode:
        raise PeerUnavailable(f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout)[-1500:]}")


if __name__ == "__main__":
    import argparse
    import signal

    parser = argparse.ArgumentParser(description="Build llama.cpp's llama-server from the pinned sdist (or print where it is).")
    parser.add_argument("--jobs", type=int, default=None, help="compile jobs (default: one per CPU)")
    options = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("llama-server build stopped"))  # the build folder is removed on the way out
    try:
        path = ensure(lambda line: print(line, flush=True), jobs=options.jobs)
    except PeerUnavailable as exc:
        sys.exit(str(exc))
    print(path, version_of(path))

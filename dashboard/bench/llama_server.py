"""llama.cpp's own `llama-server`, built from the sources of the llama-cpp-python sdist we pin.

A bench helper, never a product dependency: ``bench vs-server`` and its smoke test use it as the
peer a user would otherwise run on each board. The sdist of the pinned llama-cpp-python (it vendors
llama.cpp, ``tools/server`` included) is fetched with pip and only the server and its ``common``
library are compiled (CMake, Release, unity batches; no curl, no TLS, no web UI download). They
link against the wheel's own ``libllama``, ``libggml*`` and ``libmtmd`` (``llama_cpp/lib``): the
peer runs the very kernels EdgeCache's boards run, and a machine compiles ggml and the models once,
in ``make install``, not twice (measured on 2 cores: 4m45 and 6.4 CPU-minutes, where building
llama.cpp whole took 11m40 and 20.4). The binary and those libraries
are kept in ``~/.cache/edgecache/peers/llama-server-<version>-wheel/`` (``EDGECACHE_PEERS_DIR``
moves it; the binary finds its libraries beside it), so it is built once per machine and a fresh
clone reuses it.

``python -m dashboard.bench.llama_server`` builds it (or prints where it is). One build at a
time per machine: a second caller waits for the first's (a lock beside the binary), so the test run
can start it in the background while other tests run (``tests/conftest.py``).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import llama_cpp

from dashboard.bench.sdist import compile_target, run_step, unpacked_llama

VERSION = llama_cpp.__version__  # the sdist is the version we run: its llama.cpp is the wheel's
WHEEL_LIBS = Path(llama_cpp.__file__).parent / "lib"  # the wheel's libllama, libggml*, libmtmd

# Release, as the wheel; no curl (llama-cpp-python's build forces it off too), no HTTPS (loopback
# only) and no prebuilt web UI, which llama.cpp would otherwise fetch from the network at build
# time; no tests or examples. The server's own code in unity batches: its sources share large
# headers (JSON, templates), compiled once per batch instead of once per file (6.4 CPU-minutes
# instead of 9.5 on this machine class). No build RPATH: the binary finds the wheel's libraries
# copied beside it ($ORIGIN), not in the virtual environment it was built from.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # common and the server linked into the binary
    "-DCMAKE_UNITY_BUILD=ON",
    "-DCMAKE_SKIP_BUILD_RPATH=ON",
    "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath,$ORIGIN",
)

# The project CMake configures: llama.cpp's own, with the wheel's libraries as its llama, ggml and
# mtmd targets, so that their sources (src/, ggml/, tools/mtmd/) are not compiled again.
WRAPPER_CMAKE = """\
cmake_minimum_required(VERSION 3.18)
project(edgecache_peer C CXX)
set(LLAMA_SOURCE "" CACHE PATH "the sdist's vendor/llama.cpp")
set(WHEEL_LIBS "" CACHE PATH "the wheel's llama_cpp/lib")

function(wheel_library name file includes links)
    add_library(${name} SHARED IMPORTED GLOBAL)
    set_target_properties(${name} PROPERTIES IMPORTED_LOCATION "${WHEEL_LIBS}/${file}"
        INTERFACE_INCLUDE_DIRECTORIES "${includes}" INTERFACE_LINK_LIBRARIES "${links}")
endfunction()
wheel_library(ggml-base libggml-base.so "${LLAMA_SOURCE}/ggml/include" "")
wheel_library(ggml-cpu libggml-cpu.so "${LLAMA_SOURCE}/ggml/include" "ggml-base")
wheel_library(ggml libggml.so "${LLAMA_SOURCE}/ggml/include" "ggml-base;ggml-cpu")
wheel_library(llama libllama.so "${LLAMA_SOURCE}/include" "ggml")
wheel_library(mtmd libmtmd.so "${LLAMA_SOURCE}/tools/mtmd" "llama")

# llama.cpp adds ggml only where no parent defined it; libllama and libmtmd it always builds:
# their folders are skipped here. Nothing is installed (the binary is copied out of the build).
function(add_subdirectory folder)
    if(NOT folder MATCHES "^(src|mtmd|tools/mtmd)$")
        _add_subdirectory(${ARGV})
    endif()
endfunction()
function(install)
endfunction()

add_subdirectory("${LLAMA_SOURCE}" llama.cpp)

# Sources that do not compile in one unity batch with their neighbours.
set_source_files_properties("${LLAMA_SOURCE}/common/json.cpp" DIRECTORY "${LLAMA_SOURCE}/common"
    PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
"""


class PeerUnavailable(Exception):
    """The peer cannot be built here (no compiler, no CMake, no sdist): the message says why."""


def peers_dir() -> Path:
    return Path(os.environ.get("EDGECACHE_PEERS_DIR") or Path.home() / ".cache" / "edgecache" / "peers")


def binary_path(version: str = VERSION) -> Path:
    """Where the binary is kept, its copies of the wheel's libraries beside it ("-wheel": not the
    self-contained binaries earlier builds kept, which compiled ggml again)."""
    return peers_dir() / f"llama-server-{version}-wheel" / "llama-server"


def wheel_libraries(folder: Path = WHEEL_LIBS) -> list[Path]:
    """The wheel's shared libraries by the names a binary asks for (``libllama.so.0``, ...)."""
    return sorted(path for path in folder.glob("lib*.so.*") if re.fullmatch(r"lib[\w+-]+\.so\.\d+", path.name))


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
        raise PeerUnavailable(
            f"cannot build llama-server: this machine has no {', '.join(missing)} (apt-get install cmake g++)"
        )
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
        write(
            f"Building llama.cpp's llama-server {version} from the llama-cpp-python sdist against its wheel's libraries (once per machine, about 5 minutes on 2 cores)..."
        )
        source = unpacked_llama(version, work, error=PeerUnavailable)
        if not (source / "tools" / "server").is_dir():
            raise PeerUnavailable(f"the llama-cpp-python {version} sdist has no vendor/llama.cpp/tools/server")
        libraries = wheel_libraries()
        if not any(path.name.startswith("libllama.so.") for path in libraries):
            raise PeerUnavailable(
                f"llama-cpp-python's wheel has no libllama in {WHEEL_LIBS}: reinstall it with `make install`"
            )
        project = work / "peer"
        project.mkdir()
        (project / "CMakeLists.txt").write_text(WRAPPER_CMAKE)
        build = work / "build"
        configure = ["cmake", "-S", str(project), "-B", str(build), *CMAKE_FLAGS]
        configure += [f"-DLLAMA_SOURCE={source}", f"-DWHEEL_LIBS={WHEEL_LIBS}"]
        run_step(configure, "configure", work, error=PeerUnavailable)
        compile_target(build, "llama-server", jobs, write, "llama-server", error=PeerUnavailable)
        built = build / "bin" / "llama-server"
        if not built.exists():
            raise PeerUnavailable(f"the build finished without {built}")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        shutil.copy2(built, staging / "llama-server")
        for library in libraries:
            shutil.copy2(library, staging / library.name)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # atomic: a cached binary is always a whole one
    write(f"llama-server {version} built: {binary}")
    return binary


def version_of(binary: Path) -> str:
    """``llama-server --version`` (llama.cpp prints it on stderr), one line."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    text = (done.stdout + done.stderr).strip().splitlines()
    return (
        " ".join(line.strip() for line in text if line.strip().startswith(("version", "built"))) or " ".join(text)[:200]
    )


if __name__ == "__main__":
    import argparse
    import signal

    parser = argparse.ArgumentParser(
        description="Build llama.cpp's llama-server from the pinned sdist (or print where it is)."
    )
    parser.add_argument("--jobs", type=int, default=None, help="compile jobs (default: one per CPU)")
    options = parser.parse_args()
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit("llama-server build stopped")
    )  # the build folder is removed on the way out
    try:
        path = ensure(lambda line: print(line, flush=True), jobs=options.jobs)
    except PeerUnavailable as exc:
        sys.exit(str(exc))
    print(path, version_of(path))

"""Other builds of the llama.cpp we pin, with other CPU kernels: a second kernel class on one machine.

A bench and test helper, never a product dependency. Two builds of the same llama.cpp compute other
bits (SIMD sums of other widths in another order; ggml picks other kernels per instruction set), so a
machine that can run two builds can stand for a fleet of two kernel classes: ``bench kernels`` and the
tests of ``inference.engine.kernels`` load one with llama-cpp-python's ``LLAMA_CPP_LIB_PATH``. The
variants (``VARIANTS``) are wider than the project's AVX2 build (``avx512``, where the CPU has it) or
narrower (``sse42``, which any x86-64 CPU of the last fifteen years runs): ``default_variant`` is the
one that stands for this machine's second class.

The libraries are compiled from the vendored llama.cpp of the pinned llama-cpp-python sdist (the
very sources of the wheel ``make install`` builds), shared, target ``llama`` only (libllama and
libggml*; a few minutes on 2 cores), and kept in ``~/.cache/edgecache/kernels/llama-<version>-<variant>/``
(``EDGECACHE_KERNELS_DIR`` moves it): built once per machine, outside the repository. One build at a
time per variant: a second caller waits for the first's (a lock beside the folder), so a test run
can start it in the background at idle priority (``tests/conftest.py``) and the test that needs it
waits for it. ``python -m dashboard.bench.llama_kernels [VARIANT]`` builds one, ``default_variant``
without a name (or prints where it is).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

from dashboard.bench.sdist import compile_target, run_step, unpacked_llama

VERSION = importlib.metadata.version("llama-cpp-python")


class Variant(NamedTuple):
    flags: tuple[str, ...]  # CMake flags, beside COMMON_FLAGS
    cpu_flag: str  # the flag of /proc/cpuinfo a machine needs to run the build
    kernel_class: str  # the class its build reports (inference.engine.kernels.class_name of its system info)


# In the order ``default_variant`` prefers them. -DGGML_NATIVE=OFF turns on ggml's x86 options up to
# AVX2 (SSE42, AVX, AVX2, BMI2, FMA, F16C: the project's build); a variant turns on or off what differs.
VARIANTS = {
    "avx512": Variant(("-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON"), "avx512f", "x86_64-avx512"),
    # ggml's own "sse42" CPU variant (ggml/src/CMakeLists.txt): -msse4.2, no AVX of any kind. ggml has
    # no SSE4 kernels of its own (its x86 code picks the SSSE3 ones), and reports "SSE3 = 1 | SSSE3 = 1":
    # its class is the SSSE3 one.
    "sse42": Variant(
        (
            "-DGGML_NATIVE=OFF",
            "-DGGML_SSE42=ON",
            *(
                f"-DGGML_{option}=OFF"
                for option in ("AVX", "AVX2", "AVX_VNNI", "BMI2", "FMA", "F16C", "AVX512", "AMX_TILE", "AMX_INT8")
            ),
        ),
        "sse4_2",
        "x86_64-ssse3",
    ),
}
COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    # The libraries find each other beside themselves ($ORIGIN), not in the build folder (removed).
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
    "-DCMAKE_BUILD_RPATH=$ORIGIN",
)


class BuildUnavailable(Exception):
    """This build cannot be made or run here (no compiler, no CMake, a CPU without its instructions)."""


def kernels_dir() -> Path:
    return Path(os.environ.get("EDGECACHE_KERNELS_DIR") or Path.home() / ".cache" / "edgecache" / "kernels")


def library_dir(variant: str, version: str = VERSION) -> Path:
    """The folder to give llama-cpp-python as ``LLAMA_CPP_LIB_PATH`` (libllama.so and libggml* in it)."""
    return kernels_dir() / f"llama-{version}-{variant}"


def built(variant: str, version: str = VERSION) -> bool:
    return (library_dir(variant, version) / "libllama.so").exists()


def cpu_runs(variant: str, cpuinfo: str | None = None) -> bool:
    """Whether this machine's CPU has the instructions ``variant`` is compiled for."""
    flag = VARIANTS[variant].cpu_flag
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and flag in line.split() for line in cpuinfo.splitlines())


def default_variant(cpuinfo: str | None = None) -> str:
    """The variant that stands for this machine's second kernel class (what the kernel-class tests
    and a bare ``python -m dashboard.bench.llama_kernels`` build): the first of ``VARIANTS`` the CPU
    runs (avx512, the farthest from the project's AVX2 build, else sse42), or the last where it runs
    none (not an x86-64 CPU: ``unavailable`` then says what it lacks)."""
    return next((variant for variant in VARIANTS if cpu_runs(variant, cpuinfo)), list(VARIANTS)[-1])


def missing_tools() -> list[str]:
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    return missing


def unavailable(variant: str) -> str:
    """Why ``variant`` cannot be built and run here ('' when it can)."""
    if variant not in VARIANTS:
        return f"unknown llama.cpp build variant {variant!r}: choose one of {', '.join(VARIANTS)}"
    if not cpu_runs(variant):
        return f"this CPU lacks {VARIANTS[variant].cpu_flag}: the {variant} build of llama.cpp cannot run here"
    if built(variant):
        return ""
    missing = missing_tools()
    return (
        f"cannot build llama.cpp here: this machine has no {', '.join(missing)} (apt-get install cmake g++)"
        if missing
        else ""
    )


def ensure(
    variant: str, write: Callable[[str], None] = print, *, version: str = VERSION, jobs: int | None = None
) -> Path:
    """The folder of a built ``variant``: cached, else built now, or waited for where another process builds it."""
    why = unavailable(variant)
    if why:
        raise BuildUnavailable(why)
    target = library_dir(variant, version)
    if built(variant, version):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            write(
                f"Waiting for the llama.cpp {version} {variant} build another process started (its lock: {lock.name})..."
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        if built(variant, version):
            return target
        return _build(variant, target, version, write, jobs)


def _build(variant: str, target: Path, version: str, write: Callable[[str], None], jobs: int | None) -> Path:
    jobs = jobs or os.cpu_count() or 2
    with tempfile.TemporaryDirectory(prefix=f"llama-{variant}-build-", dir=target.parent) as work:
        work = Path(work)
        write(
            f"Building llama.cpp {version} ({variant} kernels) from the llama-cpp-python sdist (once per machine, minutes)..."
        )
        source = unpacked_llama(version, work, error=BuildUnavailable)
        build = work / "build"
        configure = ["cmake", "-S", str(source), "-B", str(build), *COMMON_FLAGS, *VARIANTS[variant].flags]
        run_step(configure, "configure", work, error=BuildUnavailable)
        compile_target(build, "llama", jobs, write, f"llama.cpp {variant}", error=BuildUnavailable)
        libraries = sorted((build / "bin").glob("lib*.so*"))
        if not any(path.name == "libllama.so" for path in libraries):
            raise BuildUnavailable(f"the build finished without {build / 'bin' / 'libllama.so'}")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for library in libraries:
            shutil.copy2(library, staging / library.name, follow_symlinks=False)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # atomic: a cached build is always a whole one
    write(f"llama.cpp {version} ({variant}) built: {target}")
    return target


if __name__ == "__main__":
    import argparse
    import signal

    parser = argparse.ArgumentParser(
        description="Build llama.cpp's libraries with other CPU kernels (or print where they are)."
    )
    parser.add_argument(
        "variant",
        nargs="?",
        default=default_variant(),
        choices=sorted(VARIANTS),
        help="the kernels to build (default: this machine's second class, %(default)s)",
    )
    parser.add_argument("--jobs", type=int, default=None, help="compile jobs (default: one per CPU)")
    options = parser.parse_args()
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit("llama.cpp build stopped")
    )  # the build folder is removed on the way out
    try:
        path = ensure(options.variant, lambda line: print(line, flush=True), jobs=options.jobs)
    except BuildUnavailable as exc:
        sys.exit(str(exc))
    print(path)

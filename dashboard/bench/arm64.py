"""aarch64 boards on this x86 machine: a board's wheelhouse cross-built here, and a real arm64
Debian root run under qemu-user to install and run it.

A test and bench helper, never a product dependency. Three things, each built once per machine and
kept outside the repository (``~/.cache/edgecache/arm64/``; ``EDGECACHE_ARM64_DIR`` moves it), one
build at a time (a lock beside each), so a test run starts them in the background at idle priority
(``tests/conftest.py``) and the test that needs them waits:

- **llama.cpp for aarch64**, cross-compiled (Debian's ``aarch64-linux-gnu`` toolchain, CMake; no
  compiling under emulation) from the vendored llama.cpp of the pinned llama-cpp-python sdist, for
  one kernel class: ``armv8.0`` (portable: a Pi Zero 2W's or Pi 3's Cortex-A53, and every later
  Pi) or ``armv8.2-dotprod-fp16`` (a Pi 5's Cortex-A76). Shared libraries, no OpenMP (ggml's own
  threads), so a board's root needs nothing but libc and libstdc++.
- **a wheelhouse** per class (``make board-wheels ARCH=aarch64 [KERNELS=...]``): every wheel a
  board installs (``pip install --no-index --find-links WHEELHOUSE edgecache``): the project's own
  wheel, the registry's aarch64 wheels of its dependencies, and llama-cpp-python's Python half
  packed with that class's libraries in ``llama_cpp/lib`` (PyPI has only its sdist: a Pi would
  otherwise compile llama.cpp for an hour in 512 MB).
- **an arm64 Debian root** (``debootstrap --arch=arm64 --variant=minbase``, with Python and no
  compiler), entered with ``chroot`` once binfmt_misc runs arm64 binaries through
  ``qemu-aarch64-static``; ``QEMU_CPU`` picks the CPU a process sees (``cortex-a53``, ``cortex-a76``).

Timings under emulation say nothing about a real Pi: bits, bytes and memory do.

``python -m dashboard.bench.arm64 [root|libs|wheelhouse|all] [--kernels CLASS] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator

from dashboard.bench.llama_kernels import COMMON_FLAGS
from dashboard.bench.sdist import download_sdist, unpacked_llama

VERSION = importlib.metadata.version("llama-cpp-python")
SUITE = "bookworm"  # the Debian release of the root (Python 3.11, as a Raspberry Pi OS of the day)
PYTHON_TAG = "311"
# Its Python, whole: dependencies choose by it (redis-py needs async-timeout before 3.11.3).
PYTHON_VERSION = "3.11.2"

# Kernel class -> (the CPU qemu emulates for it, ggml's -march for it).
CLASSES = {
    "armv8.0": ("cortex-a53", "armv8-a"),
    "armv8.2-dotprod-fp16": ("cortex-a76", "armv8.2-a+dotprod+fp16"),
}
DEFAULT_CLASS = "armv8.0"  # runs on every 64-bit Pi: the class a mixed fleet of Pis can pin to

APT_PACKAGES = (
    "qemu-user-static",
    "binfmt-support",
    "debootstrap",
    "gcc-aarch64-linux-gnu",
    "g++-aarch64-linux-gnu",
    "cmake",
)

# Debian's aarch64 cross toolchain, portable kernels of the class asked for (GGML_CPU_ARM_ARCH), no
# OpenMP; then the flags of every other build of ours (shared libraries that find each other beside themselves).
CROSS_FLAGS = (
    "-DCMAKE_SYSTEM_NAME=Linux",
    "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
    "-DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc",
    "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++",
    "-DGGML_NATIVE=OFF",
    "-DGGML_OPENMP=OFF",
    *COMMON_FLAGS,
)


class Arm64Unavailable(Exception):
    """This machine cannot build or run arm64 boards (not root, no package, no binfmt_misc)."""


def arm64_dir() -> Path:
    return Path(os.environ.get("EDGECACHE_ARM64_DIR") or Path.home() / ".cache" / "edgecache" / "arm64")


def root_path() -> Path:
    return arm64_dir() / f"root-{SUITE}"


def libs_path(kernels: str = DEFAULT_CLASS) -> Path:
    return arm64_dir() / f"llama-{VERSION}-aarch64-{kernels}"


def wheelhouse_path(kernels: str = DEFAULT_CLASS) -> Path:
    return arm64_dir() / f"wheelhouse-aarch64-{kernels}"


def _done(path: Path) -> Path:
    return path.with_name(path.name + ".done")


def ready(kernels: str = DEFAULT_CLASS) -> bool:
    """Whether the root and the wheelhouse of ``kernels`` are built (nothing is waited for)."""
    return _done(root_path()).exists() and _done(wheelhouse_path(kernels)).exists()


def unavailable() -> str:
    """Why arm64 boards cannot be made here ('' when they can)."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return "arm64 boards are emulated on an x86-64 Linux machine"
    if os.geteuid() != 0:
        return "running an arm64 root needs root (chroot, binfmt_misc, mounts): run the tests as root"
    if shutil.which("apt-get") is None and missing_tools():
        return f"no apt-get to install {', '.join(missing_tools())}"
    return ""


def missing_tools() -> list[str]:
    tools = {
        "qemu-aarch64-static": "qemu-user-static",
        "debootstrap": "debootstrap",
        "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu",
        "cmake": "cmake",
    }
    return [package for tool, package in tools.items() if shutil.which(tool) is None]


def install_tools(write: Callable[[str], None] = print) -> None:
    """Debian's qemu-user, debootstrap and aarch64 cross compilers, when missing (apt-get, as root)."""
    if not missing_tools():
        return
    write(f"Installing {', '.join(APT_PACKAGES)} (Debian's packages)...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-qq"], "apt-get update", env=env)
    _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES], "apt-get install", env=env)


def enable_binfmt() -> None:
    """Let the kernel run arm64 binaries through qemu-aarch64-static (children included)."""
    misc = Path("/proc/sys/fs/binfmt_misc")
    if not (misc / "register").exists():
        _run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(misc)], "mount binfmt_misc")
    entry = misc / "qemu-aarch64"
    if not entry.exists() or "enabled" not in entry.read_text():
        _run(["update-binfmts", "--enable", "qemu-aarch64"], "update-binfmts")
    if not entry.exists() or "enabled" not in entry.read_text():
        raise Arm64Unavailable("binfmt_misc has no enabled qemu-aarch64 entry after update-binfmts")


@contextlib.contextmanager
def _locked(path: Path, write: Callable[[str], None]) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            write(f"Waiting for {path.name}, which another process is building (its lock: {lock.name})...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _mirror() -> str:
    """The Debian mirror this machine's own apt sources name (deb822 or one-line format)."""
    for source in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = source.read_text()
        except OSError:
            continue
        for match in re.finditer(r"(?m)^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+)", text):
            if "security" not in match.group(1):
                return match.group(1)
    return "http://deb.debian.org/debian"


def ensure_root(write: Callable[[str], None] = print) -> Path:
    """The arm64 Debian root (Python 3, venv, no compiler): cached, else made now (about 12
    minutes on 2 cores), or waited for."""
    root = root_path()
    if _done(root).exists():
        return root
    with _locked(root, write):
        if _done(root).exists():
            return root
        install_tools(write)
        enable_binfmt()
        partial = root.with_name(root.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        write(f"Making an arm64 Debian {SUITE} root with debootstrap (once per machine, about 12 minutes): {root}")
        _run(
            [
                "debootstrap",
                "--arch=arm64",
                "--variant=minbase",
                "--include=python3,python3-venv",
                SUITE,
                str(partial),
                _mirror(),
            ],
            "debootstrap",
        )
        shutil.rmtree(root, ignore_errors=True)
        partial.rename(root)
        _done(root).touch()
    return root


def ensure_libs(kernels: str = DEFAULT_CLASS, write: Callable[[str], None] = print, jobs: int | None = None) -> Path:
    """llama.cpp's libraries for aarch64 with ``kernels``' class: cached, else cross-built now."""
    if kernels not in CLASSES:
        raise Arm64Unavailable(f"unknown aarch64 kernel class {kernels!r}: choose one of {', '.join(CLASSES)}")
    target = libs_path(kernels)
    if _done(target).exists():
        return target
    with _locked(target, write):
        if _done(target).exists():
            return target
        install_tools(write)
        with tempfile.TemporaryDirectory(prefix="llama-aarch64-", dir=target.parent) as work:
            work = Path(work)
            write(
                f"Cross-building llama.cpp {VERSION} for aarch64 ({kernels}) from the llama-cpp-python sdist (once per machine, minutes)..."
            )
            source = unpacked_llama(VERSION, work, error=Arm64Unavailable)
            build = work / "build"
            march = CLASSES[kernels][1]
            _run(
                ["cmake", "-S", str(source), "-B", str(build), *CROSS_FLAGS, f"-DGGML_CPU_ARM_ARCH={march}"],
                "cmake configure",
            )
            _run(
                ["cmake", "--build", str(build), "--target", "llama", "-j", str(jobs or os.cpu_count() or 2)],
                "cmake build",
            )
            libraries = sorted((build / "bin").glob("lib*.so*"))
            if not any(path.name == "libllama.so" for path in libraries):
                raise Arm64Unavailable(f"the aarch64 build finished without {build / 'bin' / 'libllama.so'}")
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for library in libraries:
                shutil.copy2(library, target / library.name, follow_symlinks=False)
        _done(target).touch()
        write(f"llama.cpp {VERSION} for aarch64 ({kernels}) built: {target}")
    return target


def board_requirements() -> list[str]:
    """What a board installs besides the project and llama-cpp-python: the project's base
    dependencies and llama-cpp-python's own (no extra: no control plane, no lab)."""

    def base(dist: str) -> list[str]:
        return [req for req in importlib.metadata.requires(dist) or [] if "extra ==" not in req]

    own = [req for req in base("edgecache") if not req.lower().startswith("llama-cpp-python")]
    return own + base("llama-cpp-python")


# The environment markers of the root's Python (pip download judges ``python_full_version`` by the
# Python that runs it, not by ``--python-version``: a 3.11.7 host leaves out what 3.11.2 needs).
TARGET_MARKERS = {
    "python_version": PYTHON_VERSION.rsplit(".", 1)[0],
    "python_full_version": PYTHON_VERSION,
    "platform_machine": "aarch64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "implementation_version": PYTHON_VERSION,
    "extra": "",
}


def missing_requirements(wheelhouse: Path) -> list[str]:
    """Requirements of the wheels in ``wheelhouse`` that apply to the root's Python and that no wheel
    there provides (pure: reads the wheels' metadata)."""
    from email.parser import Parser

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    present = {canonicalize_name(parse_wheel_filename(path.name)[0]) for path in wheelhouse.glob("*.whl")}
    missing: dict[str, str] = {}
    for path in wheelhouse.glob("*.whl"):
        with zipfile.ZipFile(path) as wheel:
            name = next((entry for entry in wheel.namelist() if entry.endswith(".dist-info/METADATA")), None)
            metadata = Parser().parsestr(wheel.read(name).decode()) if name else None
        for line in (metadata.get_all("Requires-Dist") or []) if metadata else []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(TARGET_MARKERS):
                continue
            if canonicalize_name(requirement.name) not in present:
                missing[canonicalize_name(requirement.name)] = str(requirement).split(";")[0]
    return sorted(missing.values())


def llama_wheel(libraries: Path, out: Path, kernels: str) -> Path:
    """llama-cpp-python's Python half (from its sdist) with ``libraries`` in ``llama_cpp/lib``, as
    an aarch64 wheel (the ``wheel`` package writes its RECORD)."""
    from wheel.wheelfile import WheelFile

    with tempfile.TemporaryDirectory(prefix="llama-wheel-") as work:
        work = Path(work)
        with tarfile.open(download_sdist(VERSION, work, error=Arm64Unavailable)) as archive:
            archive.extractall(work, filter="data")
        package = work / f"llama_cpp_python-{VERSION}" / "llama_cpp"
        lib = package / "lib"
        lib.mkdir(exist_ok=True)
        for library in libraries.iterdir():
            shutil.copy2(library, lib / library.name, follow_symlinks=True)
        name = f"llama_cpp_python-{VERSION}-py3-none-manylinux_2_36_aarch64.whl"
        info = f"llama_cpp_python-{VERSION}.dist-info"
        metadata = (work / f"llama_cpp_python-{VERSION}" / "PKG-INFO").read_text()
        path = out / name
        with WheelFile(path, "w") as wheel:
            for file in sorted(package.rglob("*")):
                if file.is_file() and "__pycache__" not in file.parts:
                    wheel.write(file, f"llama_cpp/{file.relative_to(package)}")
            wheel.writestr(f"{info}/METADATA", metadata)
            wheel.writestr(
                f"{info}/WHEEL",
                f"Wheel-Version: 1.0\nGenerator: edgecache-board-wheels\nRoot-Is-Purelib: false\nTag: py3-none-manylinux_2_36_aarch64\nBuild-Kernels: {kernels}\n",
            )
        return path


def ensure_wheelhouse(
    kernels: str = DEFAULT_CLASS, write: Callable[[str], None] = print, out: Path | None = None
) -> Path:
    """Every wheel an aarch64 board of ``kernels``' class installs, in one folder: the dependencies
    and llama.cpp cached (once per machine), the project's own wheel made again from this checkout
    each time (a few seconds: a wheelhouse never ships an older EdgeCache than the code beside it)."""
    target = out or wheelhouse_path(kernels)
    with _locked(target, write):
        if out is not None or not _done(target).exists():
            _collect_dependencies(kernels, target, write)
            if out is None:
                _done(target).touch()
        for old in target.glob("edgecache-*.whl"):
            old.unlink()
        with tempfile.TemporaryDirectory(prefix="edgecache-board-sources-") as folder:
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "wheel",
                    "--quiet",
                    "--no-deps",
                    "--no-build-isolation",
                    "-w",
                    str(target),
                    str(board_sources(Path(folder))),
                ],
                "pip wheel (the project)",
            )
    write(f"wheelhouse for aarch64 ({kernels}): {target} ({len(list(target.glob('*.whl')))} wheels)")
    return target


BOARD_SOURCES = ("pyproject.toml", "README.md", "inference", "cachebox")  # what the board's wheel is built from


def board_sources(into: Path) -> Path:
    """A copy of what the board's wheel packs (``BOARD_SOURCES``), in ``into``: a build/ folder an
    older build left in the checkout would otherwise be packed too (setuptools reuses it)."""
    project = Path(__file__).resolve().parents[2]
    for name in BOARD_SOURCES:
        source = project / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(source, into / name)
    return into


def _collect_dependencies(kernels: str, target: Path, write: Callable[[str], None]) -> None:
    """The registry's aarch64 wheels of the board's dependencies and llama-cpp-python packed with
    ``kernels``' libraries, into ``target`` (emptied first)."""
    libraries = ensure_libs(kernels, write)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    write(f"Collecting the board's aarch64 wheels into {target}...")
    platforms = [
        f"--platform={tag}"
        for tag in (
            "manylinux_2_36_aarch64",
            "manylinux_2_28_aarch64",
            "manylinux_2_17_aarch64",
            "manylinux2014_aarch64",
            "linux_aarch64",
        )
    ]
    download = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--only-binary=:all:",
        *platforms,
        f"--python-version={PYTHON_VERSION}",
        "--implementation=cp",
        f"--abi=cp{PYTHON_TAG}",
        "--abi=abi3",
        "--abi=none",
        "-d",
        str(target),
    ]
    _run([*download, *board_requirements()], "pip download")
    for _ in range(5):  # what the target's own Python needs and pip, judging by this one, left out
        missing = missing_requirements(target)
        if not missing:
            break
        _run([*download, *missing], "pip download (markers of the target)")
    llama_wheel(libraries, target, kernels)


def ensure_all(kernels: str = DEFAULT_CLASS, write: Callable[[str], None] = print) -> tuple[Path, Path]:
    """The root and the wheelhouse of ``kernels`` (each cached, else made)."""
    why = unavailable()
    if why:
        raise Arm64Unavailable(why)
    return ensure_root(write), ensure_wheelhouse(kernels, write)


# -- entering the root ---------------------------------------------------------------------------
@contextlib.contextmanager
def mounted(root: Path) -> Iterator[Path]:
    """``root`` with /proc, /dev and /sys of this machine mounted in it (unmounted after)."""
    enable_binfmt()
    mounts = []
    try:
        for name, args in (("proc", ["-t", "proc", "proc"]), ("dev", ["--bind", "/dev"]), ("sys", ["--bind", "/sys"])):
            point = root / name
            point.mkdir(exist_ok=True)
            if not os.path.ismount(point):
                _run(["mount", *args, str(point)], f"mount {name}")
                mounts.append(point)
        yield root
    finally:
        for point in reversed(mounts):
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


def chroot_command(root: Path, argv: list[str], *, cpu: str | None = None, env: dict | None = None) -> list[str]:
    """``argv`` as run inside ``root``, seeing ``cpu`` (qemu's CPU model), with only ``env``."""
    environment = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}
    if cpu:
        environment["QEMU_CPU"] = cpu
    return ["chroot", str(root), "/usr/bin/env", "-i", *(f"{key}={value}" for key, value in environment.items()), *argv]


def _run(command: list[str], what: str, env: dict | None = None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise Arm64Unavailable(f"{what} failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboard.bench.arm64", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=("root", "libs", "wheelhouse", "all"))
    parser.add_argument(
        "--kernels",
        default=DEFAULT_CLASS,
        choices=sorted(CLASSES),
        help=f"the aarch64 kernel class (default {DEFAULT_CLASS})",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write the wheelhouse here instead of the machine's cache"
    )
    args = parser.parse_args(argv)
    try:
        if args.what == "root":
            print(ensure_root())
        elif args.what == "libs":
            print(ensure_libs(args.kernels))
        elif args.what == "wheelhouse":
            print(ensure_wheelhouse(args.kernels, out=args.out))
        else:
            print(*ensure_all(args.kernels), sep="\n")
    except Arm64Unavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

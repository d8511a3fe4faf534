"""Kernel classes: which llama.cpp code computes a board's bits, named and digested.

Two builds of the same llama.cpp compute other bits: SIMD sums of other widths in another order, and
ggml picks other kernels per instruction set (the AVX2 and AVX-512 builds' last logits differed in
every one of 262,144 values, up to 0.83; the AVX2 and SSE4.2 builds' too, up to 0.85). A state is
exact only for a board that runs the very kernels that computed it, so the kernels are part of a
model's identity (``cachebox.keys.ModelIdentity.kernels``): boards of different classes have
different fingerprints, hence different keys, and never take each other's states as exact.

What names the kernels is what llama.cpp reports of the backends it loaded
(``llama_print_system_info``: "CPU : SSE3 = 1 | AVX2 = 1 | ... |", the CPU features its ggml-cpu
was compiled for), the machine (``platform.machine()``) and the build (llama-cpp-python's version
and ggml's version and commit). ``KernelClass.name`` is short and readable (``x86_64-avx2``,
``x86_64-avx512``, ``x86_64-ssse3``, ``aarch64-armv8.0``, ``aarch64-armv8.2-dotprod-fp16``), for
pages, heartbeats and metrics; ``KernelClass.digest`` covers every reported feature and the build,
for the fingerprint.

Pure: strings in, names and digests out. The probing (calling the loaded library) is
``inference.engine.bindings.kernel_report``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

# platform.machine() spellings of one architecture.
_MACHINES = {"amd64": "x86_64", "x64": "x86_64", "x86-64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}
CLASS_RE = re.compile(r"^[a-z0-9_][a-z0-9_.+-]{0,63}$")  # what a kernel class may look like on the wire
_FEATURE_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")

# x86: the widest vector set names the class; extensions that add kernels of their own follow it.
_X86_LEVELS = (("AVX512", "avx512"), ("AVX2", "avx2"), ("AVX", "avx"), ("SSSE3", "ssse3"), ("SSE3", "sse3"))
_X86_EXTRAS = (
    ("AVX512_VBMI", "vbmi"),
    ("AVX512_VNNI", "vnni"),
    ("AVX_VNNI", "avxvnni"),
    ("AVX512_BF16", "bf16"),
    ("AMX_INT8", "amx"),
)
# Arm: the architecture level the features imply, then the features (ggml's own variant names
# in ggml/src/CMakeLists.txt: armv8.0_1 for a Cortex-A53, armv8.2_2 with dot product and fp16 for a Cortex-A76).
_ARM_EXTRAS = (("DOTPROD", "dotprod"), ("FP16_VA", "fp16"), ("MATMUL_INT8", "i8mm"), ("SVE", "sve"), ("SME", "sme"))


def parse_system_info(info: str) -> dict[str, dict[str, str]]:
    """llama.cpp's ``llama_print_system_info()`` as {backend: {feature: value}}.

    The text is ``"CPU : SSE3 = 1 | AVX2 = 1 | ... | "``, one such run per backend that reports
    features (a line of its name, " : ", then "NAME = VALUE | " pairs). Features whose value is
    "0" are left out (a build lists only what it has); an unreadable text gives {}."""
    backends: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for part in (info or "").split("|"):
        part = part.strip()
        if not part:
            continue
        if " : " in part:  # a backend's name begins its run of features
            name, _, part = part.partition(" : ")
            current = backends.setdefault(name.strip(), {})
        if current is None or "=" not in part:
            continue
        feature, _, value = part.partition("=")
        feature, value = feature.strip(), value.strip()
        if _FEATURE_RE.match(feature) and value and value != "0":
            current[feature] = value[:32]
    return backends


def normalize_machine(machine: str) -> str:
    machine = (machine or "").strip().lower()
    machine = _MACHINES.get(machine, machine)
    return re.sub(r"[^a-z0-9_]", "", machine)[:24] or "unknown"


def class_name(machine: str, features: dict[str, str]) -> str:
    """The short name of the kernels ``features`` (the CPU backend's) compute with on ``machine``."""
    machine = normalize_machine(machine)
    has = {name for name, value in features.items() if value != "0"}
    if machine in ("x86_64", "i686", "i386", "x86"):
        level = next((label for feature, label in _X86_LEVELS if feature in has), "generic")
        extras = [label for feature, label in _X86_EXTRAS if feature in has]
    elif machine == "aarch64" or "NEON" in has:
        if "SME" in has:
            level = "armv9.2"
        elif "MATMUL_INT8" in has:
            level = "armv8.6"
        elif has & {"DOTPROD", "FP16_VA"}:
            level = "armv8.2"
        elif "NEON" in has:
            level = "armv8.0"
        else:
            level = "generic"
        extras = [label for feature, label in _ARM_EXTRAS if feature in has]
    else:
        named = sorted(
            feature.lower() for feature in has if feature not in ("OPENMP", "LLAMAFILE", "REPACK", "KLEIDIAI")
        )
        level, extras = "generic", named[:4]
    return "-".join([machine, level, *extras])[:64]


@dataclass(frozen=True)
class KernelClass:
    """The kernels of one llama.cpp build on one machine: a readable name and a digest of everything."""

    name: str  # e.g. "x86_64-avx2"
    machine: str  # normalized platform.machine()
    features: tuple[tuple[str, str, str], ...]  # (backend, feature, value), sorted: every one reported
    build: str  # the library's versions: llama-cpp-python's and ggml's (with its commit)

    @classmethod
    def from_report(cls, machine: str, system_info: str, build: str) -> "KernelClass":
        backends = parse_system_info(system_info)
        features = tuple(
            sorted((backend, name, value) for backend, found in backends.items() for name, value in found.items())
        )
        return cls(
            class_name(machine, backends.get("CPU", {})),
            normalize_machine(machine),
            features,
            " ".join(build.split())[:200],
        )

    def digest(self) -> str:
        """16 hex characters over the machine, every feature of every backend and the build."""
        canonical = json.dumps(
            {"machine": self.machine, "features": self.features, "build": self.build}, separators=(",", ":")
        )
        return hashlib.blake2b(canonical.encode(), digest_size=8, person=b"edgecache-kern").hexdigest()

    @property
    def identity(self) -> str:
        """What ``ModelIdentity.kernels`` holds: the name (readable in a dump) and the digest."""
        return f"{self.name}:{self.digest()}"

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "digest": self.digest(),
            "machine": self.machine,
            "build": self.build,
            "features": [f"{backend}:{name}={value}" for backend, name, value in self.features],
        }


def name_of(identity: str) -> str:
    """The class name in a ``KernelClass.identity`` ("x86_64-avx2:0123..." -> "x86_64-avx2"); '' when none."""
    name = (identity or "").partition(":")[0]
    return name if CLASS_RE.match(name) else ""

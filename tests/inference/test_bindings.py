"""How llama.cpp is compiled: the flags of the wheel (Makefile) and of the llama-server peer agree,
and a build with ggml's AMX kernels, which crashed on the first batch, is caught."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard.bench import llama_server
from inference.engine import bindings

ROOT = Path(__file__).resolve().parents[2]


def test_x86_builds_take_avx2_not_native_and_other_machines_native():
    assert bindings.cmake_args("x86_64") == ("-DGGML_NATIVE=OFF",)
    assert bindings.cmake_args("AMD64") == ("-DGGML_NATIVE=OFF",)
    assert bindings.cmake_args("aarch64") == ()


def test_the_makefile_and_the_peer_build_use_the_same_cpu_flags():
    makefile = (ROOT / "Makefile").read_text()
    assigned = re.search(r"^LLAMA_CMAKE_ARGS \?= (.*)$", makefile, re.MULTILINE)
    assert assigned is not None, "the Makefile sets LLAMA_CMAKE_ARGS"
    assert tuple(assigned.group(1).split()) == bindings.X86_CMAKE_ARGS
    assert "export CMAKE_ARGS := $(LLAMA_CMAKE_ARGS)" in makefile  # what llama-cpp-python's build reads
    # The peer compiles no kernels of its own: it links the wheel's, built with these flags.
    assert not [flag for flag in llama_server.CMAKE_FLAGS if flag.startswith("-DGGML_")]
    assert '"${WHEEL_LIBS}/${file}"' in llama_server.WRAPPER_CMAKE


@pytest.mark.parametrize(
    "info, amx",
    [
        ("CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 | ", True),
        ("CPU : SSE3 = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | REPACK = 1 | ", False),
        ("CPU : NEON = 1 | ARM_FMA = 1 | REPACK = 1 | ", False),
    ],
)
def test_an_amx_build_is_recognised_from_llama_cpps_system_info(info, amx):
    assert bindings.amx_build(info) is amx


def test_make_install_built_the_llama_cpp_here_without_amx():
    checked = subprocess.run(
        [sys.executable, "-m", "inference.engine.bindings"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert checked.returncode == 0, checked.stderr
    assert "AVX2 = 1" in checked.stdout or "NEON = 1" in checked.stdout

"""llama-cpp-python's ctypes bindings, without the rest of its package until something asks for it.

``import llama_cpp`` runs the package's ``__init__``, which imports its high-level ``Llama``
class too: jinja2, every chat format, grammars, the tokenizer wrappers (13 MB of a board's
memory: 8 MB of objects and 5 MB of library pages, measured). EdgeCache calls only the low-level
functions (``llama_cpp.llama_cpp``). ``llama_cpp()`` registers the package with just those; the
first name that is not among them (``from llama_cpp import Llama`` in a benchmark) runs the
package's own ``__init__`` in place, so every caller still finds the whole package.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import threading
from types import ModuleType

_lock = threading.Lock()


def llama_cpp() -> ModuleType:
    """The ``llama_cpp`` module, its low-level functions loaded (the rest on first use)."""
    with _lock:
        loaded = sys.modules.get("llama_cpp")
        if loaded is not None:
            return loaded  # imported already (whole, or by an earlier call)
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.loader is None:  # pragma: no cover - packaging error
            raise ImportError("llama-cpp-python is not installed: pip install -e .")
        package = importlib.util.module_from_spec(spec)
        whole = threading.Lock()

        def __getattr__(name: str):  # PEP 562: the rest of the package, on its first use
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            with whole:
                if package.__dict__.pop("__getattr__", None) is not None:
                    spec.loader.exec_module(package)
            return getattr(package, name) if name in package.__dict__ else _missing(name)

        def _missing(name: str):
            raise AttributeError(f"module 'llama_cpp' has no attribute {name!r}")

        sys.modules["llama_cpp"] = package
        try:
            low = importlib.import_module("llama_cpp.llama_cpp")
        except BaseException:
            del sys.modules["llama_cpp"]
            raise
        package.__dict__.update({name: value for name, value in vars(low).items() if not name.startswith("_")})
        package.__version__ = importlib.metadata.version("llama-cpp-python")
        package.__getattr__ = __getattr__
        return package


# -- how llama.cpp was compiled ------------------------------------------------------------------
# x86-64 builds (the wheel, ``make install``; the llama-server peer, ``inference.benchmarks.
# llama_server``) take AVX2/FMA/F16C, not ``-march=native``: on a CPU that reports AMX (Intel
# Sapphire Rapids and later, and the VMs they host) ``native`` compiles ggml's AMX kernels, and its
# AMX weight buffers crashed llama.cpp (SIGSEGV in ggml_backend_amx_mul_mat) on the first batch of
# every model loaded with its extra buffer types, on this project's test machines. The Makefile's
# LLAMA_CMAKE_ARGS must say the same (tests/inference/test_bindings.py checks it).
X86_CMAKE_ARGS = ("-DGGML_NATIVE=OFF",)


def cmake_args(machine: str | None = None) -> tuple[str, ...]:
    """The CMake flags llama.cpp is built with on ``machine`` (``platform.machine()``)."""
    import platform

    machine = (machine or platform.machine()).lower()
    return X86_CMAKE_ARGS if machine in ("x86_64", "amd64") else ()


def system_info() -> str:
    """llama.cpp's own list of the CPU features it was compiled for ("AVX2 = 1 | ...")."""
    info = llama_cpp().llama_print_system_info()
    return info.decode(errors="replace") if isinstance(info, bytes) else str(info)


def _ggml_string(name: str) -> str:
    """A string function of ggml's (``ggml_version``, ``ggml_commit``) from the loaded library ('' if absent)."""
    import ctypes

    library = getattr(
        importlib.import_module("llama_cpp.llama_cpp"), "_lib", None
    )  # libllama; dlsym sees its libggml too
    try:
        function = getattr(library, name)
    except AttributeError:
        return ""
    function.argtypes, function.restype = [], ctypes.c_char_p
    value = function()
    return value.decode(errors="replace") if value else ""


def library_path() -> str:
    """The file of the libllama this process loaded (``LLAMA_CPP_LIB_PATH`` or the wheel's)."""
    library = getattr(importlib.import_module("llama_cpp.llama_cpp"), "_lib", None)
    return str(getattr(library, "_name", "") or "")


def kernel_report() -> tuple[str, str, str]:
    """(machine, llama.cpp's system info, build) of the llama.cpp this process loaded: what
    ``inference.engine.kernels.KernelClass.from_report`` names. The build is llama-cpp-python's version and
    ggml's version and commit, not a digest of the library file: two boards that compiled the same
    sources with the same flags (each Pi its own) compute the same bits and share."""
    import platform

    module = llama_cpp()
    build = f"llama-cpp-python {module.__version__} ggml {_ggml_string('ggml_version') or '?'} ({_ggml_string('ggml_commit') or '?'})"
    return platform.machine(), system_info(), build


def kernel_class():
    """The ``inference.engine.kernels.KernelClass`` of the llama.cpp this process loaded."""
    # lazy: only for a kernel report (inference.board.main imports no more at start)
    from inference.engine.kernels import KernelClass

    return KernelClass.from_report(*kernel_report())


def amx_build(info: str | None = None) -> bool:
    """Whether this llama.cpp holds ggml's AMX kernels (see X86_CMAKE_ARGS)."""
    info = system_info() if info is None else info
    return any(f"{feature} = 1" in info for feature in ("AMX_INT8", "AMX_BF16", "AMX_TILE"))


if __name__ == "__main__":  # `python -m inference.engine.bindings`: make install's check of the build
    if amx_build():
        print(
            "llama-cpp-python here was compiled with ggml's AMX kernels (-march=native, or a wheel pip cached before the Makefile set LLAMA_CMAKE_ARGS)",
            file=sys.stderr,
        )
        sys.exit(1)
    print(
        "llama.cpp build: "
        + " ".join(part.strip() for part in system_info().split("|") if part.strip().endswith("= 1"))
    )

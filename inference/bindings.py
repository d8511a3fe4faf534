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

"""The benchmarks of ``python manage.py bench``: one registry.

Adding a benchmark is one module and one line here. The module ends with
``BENCH = Benchmark(...)`` (its name, document format, help, arguments, run, printed lines and
HTML report: ``inference/benchmarks/base.py`` shows the shape); the line below maps the
subcommand to the module. Everything else is shared: ``runner`` parses, runs, stamps, prints
and saves every benchmark the same way; ``documents`` reads saved results back for the pages.

Modules are imported when first asked for (a benchmark module may pull heavy imports).
"""

from __future__ import annotations

import importlib

from inference.benchmarks.base import Benchmark

# subcommand -> the module whose BENCH it runs (the order of `bench --help`)
BENCHMARKS = {
    "cases": "inference.benchmarks.cases",
    "modules": "inference.benchmarks.modules",
    "breakeven": "inference.benchmarks.breakeven",
    "kv": "inference.benchmarks.kv",
    "peers": "inference.benchmarks.peers",
    "catalog": "inference.benchmarks.catalog",
    "scale": "inference.benchmarks.scale",
    "load": "inference.benchmarks.load",
    "exact": "inference.benchmarks.exact",
    "tiers": "inference.benchmarks.tiers",
    "api": "dashboard.api.bench",
    "fleet": "inference.benchmarks.fleet",
    "lab": "inference.benchmarks.lab",
    "lab-exit": "inference.benchmarks.early_exit",
    "lab-anchors": "inference.benchmarks.anchors",
    "footprint": "inference.benchmarks.footprint",
    "seal": "inference.benchmarks.seal",
    "fleet-sim": "dashboard.bench.fleet_sim",
    "vs-server": "inference.benchmarks.vs_server",
    "kernels": "inference.benchmarks.kernels",
}


def get(name: str) -> Benchmark:
    """The benchmark registered as ``name`` (KeyError for an unknown name)."""
    bench = importlib.import_module(BENCHMARKS[name]).BENCH
    if bench.name != name:
        raise RuntimeError(f"{BENCHMARKS[name]} declares bench {bench.name!r}, registered as {name!r}")
    return bench


def every() -> list[Benchmark]:
    """Every registered benchmark, in the registry's order."""
    return [get(name) for name in BENCHMARKS]

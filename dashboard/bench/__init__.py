"""The benchmarks of ``python manage.py bench``: one registry.

Adding a benchmark is one module and one line here. The module ends with
``BENCH = Benchmark(...)`` (its name, document format, help, arguments, run, printed lines and
HTML report: ``dashboard/bench/base.py`` shows the shape); the line below maps the
subcommand to the module. Everything else is shared: ``runner`` parses, runs, stamps, prints
and saves every benchmark the same way; ``documents`` reads saved results back for the pages.

Modules are imported when first asked for (a benchmark module may pull heavy imports).
"""

from __future__ import annotations

import importlib

from dashboard.bench.base import Benchmark

# subcommand -> the module whose BENCH it runs (the order of `bench --help`)
BENCHMARKS = {
    "cases": "dashboard.bench.cases",
    "modules": "dashboard.bench.modules",
    "breakeven": "dashboard.bench.breakeven",
    "kv": "dashboard.bench.kv",
    "peers": "dashboard.bench.peers",
    "catalog": "dashboard.bench.catalog",
    "scale": "dashboard.bench.scale",
    "load": "dashboard.bench.load",
    "exact": "dashboard.bench.exact",
    "tiers": "dashboard.bench.tiers",
    "api": "dashboard.bench.api",
    "fleet": "dashboard.bench.fleet",
    "lab": "dashboard.bench.lab",
    "lab-exit": "dashboard.bench.early_exit",
    "lab-anchors": "dashboard.bench.anchors",
    "footprint": "dashboard.bench.footprint",
    "seal": "dashboard.bench.seal",
    "fleet-sim": "dashboard.bench.fleet_sim",
    "vs-server": "dashboard.bench.vs_server",
    "kernels": "dashboard.bench.kernels",
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

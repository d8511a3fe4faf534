"""`bench` is one registry: every benchmark declares itself the same way, and every document it
saves says what it is. Pure: a made-up benchmark runs through the real runner (no model, no server)."""

from __future__ import annotations

import argparse
import json

import pytest

from dashboard import bench as registry
from dashboard.bench import documents, runner
from dashboard.bench.base import BenchError, Benchmark
from dashboard.bench.common import percentile
from dashboard.bench.html_report import write_report


def test_every_registered_module_declares_the_benchmark_it_is_registered_as():
    for name in registry.BENCHMARKS:
        bench = registry.get(name)
        assert bench.name == name and isinstance(bench.format, int) and bench.format >= 1 and bench.help
        parser = argparse.ArgumentParser()
        runner.add_arguments(bench, parser)
        assert parser.parse_args([]).json_path is None  # every benchmark saves where --json says


def test_the_bench_command_offers_every_registered_benchmark_and_topics():
    from dashboard.management.commands.bench import Command

    parser = Command().create_parser("manage.py", "bench")
    (sub,) = [action for action in parser._actions if action.dest == "bench"]
    assert list(sub.choices) == [*registry.BENCHMARKS, "topics"]


def _toy(**changes) -> Benchmark:
    def add_arguments(parser):
        parser.add_argument("--size", type=int, default=3)

    def run(ctx, *, size, **options):
        if size < 1:
            raise BenchError("--size must be at least 1")
        ctx.write("measuring")
        return {"sizes": list(range(size)), "summary": f"{size} sizes"}

    def report(path, doc):
        return write_report(path, "bench toy", doc["summary"], [], {"Sizes": [{"size": s} for s in doc["sizes"]]}, doc)

    fields = {
        "name": "toy",
        "format": 2,
        "help": "a toy",
        "add_arguments": add_arguments,
        "run": run,
        "lines": lambda doc: [f"sizes: {doc['sizes']}"],
        "report": report,
    }
    return Benchmark(**{**fields, **changes})


def test_a_run_saves_a_document_that_says_what_it_is_with_its_report(tmp_path, settings):
    settings.BASE_DIR = tmp_path
    printed = []
    doc = runner.run(_toy(), {"size": 2, "json_path": None, "verbosity": 1}, printed.append)
    assert list(doc)[:3] == ["bench", "format", "machine"] and (doc["bench"], doc["format"]) == ("toy", 2)
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["date"]  # no board: the host
    (saved,) = (tmp_path / "bench-results").glob("toy-*.json")
    assert json.loads(saved.read_text()) == doc
    assert "bench toy" in saved.with_suffix(".html").read_text()
    assert printed == ["measuring", "sizes: [0, 1]", f"saved {saved} and {saved.with_suffix('.html')}"]


def test_a_benchmark_cannot_name_itself_otherwise_than_its_registry_line(tmp_path):
    doc = runner.stamp(_toy(), {"bench": "other", "format": 9, "x": 1})
    assert (doc["bench"], doc["format"], doc["x"]) == ("toy", 2, 1)


def test_a_persons_mistake_is_one_line_from_the_command(tmp_path, settings):
    settings.BASE_DIR = tmp_path
    with pytest.raises(BenchError, match="--size must be at least 1"):
        runner.run(_toy(), {"size": 0}, print)
    assert not (tmp_path / "bench-results").exists()  # nothing half-written


def test_documents_are_known_by_their_bench_and_older_ones_by_their_fields():
    assert documents.kind_of({"bench": "fleet", "ttft_ratio_full_to_cold": 1}) == "fleet"  # the field wins
    older = {
        "cases": {"ttft_ratio_full_to_cold": 0.1},
        "load": {"lost": 0, "devices": 2},
        "modules": {"accuracy_cached": 0.3},
        "breakeven": {"presets": {}},
        "peers": {"peers": {}},
        "catalog": {"sweep": []},
        "scale": {"lengths": []},
        "lab": {"ks": [3], "table": []},
        "kv": {"kv_types": {}},
        "exact": {"cut_costs": {}},
        "tiers": {"median_ttft_ms": {}, "ratios": {}},
        "fleet": {"policies": {}, "boards": 2},
        "api": {"first_chunk_ms": {}, "clients": 2},
    }
    for kind, doc in older.items():
        assert documents.kind_of(doc) == kind
    assert set(older) | {"lab-exit", "lab-anchors", "footprint", "seal", "fleet-sim", "vs-server", "kernels"} == set(
        registry.BENCHMARKS
    )  # lab studies and newer benches always named themselves
    assert documents.kind_of({"something": "else"}) is None and documents.kind_of([1]) is None


def test_a_headline_the_document_cannot_give_is_empty_not_an_error():
    assert documents.headline({"bench": "cases"}) == ""  # fields missing: listed without a line
    assert documents.headline({"bench": "fleet", "summary": "two boards"}) == "two boards"  # no headline: its summary
    assert documents.headline({"bench": "unknown"}) == ""


def test_one_percentile_linear_between_ranks():
    values = list(range(1, 11))
    assert percentile(values, 90) == 9.1 and percentile(values, 50) == 5.5  # (n - 1) * p / 100, interpolated
    assert percentile([], 90) is None and percentile([4.0], 99) == 4.0
    assert percentile([0.1234567, 0.2], 0, digits=6) == 0.123457

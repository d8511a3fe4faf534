"""Benchmark reports: self-contained HTML with charts, tables and the run's metadata."""

import json

from dashboard.bench import reports
from dashboard.bench.catalog import false_positive_rates
from dashboard.bench.modules import choices_for, plain_text, prompt_for, schema_for, wilson
from inference.serving.pml import parse_prompt, parse_schema

MACHINE = {"cpu": "test cpu", "link": "unshaped"}


def _case(name, ttft, matched):
    breakdown = {
        "token_ms": 1.0,
        "bloom_ms": 0.1,
        "prefill_ms": ttft,
        "redis_ms": 2.0,
        "decode_ms": 40.0,
        "sample_ms": 0.2,
        "fetch_ms": 1.0,
        "restore_ms": 1.0,
        "upload_ms": 3.0,
    }
    return {
        "name": name,
        "ttft_ms": ttft,
        "ttlt_ms": ttft + 40,
        "breakdown_ms": breakdown,
        "matched_tokens": matched,
        "prompt_tokens": 400,
        "state_bytes": 7.4e6,
    }


def assert_self_contained(path, *texts):
    page = path.read_text()
    assert page.startswith("<!doctype html>") and "plotly" in page.lower()
    assert "<script src=" not in page  # plotly.js is inline: the report opens offline
    for text in texts:
        assert text in page
    return page


def test_cases_report_puts_the_papers_tables_beside_ours(tmp_path):
    doc = {
        "cases": {
            str(i): _case(n, t, m)
            for i, (n, t, m) in enumerate(
                [
                    ("miss", 1200, 0),
                    ("instruction", 1150, 15),
                    ("instruction + first example", 1000, 80),
                    ("instruction + all examples", 260, 373),
                    ("full hit", 0.0, 400),
                ],
                start=1,
            )
        },
        "greedy_agreement": 1.0,
        "accuracy": {"1": 0.25, "5": 0.25},
        "ttft_ratio_full_to_cold": 0.01,
        "bytes_per_cached_token": 18486.0,
        "catalog_lookup_ms": 0.09,
        "n": 3,
        "topic": "astronomy",
        "shots": 5,
        "machine": MACHINE,
    }
    page = assert_self_contained(
        reports.cases_report(tmp_path / "cases.html", doc),
        "Table 3, paper",
        "Table 4",
        "Figure 5",
        "12580.85",
        "test cpu",
    )
    assert json.loads(json.dumps(doc))["n"] == 3 and "Matsutani" in page


def test_breakeven_and_catalog_and_scale_reports(tmp_path):
    row = {
        "always_ttft_ms": 3000.0,
        "never_ttft_ms": 1200.0,
        "adaptive_ttft_ms": 1210.0,
        "best_fixed_ttft_ms": 1200.0,
        "adaptive_vs_best": 1.008,
        "within_5pct": True,
        "adaptive_decisions": {"policy-skip": 3},
    }
    doc = {
        "presets": {"wifi4": {"link": "Wi-Fi 4", "emulated": True, "cases": {"5": row}}},
        "target_met": True,
        "case_names": {"5": "full hit"},
        "machine": MACHINE,
    }
    assert_self_contained(
        reports.breakeven_report(tmp_path / "be.html", doc),
        "always fetch, never fetch, fetch-or-compute, adaptive",
        "policy-skip: 3",
    )
    sweep = [
        {
            "hit_ratio": r,
            "with_catalog": {"mean_ttft_ms": 1000.0, "miss_network_ms": 0.0, "hits": 1},
            "without_catalog": {"mean_ttft_ms": 1010.0, "miss_network_ms": 9.0, "hits": 1},
        }
        for r in (0.0, 0.5)
    ]
    doc = {
        "sweep": sweep,
        "link": "emulated link Wi-Fi 4",
        "false_positives": false_positive_rates(capacities=(2000,), probes=20_000),
        "machine": MACHINE,
    }
    assert_self_contained(
        reports.catalog_report(tmp_path / "cat.html", doc), "Mean TTFT against hit ratio", "False positives"
    )
    doc = {
        "lengths": [
            {
                "prompt_tokens": 128,
                "cold_ttft_ms": 300.0,
                "hit_ttft_ms": 5.0,
                "ratio": 0.02,
                "state_bytes": 2.4e6,
                "bytes_per_token": 18500.0,
            }
        ],
        "machine": MACHINE,
    }
    assert_self_contained(reports.scale_report(tmp_path / "scale.html", doc), "TTFT against prompt length")


def test_observed_false_positive_rate_is_near_the_configured_one():
    (row,) = false_positive_rates(capacities=(5000,), probes=50_000)
    assert 0.004 < row["observed"] < 0.02 and row["configured"] == 0.01


def test_mmlu_schemas_and_prompts_of_bench_modules_parse():
    source = schema_for("astronomy", 3, scaffold=True)
    schema = parse_schema(source)
    assert [s.name for s in schema.scaffolds] == ["examples-a"] and len(schema.modules) == 6
    from dashboard import mmlu

    target = mmlu.load_questions()["astronomy"][10]
    for index in range(4):
        choices = choices_for(index, 3)
        doc = parse_prompt(prompt_for(source, target, choices), schema)
        assert [item.name for item in doc.items if hasattr(item, "args")] == [
            f"s{slot}{c}" for slot, c in enumerate(choices)
        ]
        assert plain_text("astronomy", 3, target, choices).endswith("Answer:")
    assert choices_for(0, 3) == ["a", "a", "a"] and choices_for(1, 3) != ["a", "a", "a"]


def test_wilson_interval():
    low, high = wilson(25, 100)
    assert 0.17 < low < 0.25 < high < 0.35
    assert wilson(0, 0) == (0.0, 0.0)

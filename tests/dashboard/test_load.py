"""`bench load`: the summary arithmetic (no processes, no model) and one real short run."""

import json

import pytest

from dashboard.bench import reports
from dashboard.bench.load import p99_stability, percentile, summarize, time_windows, warmup_seconds
from tests.conftest import run_manage


def run(board="load-0", t_s=0.0, ttft=100.0, prompt=400, matched=0, fetched=0, uploaded=0, cachebox="ok", case="miss"):
    return {
        "board": board,
        "t_s": t_s,
        "latency_ms": ttft + 50,
        "ttft_ms": ttft,
        "ttlt_ms": ttft + 40,
        "prompt_tokens": prompt,
        "matched_tokens": matched,
        "fetched_bytes": fetched,
        "uploaded_bytes": uploaded,
        "cachebox": cachebox,
        "case": case,
        "decision": "fetch" if matched else "catalog-miss",
        "rejected_entries": 0,
        "false_positives": 0,
    }


def test_percentile_interpolates_between_ranks():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50.5
    assert percentile(values, 99) == 99.01
    assert percentile(values, 0) == 1 and percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentile([3, 1, 2], 50) == 2  # order does not matter
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_windows_group_runs_by_dispatch_time():
    runs = [run(t_s=t, ttft=t * 10) for t in (0.5, 3.0, 9.99, 10.0, 24.0)]
    windows = time_windows(runs, duration_s=25, window_s=10)
    assert [(w["start_s"], w["end_s"], w["runs"]) for w in windows] == [(0, 10, 3), (10, 20, 1), (20, 25, 1)]
    assert windows[0]["ttft_ms_p50"] == 30.0 and windows[1]["ttft_ms_p99"] == 100.0
    empty = time_windows([], duration_s=20, window_s=10)
    assert [w["runs"] for w in empty] == [0, 0] and empty[0]["ttft_ms_p99"] is None
    assert len(time_windows([], duration_s=8)) == 1


def test_warmup_ends_when_every_board_has_answered_once():
    runs = [run("load-0", 0.0, ttft=1000.0), run("load-1", 0.0, ttft=30_000.0), run("load-0", 2.0, ttft=100.0)]
    assert warmup_seconds(runs, ["load-0", "load-1"]) == 30.05  # dispatch + latency (ttft + 50 ms here)
    assert warmup_seconds(runs, ["load-0", "load-1", "load-2"]) is None  # load-2 never answered
    assert warmup_seconds([], []) is None


def test_p99_stability_looks_for_a_rise_after_the_warmup():
    def window(start, p99, runs=10):
        return {"start_s": start, "runs": runs, "ttft_ms_p99": p99}

    windows = [
        window(0, 9000.0),
        window(10, 3000.0),
        window(20, 150.0),
        window(30, 120.0),
        window(40, 140.0),
        window(50, 50000.0, runs=2),
    ]
    stable = p99_stability(windows, warmup_s=5.0)
    assert stable["windows_compared"] == [10, 20, 30, 40]  # not the warm-up window, not the thin one
    assert stable["max_rise"] == round(140 / 120, 3) and stable["stable"] is True  # falling is not a rise
    rising = p99_stability([window(10, 100.0), window(20, 180.0), window(30, 250.0)], warmup_s=0.0)
    assert rising["max_rise"] == 2.5 and rising["stable"] is False
    assert p99_stability(windows, warmup_s=35.0)["stable"] is None  # one window left: no verdict
    assert p99_stability(windows, warmup_s=None)["stable"] is None  # a board never answered


def test_summary_counts_errors_lost_hits_and_bandwidth():
    runs = [
        run("load-0", 1.0, ttft=1000.0, prompt=400, matched=0, uploaded=8_000_000),
        run("load-1", 2.0, ttft=20.0, prompt=400, matched=400, fetched=7_000_000, case="full"),
        run("load-1", 12.0, ttft=300.0, prompt=400, matched=300, fetched=5_000_000, cachebox="ok", case="partial"),
        run("load-0", 13.0, ttft=1100.0, prompt=400, matched=0, cachebox="unavailable"),
    ]
    failures = [{"board": "load-0", "t_s": 5.0, "error": "EngineError: context full"}]
    doc = summarize(runs, failures, lost=2, duration_s=20, measured_s=25.0, boards=["load-0", "load-1", "load-2"])
    assert (doc["runs"], doc["errors"], doc["lost"]) == (4, 2, 2)
    assert doc["exceptions"] == 1 and doc["cachebox_unavailable"] == 1
    assert doc["hit_ratio"] == round(700 / 1600, 4)
    assert doc["cachebox_mb_per_s"] == 20.0 / 25.0 and doc["cachebox_mb"] == 20.0
    assert doc["ttft_ms_p50"] == 650.0 and doc["ttft_ms_max"] == 1100.0
    assert [(b["board"], b["runs"], b["errors"]) for b in doc["per_board"]] == [
        ("load-0", 2, 2),
        ("load-1", 2, 0),
        ("load-2", 0, 0),
    ]
    assert [w["runs"] for w in doc["windows"]] == [2, 2]
    assert doc["cases"] == {"miss": 2, "full": 1, "partial": 1}
    assert doc["error_messages"] == ["EngineError: context full"] and doc["target_met"] is False
    json.dumps(doc)  # all of it goes to the JSON file


def test_summary_of_nothing_and_of_a_clean_run():
    doc = summarize([], [], 0, duration_s=10, measured_s=0.0)
    assert (
        doc["runs"] == 0 and doc["ttft_ms_p99"] is None and doc["hit_ratio"] == 0.0 and doc["cachebox_mb_per_s"] == 0.0
    )
    clean = summarize(
        [run(t_s=t, ttft=100.0 + t) for t in range(30)], [], 0, duration_s=30, measured_s=31.0, boards=["load-0"]
    )
    assert clean["target_met"] is True and clean["p99_stability"]["stable"] is True
    assert (
        clean["p99_stability"]["warmup_s"] == 0.15 and clean["after_warmup"]["runs"] == 29
    )  # the first answer came at 0.15 s


def test_load_report_is_self_contained(tmp_path):
    runs = [run(f"load-{t % 2}", float(t), ttft=50.0 + t) for t in range(12)]
    doc = summarize(runs, [], 0, duration_s=12, measured_s=13.0, boards=["load-0", "load-1"])
    doc.update(
        {
            "devices": 2,
            "seconds": 12,
            "samples": [{k: r[k] for k in ("t_s", "board", "ttft_ms", "case", "cachebox")} for r in runs],
            "machine": {"cpu": "test cpu"},
        }
    )
    page = reports.load_report(tmp_path / "load.html", doc).read_text()
    assert page.startswith("<!doctype html>") and "<script src=" not in page
    assert "TTFT percentiles per window" in page and "test cpu" in page and "load-1" in page


@pytest.mark.model
@pytest.mark.cachebox
def test_bench_load_two_boards_for_eight_seconds(tmp_path, valkey_url):
    out = tmp_path / "load.json"
    done = run_manage(
        "bench",
        "load",
        "--devices",
        "2",
        "--seconds",
        "8",
        "--prompts",
        "4",
        "--max-tokens",
        "2",
        "--drain",
        "30",
        "--json",
        str(out),
        env={"REDIS_URL": valkey_url, "EDGECACHE_N_CTX": "2048"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    doc = json.loads(out.read_text())
    for key in (
        "runs",
        "errors",
        "lost",
        "ttft_ms_p50",
        "ttft_ms_p99",
        "hit_ratio",
        "cachebox_mb_per_s",
        "per_board",
        "windows",
        "machine",
        "cachebox",
    ):
        assert key in doc, key
    assert doc["runs"] > 0 and doc["errors"] == 0 and doc["lost"] == 0, doc["error_messages"]
    assert doc["runs"] + doc["lost"] + doc["exceptions"] == doc["dispatched"]
    assert [b["board"] for b in doc["per_board"]] == ["load-0", "load-1"] and not doc["board_deaths"]
    assert doc["cachebox"]["kind"] == "REDIS_URL (redis)" and doc["machine"]["threads"] == 1
    assert out.with_suffix(".html").exists() and b"runs per board" in done.stdout

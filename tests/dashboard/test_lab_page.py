"""The Lab page (issue 16): the lab strategies' trade-off charts from their newest saved bench
documents. The figure builders are pure (small made-up documents in the benches' shapes, no
model); the page is tested logged out, without documents, with them, and with hostile text."""

from __future__ import annotations

import json
import os
import time

import pytest
from django.urls import reverse

from dashboard.pages import lab_charts
from tests.dashboard.test_dashboard import staff_client  # noqa: F401  (fixture)


def exit_doc(**changes) -> dict:
    def point(measure, threshold, kv_fill, speedup, agreement, accuracy, rates, batch=1):
        return {
            "measure": measure,
            "threshold": threshold,
            "kv_fill": kv_fill,
            "batch": batch,
            "tokens_per_s": 40.0 * speedup,
            "speedup": speedup,
            "exit_rate_by_layer": rates,
            "agreement_token": agreement,
            "exact_match_32": agreement - 0.1,
            "mmlu_accuracy": accuracy,
        }

    doc = {
        "bench": "lab-exit",
        "machine": {"date": "2026-11-23T10:00:00Z", "cpu": "Test CPU"},
        "full_depth": {"tokens_per_s": 40.0, "mmlu_accuracy": 0.31},
        "curve": [
            point("top-prob", 0.9, True, 1.2, 0.95, 0.30, {"4": 0.05, "8": 0.2, "12": 0.1}),
            point("top-prob", 0.7, True, 1.6, 0.80, 0.27, {"4": 0.15, "8": 0.3, "12": 0.1}),
            point("top-prob", 0.9, False, 1.3, 0.90, 0.29, {"4": 0.05, "8": 0.2, "12": 0.1}),
            point("similarity", 0.95, True, 1.1, 0.97, 0.31, {"8": 0.1, "12": 0.2}),
        ],
        "differs_from_paper": ["a 270M model, not the paper's 7B"],
    }
    return {**doc, **changes}


def anchors_doc(**changes) -> dict:
    rows = [
        {
            "variant": variant,
            "kv_bytes": kv,
            "entry_bytes": kv + 1000,
            "kv_reduction": 6_000_000 / kv,
            "ttft_ms": 200.0,
            "decode_tokens_per_s": 30.0,
            "mmlu_accuracy": accuracy,
            "agreement": agreement,
            "wifi4_ttft_ms": wifi,
        }
        for variant, kv, accuracy, agreement, wifi in (
            ("tuned-pruned", 1_500_000, 0.28, 0.85, 900.0),
            ("base-full", 6_000_000, 0.31, 1.0, 2600.0),
            ("base-pruned", 1_500_000, 0.22, 0.6, 900.0),
            ("tuned-full", 6_000_000, 0.30, 0.97, 2600.0),
        )
    ]
    return {
        "bench": "lab-anchors",
        "machine": {"date": "2026-11-23T11:00:00Z"},
        "rows": rows,
        "fine_tune": {"steps": 10},
        "differs_from_paper": ["LoRA, not full fine-tuning"],
        **changes,
    }


def kvp_doc() -> dict:
    return {
        "prompts": 12,
        "ks": [3, 6],
        "base": {"median_ttft_ms": 500.0, "accuracy": 0.3},
        "table": [
            {
                "method": f"{label} (k={k})",
                "kind": kind,
                "k": k,
                "median_ttft_ms": 500.0 * ratio,
                "ttft_ratio": ratio,
                "first_token_agreement": agree,
                "accuracy": 0.25,
                "heldout_kl_mean": 0.4,
            }
            for k in (3, 6)
            for kind, label, ratio, agree in (
                ("kvp", "KV prediction", 0.4, 0.7),
                ("aux", "auxiliary alone", 0.3, 0.5),
                ("trunc", "truncated prompt", 0.35, 0.4),
            )
        ],
        "machine": {"date": "2026-11-22T09:00:00Z"},
    }


# -- the figures (pure) ----------------------------------------------------------------------------
def test_a_document_is_known_by_its_bench():
    assert lab_charts.document_kind(exit_doc()) == "lab-exit"
    assert lab_charts.document_kind(anchors_doc()) == "lab-anchors"
    assert lab_charts.document_kind(kvp_doc()) == "lab"
    assert (
        lab_charts.document_kind({"ttft_ratio_full_to_cold": 0.1}) is None and lab_charts.document_kind([1, 2]) is None
    )


def test_early_exit_draws_one_line_per_measure_and_kv_fill_labelled_by_threshold():
    figure = lab_charts.exit_tradeoff_figure(exit_doc(), "agreement_token")
    lines = {trace["name"]: trace for trace in figure["data"]}
    assert list(lines) == [
        "top probability, KV fill",
        "top probability, no KV fill",
        "hidden-state similarity, KV fill",
        "full depth",
    ]
    kv_fill = lines["top probability, KV fill"]
    assert (
        kv_fill["x"] == [1.2, 1.6] and kv_fill["y"] == [0.95, 0.80] and kv_fill["text"] == ["0.9", "0.7"]
    )  # by speed-up
    assert lines["full depth"]["x"] == [1.0] and lines["full depth"]["y"] == [1.0]
    assert "lab, approximate" in figure["layout"]["title"]["text"]
    accuracy = lab_charts.exit_tradeoff_figure(exit_doc(), "mmlu_accuracy")
    by_name = {trace["name"]: trace for trace in accuracy["data"]}
    assert by_name["top probability, KV fill"]["y"] == [0.30, 0.27] and by_name["full depth"]["y"] == [0.31]
    # Several batch sizes: each is its own line.
    doc = exit_doc()
    doc["curve"].append({**doc["curve"][0], "batch": 4, "speedup": 2.0})
    assert "top probability, KV fill, batch 4" in {
        trace["name"] for trace in lab_charts.exit_tradeoff_figure(doc, "agreement_token")["data"]
    }


def test_exit_rates_per_layer_are_a_row_per_setting_in_layer_order():
    figure = lab_charts.exit_layers_figure(exit_doc())
    (heatmap,) = figure["data"]
    assert list(heatmap["x"]) == ["4", "8", "12"]  # numeric order, not "12" < "4"
    assert list(heatmap["y"]) == ["top-prob 0.9 +fill", "top-prob 0.7 +fill", "top-prob 0.9", "similarity 0.95 +fill"]
    assert heatmap["customdata"][2][0] == "top probability ≥ 0.9, no KV fill"
    assert [list(row) for row in heatmap["z"]][3] == [
        None,
        0.1,
        0.2,
    ]  # a layer the document does not give: a gap, not 0
    assert "lab, approximate" in figure["layout"]["title"]["text"]


def test_anchor_tokens_draw_kv_size_against_accuracy_and_wifi4_ttft_per_variant():
    figure = lab_charts.anchors_accuracy_figure(anchors_doc())
    points = {trace["name"]: (trace["x"][0], trace["y"][0]) for trace in figure["data"]}
    assert list(points) == [
        "base-full",
        "base-pruned",
        "tuned-full",
        "tuned-pruned",
    ]  # the variants' order, whatever the document's
    assert points["tuned-pruned"] == (1.5, 0.28) and points["base-full"] == (6.0, 0.31)
    bars = lab_charts.anchors_ttft_figure(anchors_doc())
    wifi = next(trace for trace in bars["data"] if "Wi-Fi 4" in trace["name"])
    assert list(wifi["x"]) == ["base-full", "base-pruned", "tuned-full", "tuned-pruned"] and list(wifi["y"]) == [
        2600.0,
        900.0,
        2600.0,
        900.0,
    ]
    assert all("lab, approximate" in f["layout"]["title"]["text"] for f in (figure, bars))


def test_kv_prediction_draws_speed_up_against_agreement_and_lists_its_table():
    shown = lab_charts.section(lab_charts.STUDIES[2], kvp_doc())
    (figure,) = [f["figure"] for f in shown["figures"]]
    kvp = next(trace for trace in figure["data"] if trace["name"] == "KV prediction")
    assert (
        kvp["x"] == [pytest.approx(2.5), pytest.approx(2.5)]
        and kvp["y"] == [0.7, 0.7]
        and kvp["text"] == ["k=3", "k=6"]
    )
    (table,) = shown["tables"]
    assert table["rows"][0] == ["KV prediction (k=3)", "200.0", "0.400", "0.700", "0.250", "0.400"]
    assert "Base: median TTFT 500.0 ms" in shown["headline"]


def test_a_document_missing_figures_draws_gaps_and_an_empty_one_says_so():
    doc = exit_doc()
    del doc["curve"][0]["agreement_token"]
    doc["curve"][1]["speedup"] = "fast"
    line = next(
        t
        for t in lab_charts.exit_tradeoff_figure(doc, "agreement_token")["data"]
        if t["name"] == "top probability, KV fill"
    )
    assert None in line["y"] and None in line["x"]
    empty = lab_charts.exit_tradeoff_figure({"bench": "lab-exit"}, "agreement_token")
    assert (
        empty["layout"]["meta"] == {"empty": True}
        and empty["layout"]["annotations"][0]["text"] == "No curve points in this document"
    )
    assert (
        lab_charts.section(lab_charts.STUDIES[1], {"bench": "lab-anchors", "rows": "nope"})["tables"][0]["rows"] == []
    )


def test_document_text_reaches_plotly_escaped():
    doc = anchors_doc()
    doc["rows"][0]["variant"] = '<a href="javascript:alert(1)">x</a>'
    names = [trace["name"] for trace in lab_charts.anchors_accuracy_figure(doc)["data"]]
    assert '&lt;a href="javascript:alert(1)"&gt;x&lt;/a&gt;' in names and not any("<a" in name for name in names)


# -- the page -------------------------------------------------------------------------------------
@pytest.fixture
def results(settings, tmp_path):
    settings.BASE_DIR = tmp_path
    folder = tmp_path / "bench-results"
    folder.mkdir()

    def save(name: str, doc: dict, age_s: float = 0.0, html: bool = False):
        path = folder / f"{name}.json"
        path.write_text(json.dumps(doc))
        stamp = time.time() - age_s
        os.utime(path, (stamp, stamp))
        if html:
            path.with_suffix(".html").write_text("<!doctype html><p>report</p>")
        return path

    return save


@pytest.mark.django_db
def test_the_lab_page_needs_a_login(client):
    response = client.get(reverse("lab"))
    assert response.status_code == 302 and "login" in response["Location"]


@pytest.mark.django_db
def test_without_documents_the_lab_page_says_which_command_makes_each(staff_client, results):
    results(
        "cases-20261123-100000", {"ttft_ratio_full_to_cold": 0.1, "greedy_agreement": 1.0, "n": 3}
    )  # another bench: ignored
    page = staff_client.get(reverse("lab"))
    assert page.status_code == 200
    body = page.content.decode()
    for command in (
        "python manage.py bench lab-exit",
        "python manage.py bench lab-anchors",
        "python manage.py bench lab",
    ):
        assert f"No saved document yet: run <code>{command}</code>" in body
    assert page.context["chart_data"] == {"figures": {}}
    assert f'href="{reverse("lab")}"' in body  # in the navigation


@pytest.mark.django_db
def test_the_lab_page_draws_the_newest_document_of_each_study(staff_client, results):
    results("lab-exit-20261122-090000", exit_doc(full_depth={"tokens_per_s": 1.0, "mmlu_accuracy": 0.01}), age_s=3600)
    results("lab-exit-20261123-100000", exit_doc(), html=True)
    results("lab-anchors-20261123-110000", anchors_doc())
    results("lab-20261122-090000", kvp_doc())
    page = staff_client.get(reverse("lab"))
    body = page.content.decode()
    figures = page.context["chart_data"]["figures"]
    assert set(figures) == {
        "lab-exit-agreement",
        "lab-exit-accuracy",
        "lab-exit-layers",
        "lab-anchors-accuracy",
        "lab-anchors-ttft",
        "lab-kvp-agreement",
    }
    assert all("lab, approximate" in figure["layout"]["title"]["text"] for figure in figures.values())
    for chart in figures:
        assert f'id="{chart}" class="chart" data-figure="{chart}"' in body
    assert (
        "bench-results/lab-exit-20261123-100000.json" in body and "Full depth: 40.0 tokens/s" in body
    )  # the newer one
    assert reverse("benchmark-report", args=["lab-exit-20261123-100000"]) in body
    assert "No saved document yet" not in body
    # Table fallbacks, with headings for each study; differences from the paper listed.
    assert '<th scope="col">speed-up</th>' in body and '<th scope="row">tuned-pruned</th>' in body
    assert body.count('<h2 id="') == 3 and "LoRA, not full fine-tuning" in body
    assert 'id="chart-data"' in body
    listing = staff_client.get(reverse("benchmarks")).content.decode()
    assert (
        "early exit with KV fill (lab): 4 settings, speed-up up to 1.60x" in listing
        and "anchor tokens (lab): tuned-pruned, base-full" in listing
    )


@pytest.mark.django_db
def test_the_lab_page_escapes_document_text_and_draws_odd_values_as_they_are(staff_client, results):
    hostile = "<script>alert('lab')</script>"
    results("lab-anchors-20261123-110000", anchors_doc(), age_s=60)
    doc = anchors_doc(differs_from_paper=[hostile], machine={"date": hostile, "cpu": hostile})
    doc["rows"][1]["variant"] = hostile
    results("lab-anchors-20261123-120000", doc)  # newer: this one is drawn
    results(
        "lab-exit-20261123-100000",
        {
            "bench": "lab-exit",
            "curve": [{"exit_rate_by_layer": {"4": 0.1}, "threshold": {"not": "a number"}}],
            "differs_from_paper": [hostile],
        },
    )
    page = staff_client.get(reverse("lab"))
    assert page.status_code == 200
    body = page.content.decode()
    assert hostile not in body
    assert body.count("&lt;script&gt;alert(&#x27;lab&#x27;)&lt;/script&gt;") >= 4  # the machine, a table row, two notes
    # In the figures' JSON: escaped for Plotly (&lt;), then for the script tag (\u0026).
    assert "\\u0026lt;script\\u0026gt;" in body
    exit_table = next(s for s in page.context["sections"] if s["kind"] == "lab-exit")["tables"][0]["rows"]
    assert exit_table[0][3] == "{'not': 'a number'}"  # shown as it is, never guessed


@pytest.mark.django_db
def test_a_document_the_page_cannot_draw_is_named_and_the_other_studies_still_drawn(staff_client, results, monkeypatch):
    def broken(doc):
        raise KeyError("curve")

    studies = list(lab_charts.STUDIES)
    studies[0] = lab_charts.Study("lab-exit", "Early exit with KV fill", "seed 002", broken)
    monkeypatch.setattr(lab_charts, "STUDIES", tuple(studies))
    results("lab-exit-20261123-100000", exit_doc())
    results("lab-anchors-20261123-110000", anchors_doc())
    page = staff_client.get(reverse("lab"))
    body = page.content.decode()
    assert page.status_code == 200 and "This document could not be drawn (KeyError: &#x27;curve&#x27;)" in body
    assert set(page.context["chart_data"]["figures"]) == {"lab-anchors-accuracy", "lab-anchors-ttft"}

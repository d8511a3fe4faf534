"""Charts and tables of each benchmark's HTML report, with the paper's own figures beside ours.

Paper figures are quoted as data from: H. Matsutani, N. Matsuda, N. Sugiura, "Accelerating
local LLMs on resource-constrained edge devices via distributed prompt caching" (tables
2-4 and figure 5): Raspberry Pi Zero 2W (low-end, Gemma-3 270M, 1 shot) and Raspberry Pi 5
(high-end, Gemma-3 1B, 5 shots), Wi-Fi 4 to a Redis cache box.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.bench.common import median
from dashboard.bench.html_report import write_report
from inference.serving.breakdown import STACK

PAPER_SOURCE = "Matsutani, Matsuda, Sugiura: distributed prompt caching (tables 2-4, figure 5)"
PAPER_TABLE2 = {  # seconds
    "low-end (Pi Zero 2W)": {"ttft": (12.59, 0.87), "ttlt": (23.74, 11.86)},
    "high-end (Pi 5)": {"ttft": (2.70, 2.89), "ttlt": (2.77, 2.97)},
}
PAPER_TABLE3 = {  # ms: Token, Bloom, P-decode, Redis, R-decode, Sample
    "low-end case 1": (3.46, 0.30, 12580.85, 2.42, 11061.04, 95.69),
    "low-end case 5": (3.46, 0.19, 0.00, 861.92, 10904.67, 84.82),
    "high-end case 1": (1.61, 0.00, 2688.17, 7.84, 72.59, 1.45),
    "high-end case 5": (1.56, 0.00, 0.00, 2887.04, 78.12, 1.67),
}
PAPER_TABLE4 = {  # matched tokens -> total decoding time, ms
    "low-end": [(1, 27203.96), (10, 26288.23), (57, 24590.09), (340, 13344.96), (405, 11220.95)],
    "high-end": [(1, 3361.88), (10, 3280.38), (57, 2918.08), (340, 643.35), (405, 62.9)],
}
PAPER_REDIS_LOW_END_MS = 860.0  # figure 5 adds this fetch cost to the partial cases


def _stack_figure(title: str, bars: dict[str, dict[str, float]]) -> go.Figure:
    labels = list(bars)
    figure = go.Figure(
        [go.Bar(name=name, x=labels, y=[bars[label].get(field, 0.0) for label in labels]) for field, name in STACK]
    )
    figure.update_layout(
        title=title, barmode="stack", yaxis_title="ms", legend_traceorder="normal", template="plotly_white"
    )
    return figure


def cases_report(path: Path, doc: dict) -> Path:
    cases = doc["cases"]
    ours = {f"case {case} ({row['name']})": row["breakdown_ms"] for case, row in cases.items()}
    paper = {label: dict(zip([f for f, _ in STACK], values)) for label, values in PAPER_TABLE3.items()}
    table2 = make_subplots(rows=1, cols=2, subplot_titles=("TTFT, case 5 / case 1", "TTLT, case 5 / case 1"))
    groups = {
        "this machine": (cases["1"]["ttft_ms"], cases["5"]["ttft_ms"], cases["1"]["ttlt_ms"], cases["5"]["ttlt_ms"])
    }
    for label, row in PAPER_TABLE2.items():
        groups[f"paper {label}"] = (row["ttft"][0], row["ttft"][1], row["ttlt"][0], row["ttlt"][1])
    names = list(groups)
    table2.add_bar(x=names, y=[100 * g[1] / g[0] for g in groups.values()], name="TTFT %", row=1, col=1)
    table2.add_bar(x=names, y=[100 * g[3] / g[2] for g in groups.values()], name="TTLT %", row=1, col=2)
    table2.update_layout(
        title="Table 2: time with a full hit, as % of a miss (lower is better)",
        template="plotly_white",
        showlegend=False,
    )
    table2.update_yaxes(title_text="% of case 1")
    decode = go.Figure()
    ours_points = [
        (row["matched_tokens"], row["breakdown_ms"]["prefill_ms"] + row["breakdown_ms"]["decode_ms"])
        for row in cases.values()
    ]
    base = ours_points[0][1] or 1.0
    decode.add_scatter(
        x=[m for m, _ in ours_points],
        y=[100 * t / base for _, t in ours_points],
        name="this machine (P-decode + R-decode)",
        mode="lines+markers",
    )
    for label, points in PAPER_TABLE4.items():
        decode.add_scatter(
            x=[m for m, _ in points],
            y=[100 * t / points[0][1] for _, t in points],
            name=f"paper {label} (T-decode)",
            mode="lines+markers",
        )
    decode.update_layout(
        title="Table 4: decoding time against matched tokens, % of case 1",
        xaxis_title="matched tokens",
        yaxis_title="% of case 1",
        template="plotly_white",
    )
    figure5 = make_subplots(
        rows=1, cols=2, subplot_titles=("this machine (ms)", "paper, low-end, with the 0.86 s fetch (ms)")
    )
    labels = [f"case {case}" for case in cases]
    figure5.add_bar(
        x=labels,
        y=[row["breakdown_ms"]["prefill_ms"] + row["breakdown_ms"]["decode_ms"] for row in cases.values()],
        name="decoding",
        marker_color="#2ca02c",
        row=1,
        col=1,
    )
    figure5.add_bar(
        x=labels,
        y=[row["breakdown_ms"]["redis_ms"] for row in cases.values()],
        name="fetch + restore",
        marker_color="#9467bd",
        row=1,
        col=1,
    )
    paper_low = PAPER_TABLE4["low-end"]
    figure5.add_bar(
        x=labels,
        y=[t for _, t in paper_low],
        name="decoding (paper)",
        marker_color="#2ca02c",
        showlegend=False,
        row=1,
        col=2,
    )
    figure5.add_bar(
        x=labels,
        y=[0] + [PAPER_REDIS_LOW_END_MS] * 4,
        name="Redis (paper)",
        marker_color="#9467bd",
        showlegend=False,
        row=1,
        col=2,
    )
    figure5.update_layout(
        title="Figure 5: partial matching with the fetch cost included", barmode="stack", template="plotly_white"
    )
    rows = [
        {
            "case": f"{case} {row['name']}",
            "ttft_ms": row["ttft_ms"],
            "ttlt_ms": row["ttlt_ms"],
            **{n: row["breakdown_ms"][f] for f, n in STACK},
            "matched": row["matched_tokens"],
            "tokens": row["prompt_tokens"],
            "state_MB": row["state_bytes"] / 1e6,
        }
        for case, row in cases.items()
    ]
    summary = (
        f"{doc['n']} MMLU {doc.get('topic', '')} prompts, {doc.get('shots', '')}-shot. Full-hit TTFT / cold TTFT = {doc['ttft_ratio_full_to_cold']}; "
        f"greedy agreement {doc['greedy_agreement']}; {doc['bytes_per_cached_token']} bytes per cached token. Paper figures quoted from {PAPER_SOURCE}."
    )
    return write_report(
        path,
        "bench cases: the paper's five cases",
        summary,
        [
            _stack_figure("Table 3, this machine: median breakdown (ms)", ours),
            _stack_figure("Table 3, paper (ms)", paper),
            table2,
            decode,
            figure5,
        ],
        {"Medians per case": rows},
        doc,
    )


def breakeven_report(path: Path, doc: dict) -> Path:
    figure = make_subplots(
        rows=1, cols=len(doc["presets"]), subplot_titles=[f"{p}: {d['link']}" for p, d in doc["presets"].items()]
    )
    palette = {"always": "#1f77b4", "never": "#d62728", "fetch-or-compute": "#ff7f0e", "adaptive": "#2ca02c"}
    colors = {mode: palette[mode] for mode in doc.get("modes", ["always", "never", "adaptive"])}
    rows = []
    for column, (preset, data) in enumerate(doc["presets"].items(), start=1):
        cases = list(data["cases"])
        for mode, color in colors.items():
            figure.add_bar(
                x=[f"case {c}" for c in cases],
                y=[data["cases"][c][f"{mode}_ttft_ms"] for c in cases],
                name=mode,
                marker_color=color,
                showlegend=column == 1,
                row=1,
                col=column,
            )
        for case, row in data["cases"].items():
            rows.append(
                {
                    "link": preset,
                    "case": f"{case} {doc['case_names'][case]}",
                    **{k: v for k, v in row.items() if k != "adaptive_decisions"},
                    "decisions": ", ".join(f"{k}: {v}" for k, v in row["adaptive_decisions"].items()),
                }
            )
    profile = doc.get("compute_profile") or ""
    threads = doc.get("threads")
    figure.update_layout(
        title=f"Median TTFT: always fetch, never fetch, fetch-or-compute, adaptive with loading while computing ({threads} thread(s){'; ' + profile if profile else ''})",
        barmode="group",
        template="plotly_white",
    )
    figure.update_yaxes(title_text="ms", type="log")
    summary = f"Policy within 5% of the better fixed choice everywhere: {doc['target_met']}."
    if doc.get("overlap_target_met") is not None:
        summary += f" Wi-Fi 4, cases 4 and 5, adaptive at most {doc['overlap_target']}x the better fixed choice: {doc['overlap_target_met']}."
    summary += " Every figure is taken under an emulated link except 'none'."
    if profile:
        summary += f" Compute paced to {profile}: emulated, not measured on that board."
    return write_report(path, "bench breakeven", summary, [figure], {"Median TTFT per link and case": rows}, doc)


def kv_report(path: Path, doc: dict) -> Path:
    kinds = list(doc["kv_types"])
    codecs = list(next(iter(doc["kv_types"].values()))["codecs"])
    sizes = go.Figure(
        [
            go.Bar(x=kinds, y=[doc["kv_types"][kv]["codecs"][name]["bytes_per_token"] for kv in kinds], name=name)
            for name in codecs
        ]
    )
    sizes.update_layout(
        title="Bytes per cached token, by KV type and codec",
        barmode="group",
        yaxis_title="bytes",
        template="plotly_white",
    )
    quality = go.Figure()
    for field, label in (
        ("accuracy", "MMLU accuracy"),
        ("first_token_agreement", "first-token agreement with f16"),
        ("answer_agreement", "answer agreement with f16"),
    ):
        quality.add_bar(x=kinds, y=[doc["kv_types"][kv][field] for kv in kinds], name=label)
    quality.update_layout(
        title=f"Quality against f16 ({doc['n']} paired prompts)",
        barmode="group",
        yaxis=dict(range=[0, 1]),
        template="plotly_white",
    )
    rows = []
    for kv in kinds:
        row = doc["kv_types"][kv]
        for name, figures in row["codecs"].items():
            rows.append({"kv": kv, "codec": name, **figures})
    quality_rows = [
        {"kv": kv, **{k: v for k, v in row.items() if k != "codecs"}} for kv, row in doc["kv_types"].items()
    ]
    summary = "Lossless codecs are exact; quantized KV types are other model configurations (their own fingerprint), measured against f16."
    return write_report(path, "bench kv", summary, [sizes, quality], {"Codecs": rows, "Quality": quality_rows}, doc)


def modules_report(path: Path, doc: dict) -> Path:
    ttft = go.Figure([go.Bar(x=["full prefill", "cached modules"], y=[doc["baseline_ttft_ms"], doc["cached_ttft_ms"]])])
    ttft.update_layout(
        title=f"Median TTFT, {doc['shots']}-shot MMLU (ratio {doc['ratio']})", yaxis_title="ms", template="plotly_white"
    )
    scaffold = doc["scaffold"]
    arms = [
        ("full prefill", doc["accuracy_baseline"], doc["accuracy_baseline_ci95"]),
        ("modules", doc["accuracy_cached"], doc["accuracy_cached_ci95"]),
    ]
    arms += [
        (f"{name} (scaffold subset)", scaffold[name]["accuracy"], scaffold[name]["ci95"])
        for name in ("baseline", "modules", "scaffold")
    ]
    accuracy = go.Figure(
        [
            go.Bar(
                x=[a[0] for a in arms],
                y=[a[1] for a in arms],
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=[a[2][1] - a[1] for a in arms],
                    arrayminus=[a[1] - a[2][0] for a in arms],
                ),
            )
        ]
    )
    accuracy.update_layout(title="Accuracy with 95% intervals", yaxis=dict(range=[0, 1]), template="plotly_white")
    topics = doc.get("per_topic", {})
    per_topic = go.Figure([go.Bar(x=list(topics), y=[t["ratio"] for t in topics.values()])])
    per_topic.update_layout(title="Cached / full-prefill TTFT by topic", yaxis_title="ratio", template="plotly_white")
    rows = [{"topic": name, **values} for name, values in topics.items()]
    return write_report(
        path,
        "bench modules (Prompt Cache on MMLU)",
        f"{doc['n']} prompts; ratio {doc['ratio']}; accuracy {doc['accuracy_baseline']} vs {doc['accuracy_cached']}.",
        [ttft, accuracy, per_topic],
        {"Per topic": rows},
        doc,
    )


def peers_report(path: Path, doc: dict) -> Path:
    peers = doc["peers"]
    names = list(peers)
    figure = go.Figure()
    figure.add_bar(x=names, y=[peers[n]["ttft_ms"] for n in names], name="cold TTFT")
    figure.add_bar(x=names, y=[peers[n]["hit_ttft_ms"] for n in names], name="hit TTFT")
    figure.update_layout(
        title="Median TTFT by peer (log scale)",
        barmode="group",
        yaxis_type="log",
        yaxis_title="ms",
        template="plotly_white",
    )
    rows = [{"peer": n, **{k: v for k, v in p.items() if not isinstance(v, (dict, list))}} for n, p in peers.items()]
    return write_report(path, "bench peers", doc.get("summary", ""), [figure], {"Peers": rows}, doc)


def catalog_report(path: Path, doc: dict) -> Path:
    sweep = doc["sweep"]
    figure = go.Figure()
    for mode in ("with_catalog", "without_catalog"):
        figure.add_scatter(
            x=[row["hit_ratio"] for row in sweep],
            y=[row[mode]["mean_ttft_ms"] for row in sweep],
            name=mode.replace("_", " "),
            mode="lines+markers",
        )
    figure.update_layout(
        title=f"Mean TTFT against hit ratio ({doc['link']})",
        xaxis_title="hit ratio",
        yaxis_title="ms",
        template="plotly_white",
    )
    rows = [
        {
            "hit_ratio": row["hit_ratio"],
            **{f"{mode} {k}": v for mode in ("with_catalog", "without_catalog") for k, v in row[mode].items()},
        }
        for row in sweep
    ]
    fp = [
        {
            "capacity": r["capacity"],
            "configured": r["configured"],
            "observed": r["observed"],
            "estimated": r["estimated"],
            "size_MB": r["size_bytes"] / 1e6,
        }
        for r in doc["false_positives"]
    ]
    return write_report(
        path, "bench catalog", doc.get("summary", ""), [figure], {"Hit-ratio sweep": rows, "False positives": fp}, doc
    )


def scale_report(path: Path, doc: dict) -> Path:
    rows = doc["lengths"]
    figure = go.Figure()
    figure.add_scatter(
        x=[r["prompt_tokens"] for r in rows],
        y=[r["cold_ttft_ms"] for r in rows],
        name="cold TTFT",
        mode="lines+markers",
    )
    figure.add_scatter(
        x=[r["prompt_tokens"] for r in rows],
        y=[r["hit_ttft_ms"] for r in rows],
        name="full-hit TTFT",
        mode="lines+markers",
    )
    figure.update_layout(
        title="TTFT against prompt length",
        xaxis_title="prompt tokens",
        yaxis_title="ms",
        yaxis_type="log",
        template="plotly_white",
    )
    size = go.Figure(
        [
            go.Scatter(
                x=[r["prompt_tokens"] for r in rows],
                y=[r["state_bytes"] / 1e6 for r in rows],
                mode="lines+markers",
                name="state MB",
            )
        ]
    )
    size.update_layout(
        title="Prompt state size against prompt length",
        xaxis_title="prompt tokens",
        yaxis_title="MB",
        template="plotly_white",
    )
    return write_report(path, "bench scale", doc.get("summary", ""), [figure, size], {"Lengths": rows}, doc)


def load_report(path: Path, doc: dict) -> Path:
    samples = doc.get("samples", [])
    over_time = go.Figure()
    for board in sorted({s["board"] for s in samples}):
        mine = [s for s in samples if s["board"] == board]
        over_time.add_scatter(
            x=[s["t_s"] for s in mine],
            y=[s["ttft_ms"] for s in mine],
            mode="markers",
            name=board,
            text=[s["case"] for s in mine],
        )
    over_time.update_layout(
        title="TTFT of every run, by dispatch time",
        xaxis_title="s since the start",
        yaxis_title="ms",
        yaxis_type="log",
        template="plotly_white",
    )
    windows = doc["windows"]
    labels = [f"{w['start_s']:g}-{w['end_s']:g} s" for w in windows]
    per_window = go.Figure()
    per_window.add_scatter(x=labels, y=[w["ttft_ms_p50"] for w in windows], mode="lines+markers", name="p50")
    per_window.add_scatter(x=labels, y=[w["ttft_ms_p99"] for w in windows], mode="lines+markers", name="p99")
    per_window.update_layout(
        title="TTFT percentiles per window (runs dispatched in it)", yaxis_title="ms", template="plotly_white"
    )
    return write_report(
        path,
        f"bench load: {doc['devices']} boards, {doc['seconds']:g} s",
        doc.get("summary", ""),
        [over_time, per_window],
        {"Windows": windows, "Boards": doc["per_board"]},
        doc,
    )


def exact_report(path: Path, doc: dict) -> Path:
    costs = doc["cut_costs"]
    cost = go.Figure(
        [
            go.Bar(
                x=list(costs),
                y=[row["prefill_ms"] for row in costs.values()],
                text=[f"x{row['ratio_to_uncut']}" for row in costs.values()],
            )
        ]
    )
    cost.update_layout(
        title="Cold prefill with batches cut on a fixed grid (median ms; ratio to n_batch batches)",
        yaxis_title="ms",
        template="plotly_white",
    )
    cases = doc["by_case"]
    agreement = go.Figure(
        [
            go.Bar(
                x=list(cases),
                y=[row["greedy_agreement"] or 0 for row in cases.values()],
                text=[f"{row['runs']} runs" for row in cases.values()],
            )
        ]
    )
    agreement.update_layout(
        title=f"Greedy agreement with the cold run ({doc['max_tokens']} tokens), by case",
        yaxis_range=[0, 1.05],
        template="plotly_white",
    )
    summary = (
        f"Grid {doc['grid']} tokens; resumed logits bitwise identical to cold in {doc['resumed_logits_bitwise_identical']} prompts "
        f"(max |diff| {doc['resumed_logits_max_abs_diff']}); greedy agreement over every served run {doc['greedy_agreement_all']}."
    )
    return write_report(
        path,
        "bench exact",
        summary,
        [cost, agreement],
        {
            "Cut costs": [{"variant": k, **v} for k, v in costs.items()],
            "By case": [{"case": k, **v} for k, v in cases.items()],
        },
        doc,
    )


def tiers_report(path: Path, doc: dict) -> Path:
    medians = doc["median_ttft_ms"]
    figure = go.Figure(
        [go.Bar(x=list(medians), y=list(medians.values()), text=[f"{v:.1f} ms" for v in medians.values()])]
    )
    figure.update_layout(
        title="Full-hit TTFT by where the state comes from (median ms, log scale)",
        yaxis_type="log",
        yaxis_title="ms",
        template="plotly_white",
    )
    summary = f"{doc['n']} prompts; ratios {doc['ratios']}; network bytes {doc['network_bytes']}; agreement with cold {doc['agreement_with_cold']}."
    summary += f" Link to the cache box: {doc.get('link', 'unshaped')}; flash tier read from {doc.get('flash_disk') or 'this machine'}."
    figures, tables = [figure], {"Medians": [{"source": k, "ttft_ms": v} for k, v in medians.items()]}
    conversation = doc.get("conversation")
    if conversation:
        rows = conversation["rows"]
        turns = sorted({row["turn"] for row in rows})

        def by_turn(name: str) -> list[float]:
            return [median(row[name] for row in rows if row["turn"] == turn) for turn in turns]

        chat = go.Figure(
            [
                go.Bar(name=label, x=[f"turn {turn}" for turn in turns], y=by_turn(name))
                for name, label in (
                    ("cold_ttft_ms", "cold"),
                    ("cachebox_ttft_ms", "cache box (another board)"),
                    ("context_ttft_ms", "context (same board)"),
                )
            ]
        )
        chat.update_layout(
            title="Conversation turns: TTFT by where the previous turns' state comes from (median ms)",
            barmode="group",
            yaxis_title="ms",
            template="plotly_white",
        )
        figures.append(chat)
        tables["Conversation turns"] = rows
        summary += f" Conversations, later turns: {conversation['later_turns']}."
    return write_report(path, "bench tiers", summary, figures, tables, doc)

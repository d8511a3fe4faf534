"""The Lab page's figures and tables: the lab strategies' trade-offs, from the documents that
``python manage.py bench lab-exit``, ``bench lab-anchors`` and ``bench lab`` save.

Pure: a document (a dict, as read from its JSON) in, Plotly figures (plain dicts, as the other
charts) and table rows out; no files, no database. Documents come from a benchmark run on some
machine and may be older or newer than this code: missing figures are drawn as gaps, never
guessed. Every figure says the strategies are approximate (lab). Text from a document is
escaped before Plotly sees it (Plotly reads a few HTML tags in text).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Callable

import plotly.graph_objects as go

from dashboard.bench.documents import kind_of
from dashboard.pages.charts import _figure

APPROXIMATE = "lab, approximate"
NOTE = (
    "Lab strategies are approximate: they trade answer quality for speed or size, unlike EdgeCache's exact serving "
    "(a cached answer is the cold answer, bit for bit). Figures are from the newest saved benchmark document of each study."
)
# Early exit's measures, in the words the figures use.
MEASURES = {"top-prob": "top probability", "similarity": "hidden-state similarity"}
ANCHOR_VARIANTS = ("base-full", "base-pruned", "tuned-full", "tuned-pruned")
KVP_KINDS = {
    "kvp": ("KV prediction", "circle"),
    "aux": ("auxiliary alone", "x"),
    "trunc": ("base, truncated prompt", "square"),
}


@dataclass(frozen=True)
class Study:
    kind: str  # the bench subcommand, and the ``bench`` field of its documents
    title: str
    seed: str  # the paper it follows (../shared/seeds)
    build: Callable[[dict], dict]

    @property
    def command(self) -> str:
        return f"python manage.py bench {self.kind}"


def document_kind(doc) -> str | None:
    """Which lab study a saved benchmark document holds (its ``bench``), or None (another benchmark)."""

    kind = kind_of(doc)
    return kind if kind in {study.kind for study in STUDIES} else None


# -- small helpers ----------------------------------------------------------------------------------
def _text(value) -> str:
    """Document text as Plotly shows it literally."""
    return html.escape(str(value), quote=False)


def _number(value) -> float | None:
    """A figure from a document; None (a gap) for anything that is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _cell(value, digits: int = 3) -> str:
    """A table cell: a number to ``digits`` places, "–" for none, anything else as it is."""
    number = _number(value)
    if number is None:
        return "–" if value is None else str(value)
    return f"{number:.{digits}f}"


def _threshold(value) -> str:
    number = _number(value)
    return f"{number:g}" if number is not None else _cell(value)


def _rows(doc: dict, key: str) -> list[dict]:
    rows = doc.get(key)
    return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []


def _title(text: str) -> str:
    return f"{text} ({APPROXIMATE})"


def _table(caption: str, headers: list[str], rows: list[list[str]]) -> dict:
    return {"caption": caption, "headers": headers, "rows": rows}


# -- early exit with KV fill (bench lab-exit) ------------------------------------------------------------
EXIT_METRICS = {"agreement_token": "token agreement with full depth", "mmlu_accuracy": "MMLU accuracy"}


def _exit_label(point: dict, batches: set) -> str:
    measure = MEASURES.get(point.get("measure"), str(point.get("measure")))
    label = f"{measure}, {'KV fill' if point.get('kv_fill') else 'no KV fill'}"
    return _text(label + (f", batch {point.get('batch')}" if len(batches) > 1 else ""))


def exit_tradeoff_figure(doc: dict, metric: str) -> dict:
    """Speed-up (x) against ``metric`` (y: token agreement or MMLU accuracy), one line per
    measure x KV fill (x batch, when the curve has several), points labelled by threshold."""
    curve = _rows(doc, "curve")
    batches = {point.get("batch") for point in curve}
    lines: dict[str, list[dict]] = {}
    for point in curve:
        lines.setdefault(_exit_label(point, batches), []).append(point)
    traces = []
    for name, points in lines.items():
        points = sorted(points, key=lambda p: _number(p.get("speedup")) or 0.0)
        traces.append(
            go.Scatter(
                name=name,
                x=[_number(p.get("speedup")) for p in points],
                y=[_number(p.get(metric)) for p in points],
                mode="lines+markers+text",
                text=[_text(_threshold(p.get("threshold"))) for p in points],
                textposition="top center",
                customdata=[[_number(p.get("tokens_per_s")), _number(p.get("exact_match_32"))] for p in points],
                hovertemplate="threshold %{text}: %{x:.2f}x, %{y:.3f}<br>%{customdata[0]:.1f} tokens/s, 32-token exact match %{customdata[1]:.2f}",
                line=dict(dash="solid" if "no KV fill" not in name else "dot"),
            )
        )
    full = doc.get("full_depth") if isinstance(doc.get("full_depth"), dict) else {}
    reference = 1.0 if metric == "agreement_token" else _number(full.get(metric))
    if traces and reference is not None:
        traces.append(
            go.Scatter(
                name="full depth",
                x=[1.0],
                y=[reference],
                mode="markers",
                marker=dict(symbol="star", size=13, color="#344054"),
            )
        )
    return _figure(
        traces,
        _title(f"Early exit: speed-up against {EXIT_METRICS[metric]}"),
        empty_text="No curve points in this document",
        xaxis_title="decode speed-up over full depth (x); labels: exit threshold",
        yaxis_title=EXIT_METRICS[metric],
        height=380,
    )


def _exit_rows_by_setting(doc: dict) -> list[tuple[str, str, dict]]:
    """One (short label, label, exit rate by layer) per measure x KV fill x threshold (the first
    batch that has it). The short label fits a phone's width beside the heatmap."""
    seen, rows = set(), []
    for point in _rows(doc, "curve"):
        rates = point.get("exit_rate_by_layer")
        measure, kv_fill, threshold = (
            str(point.get("measure")),
            bool(point.get("kv_fill")),
            _threshold(point.get("threshold")),
        )
        if (measure, kv_fill, threshold) in seen or not isinstance(rates, dict):
            continue
        seen.add((measure, kv_fill, threshold))
        short = f"{measure} {threshold}{' +fill' if kv_fill else ''}"
        label = f"{MEASURES.get(measure, measure)} ≥ {threshold}, {'KV fill' if kv_fill else 'no KV fill'}"
        rows.append((short, label, rates))
    return rows


def _layers(rows: list[tuple[str, str, dict]]) -> list[str]:
    names = {str(layer) for *_, rates in rows for layer in rates}
    return sorted(names, key=lambda name: (0, int(name)) if name.lstrip("-").isdigit() else (1, name))


def exit_layers_figure(doc: dict) -> dict:
    """Where tokens leave the model: the exit rate at each layer, one row per setting."""
    rows = _exit_rows_by_setting(doc)
    layers = _layers(rows)
    traces = []
    if rows:
        traces.append(
            go.Heatmap(
                name="exit rate",
                x=[_text(layer) for layer in layers],
                y=[_text(short) for short, _, _ in rows],
                z=[[_number(rates.get(layer)) for layer in layers] for *_, rates in rows],
                customdata=[[_text(label)] * len(layers) for _, label, _ in rows],
                colorscale="Blues",
                zmin=0,
                colorbar=dict(
                    title=dict(text="exit rate", side="right"),
                    orientation="h",
                    y=-0.3,
                    yanchor="top",
                    len=0.7,
                    thickness=10,
                ),
                hovertemplate="%{customdata}, layer %{x}: %{z:.3f}<extra></extra>",
            )
        )
    figure = _figure(
        traces,
        _title("Early exit: exit rate per layer"),
        empty_text="No exit rates in this document",
        xaxis=dict(title="layer", type="category"),
        yaxis=dict(automargin=True, autorange="reversed"),  # the first setting on top, as in its table
        margin=dict(l=55, r=15, t=56, b=110),
        height=max(340, 150 + 26 * len(rows)),
    )
    # The row labels push the plot right: the title starts at the chart's edge, not the plot's.
    figure["layout"]["title"].update(xref="container", x=0.01)
    return figure


def exit_section(doc: dict) -> dict:
    curve = _rows(doc, "curve")
    full = doc.get("full_depth") if isinstance(doc.get("full_depth"), dict) else {}
    layer_rows = _exit_rows_by_setting(doc)
    layers = _layers(layer_rows)
    headline = (
        f"Full depth: {_cell(full.get('tokens_per_s'), 1)} tokens/s, MMLU accuracy {_cell(full.get('mmlu_accuracy'))}."
        if full
        else ""
    )
    return {
        "headline": headline,
        "figures": [
            {
                "id": "lab-exit-agreement",
                "figure": exit_tradeoff_figure(doc, "agreement_token"),
                "caption": "Each line: one confidence measure, with or without KV fill; each point: one exit threshold. Up and right is better; the star is full depth.",
            },
            {
                "id": "lab-exit-accuracy",
                "figure": exit_tradeoff_figure(doc, "mmlu_accuracy"),
                "caption": "The same settings against MMLU accuracy (the star: full depth's accuracy).",
            },
            {
                "id": "lab-exit-layers",
                "figure": exit_layers_figure(doc),
                "caption": "Darker: more tokens leave the model at that layer (the rest of their layers are skipped, or filled in with KV fill).",
            },
        ],
        "tables": [
            _table(
                "Speed-quality curve",
                [
                    "measure",
                    "KV fill",
                    "batch",
                    "threshold",
                    "tokens/s",
                    "speed-up",
                    "token agreement",
                    "32-token exact match",
                    "MMLU accuracy",
                ],
                [
                    [
                        MEASURES.get(p.get("measure"), str(p.get("measure"))),
                        "yes" if p.get("kv_fill") else "no",
                        _cell(p.get("batch"), 0),
                        _threshold(p.get("threshold")),
                        _cell(p.get("tokens_per_s"), 1),
                        _cell(p.get("speedup"), 2),
                        _cell(p.get("agreement_token")),
                        _cell(p.get("exact_match_32")),
                        _cell(p.get("mmlu_accuracy")),
                    ]
                    for p in curve
                ],
            ),
            _table(
                "Exit rate per layer",
                ["setting", *[f"layer {layer}" for layer in layers]],
                [[label, *[_cell(rates.get(layer)) for layer in layers]] for _, label, rates in layer_rows],
            ),
        ],
    }


# -- anchor tokens (bench lab-anchors) --------------------------------------------------------------------
def _variant_order(rows: list[dict]) -> list[dict]:
    known = {name: index for index, name in enumerate(ANCHOR_VARIANTS)}
    return sorted(rows, key=lambda row: known.get(row.get("variant"), len(known)))


def anchors_accuracy_figure(doc: dict) -> dict:
    """KV bytes (x) against MMLU accuracy (y), one point per variant (full or pruned, base or anchor-tuned)."""
    traces = []
    for row in _variant_order(_rows(doc, "rows")):
        kv_bytes = _number(row.get("kv_bytes"))
        name = _text(row.get("variant"))
        traces.append(
            go.Scatter(
                name=name,
                x=[kv_bytes / 1e6 if kv_bytes is not None else None],
                y=[_number(row.get("mmlu_accuracy"))],
                mode="markers",
                text=[name],
                marker=dict(size=13, symbol="diamond" if "pruned" in str(row.get("variant")) else "circle"),
                customdata=[
                    [_number(row.get("kv_reduction")), _number(row.get("agreement")), _number(row.get("entry_bytes"))]
                ],
                hovertemplate="%{text}: %{x:.2f} MB of KV, accuracy %{y:.3f}<br>KV reduction %{customdata[0]:.2f}x, agreement %{customdata[1]:.3f}, entry %{customdata[2]:,} bytes<extra></extra>",
            )
        )
    return _figure(
        traces,
        _title("Anchor tokens: KV cache size against MMLU accuracy"),
        empty_text="No variants in this document",
        xaxis_title="KV cache (MB)",
        yaxis_title="MMLU accuracy",
        height=380,
    )


def anchors_ttft_figure(doc: dict) -> dict:
    """Time to first token of each variant with its entry fetched over the emulated Wi-Fi 4 link, and on this machine."""
    rows = _variant_order(_rows(doc, "rows"))
    names = [_text(row.get("variant")) for row in rows]
    traces = []
    if rows:
        traces = [
            go.Bar(
                name="entry fetched over Wi-Fi 4 (emulated)",
                x=names,
                y=[_number(row.get("wifi4_ttft_ms")) for row in rows],
                marker=dict(color="#1f77b4"),
            ),
            go.Bar(
                name="on this machine",
                x=names,
                y=[_number(row.get("ttft_ms")) for row in rows],
                marker=dict(color="#98a2b3"),
            ),
        ]
    return _figure(
        traces,
        _title("Anchor tokens: time to first token over Wi-Fi 4 (ms)"),
        empty_text="No variants in this document",
        barmode="group",
        yaxis_title="ms",
    )


def anchors_section(doc: dict) -> dict:
    rows = _variant_order(_rows(doc, "rows"))
    return {
        "headline": "",
        "figures": [
            {
                "id": "lab-anchors-accuracy",
                "figure": anchors_accuracy_figure(doc),
                "caption": "Left and up is better: a smaller KV cache at the same accuracy. Full keeps every cell; pruned keeps the anchors'.",
            },
            {
                "id": "lab-anchors-ttft",
                "figure": anchors_ttft_figure(doc),
                "caption": "A smaller entry crosses the slow link sooner; the grey bars are the same runs without the link.",
            },
        ],
        "tables": [
            _table(
                "Variants",
                [
                    "variant",
                    "KV bytes",
                    "entry bytes",
                    "KV reduction",
                    "TTFT ms",
                    "TTFT over Wi-Fi 4 ms",
                    "decode tokens/s",
                    "MMLU accuracy",
                    "agreement",
                ],
                [
                    [
                        str(row.get("variant")),
                        _cell(row.get("kv_bytes"), 0),
                        _cell(row.get("entry_bytes"), 0),
                        _cell(row.get("kv_reduction"), 2),
                        _cell(row.get("ttft_ms"), 1),
                        _cell(row.get("wifi4_ttft_ms"), 1),
                        _cell(row.get("decode_tokens_per_s"), 1),
                        _cell(row.get("mmlu_accuracy")),
                        _cell(row.get("agreement")),
                    ]
                    for row in rows
                ],
            ),
        ],
    }


# -- KV prediction (bench lab) --------------------------------------------------------------------------
def kvp_figure(doc: dict) -> dict:
    """TTFT speed-up (x) against greedy first-token agreement with the base (y), per method and k."""
    table = _rows(doc, "table")
    traces = []
    for kind, (name, symbol) in KVP_KINDS.items():
        rows = [row for row in table if row.get("kind") == kind]
        if not rows:
            continue
        ratios = [_number(row.get("ttft_ratio")) for row in rows]
        traces.append(
            go.Scatter(
                name=name,
                x=[1 / ratio if ratio else None for ratio in ratios],
                y=[_number(row.get("first_token_agreement")) for row in rows],
                mode="lines+markers+text",
                text=[f"k={_text(row.get('k'))}" for row in rows],
                textposition="top center",
                marker=dict(symbol=symbol, size=10),
            )
        )
    if traces:
        traces.append(
            go.Scatter(
                name="base (full prefill)",
                x=[1.0],
                y=[1.0],
                mode="markers",
                marker=dict(symbol="star", size=13, color="#344054"),
            )
        )
    return _figure(
        traces,
        _title("KV prediction: TTFT speed-up against first-token agreement"),
        empty_text="No rows in this document",
        xaxis_title="TTFT speed-up over full prefill (x)",
        yaxis_title="first-token agreement with the base",
        height=380,
    )


def kvp_section(doc: dict) -> dict:
    base = doc.get("base") if isinstance(doc.get("base"), dict) else {}
    headline = (
        f"Base: median TTFT {_cell(base.get('median_ttft_ms'), 1)} ms, accuracy {_cell(base.get('accuracy'))} over {_cell(doc.get('prompts'), 0)} prompts."
        if base
        else ""
    )
    return {
        "headline": headline,
        "figures": [
            {
                "id": "lab-kvp-agreement",
                "figure": kvp_figure(doc),
                "caption": "Each line: a method for k = the auxiliary's layers. Up and right is better; the star is full prefill.",
            }
        ],
        "tables": [
            _table(
                "Each k and its baselines",
                ["method", "median TTFT ms", "TTFT ratio", "first-token agreement", "accuracy", "held-out KL (mean)"],
                [
                    [
                        str(row.get("method")),
                        _cell(row.get("median_ttft_ms"), 1),
                        _cell(row.get("ttft_ratio")),
                        _cell(row.get("first_token_agreement")),
                        _cell(row.get("accuracy")),
                        _cell(row.get("heldout_kl_mean")),
                    ]
                    for row in _rows(doc, "table")
                ],
            ),
        ],
    }


STUDIES = (
    Study("lab-exit", "Early exit with KV fill", "seed 002", exit_section),
    Study("lab-anchors", "Anchor tokens", "seed 004", anchors_section),
    Study("lab", "KV prediction", "seed 001", kvp_section),
)


def section(study: Study, doc: dict | None) -> dict:
    """What the Lab page shows of ``study``: its figures, tables and differences from its paper,
    or (``doc`` None) the command that produces its document."""
    shown = {
        "kind": study.kind,
        "title": study.title,
        "seed": study.seed,
        "command": study.command,
        "figures": [],
        "tables": [],
        "notes": [],
        "headline": "",
    }
    if doc is None:
        return shown
    shown.update(study.build(doc))
    notes = doc.get("differs_from_paper")
    shown["notes"] = [str(note) for note in notes] if isinstance(notes, list) else []
    return shown

"""Self-contained HTML reports: Plotly charts (plotly.js inline, nothing fetched), tables
and the run metadata, saved beside each benchmark's JSON."""

from __future__ import annotations

import html
import json
from pathlib import Path

import plotly.graph_objects as go
import plotly.io
import plotly.offline


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(row.get(c)))}</td>" for c in columns) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.1f}"
    return "" if value is None else str(value)


def write_report(
    path: str | Path, title: str, summary: str, figures: list[go.Figure], tables: dict[str, list[dict]], document: dict
) -> Path:
    """Write ``path`` (.html): charts, tables, then the machine and the full JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    charts = "".join(
        f'<section class="chart">{plotly.io.to_html(figure, full_html=False, include_plotlyjs=False)}</section>'
        for figure in figures
    )
    tables_html = "".join(
        f"<section><h2>{html.escape(name)}</h2>{_table(rows)}</section>" for name, rows in tables.items()
    )
    machine = _table([{"field": k, "value": v} for k, v in (document.get("machine") or {}).items()])
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2rem;color:#1d2330}}table{{border-collapse:collapse;margin:.5rem 0}}
th,td{{border-bottom:1px solid #ddd;padding:.25rem .6rem;text-align:left;font-size:.9rem}}section{{margin-bottom:1.5rem}}
pre{{background:#f3f4f7;padding:.6rem;overflow:auto;max-height:30rem}}</style>
<script>{plotly.offline.get_plotlyjs()}</script></head><body>
<h1>{html.escape(title)}</h1><p>{html.escape(summary)}</p>{charts}{tables_html}
<section><h2>Machine</h2>{machine}</section>
<section><h2>JSON</h2><pre>{html.escape(json.dumps(document, indent=2))}</pre></section>
</body></html>"""
    path.write_text(page, encoding="utf-8")
    return path

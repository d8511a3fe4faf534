"""Saved benchmark results: the Benchmarks page, one HTML report, and the Lab page's trade-off charts."""

from __future__ import annotations

import logging

from django.http import Http404, HttpResponse
from django.shortcuts import render
from django.utils.text import slugify

from dashboard.pages import lab_charts

from ..bench import documents as bench_documents
from .auth import login_required

log = logging.getLogger("dashboard.views")


# -- benchmarks ------------------------------------------------------------------------------------
@login_required
def benchmark_list(request):
    """Saved benchmark reports (``python manage.py bench ...`` writes JSON and HTML here)."""
    reports = []
    for path, doc in bench_documents.saved_documents():
        if not isinstance(doc, dict):
            continue
        reports.append(
            {
                "name": path.stem,
                "kind": bench_documents.kind_of(doc) or path.stem.split("-")[0],
                "date": (doc.get("machine") or {}).get("date", ""),
                "summary": bench_documents.headline(doc),
                "has_html": path.with_suffix(".html").exists(),
            }
        )
    return render(request, "dashboard/benchmarks.html", {"reports": reports, "folder": bench_documents.results_dir()})


def _lab_section(study, saved) -> dict:
    path, doc = saved or (None, None)
    try:
        shown = lab_charts.section(study, doc)
    except Exception as exc:  # a document from another version of its bench: say so, draw the others
        log.warning("lab document %s not drawn: %r", path, exc)
        shown = {**lab_charts.section(study, None), "error": f"{type(exc).__name__}: {exc}"}
    if path is not None:
        machine = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
        shown["document"] = {
            "name": path.stem,
            "file": f"{path.parent.name}/{path.name}",
            "date": machine.get("date", ""),
            "machine": ", ".join(str(machine[key]) for key in ("cpu", "model", "compute_profile") if machine.get(key)),
            # Served by benchmark_report, whose address takes a slug.
            "has_html": path.with_suffix(".html").exists() and slugify(path.stem) == path.stem,
        }
    return shown


@login_required
def lab_page(request):
    """The lab strategies' trade-offs (approximate: lab), from their newest saved bench documents."""
    found = bench_documents.newest(study.kind for study in lab_charts.STUDIES)
    sections = [_lab_section(study, found.get(study.kind)) for study in lab_charts.STUDIES]
    figures = {figure["id"]: figure["figure"] for shown in sections for figure in shown["figures"]}
    return render(
        request,
        "dashboard/lab.html",
        {"sections": sections, "note": lab_charts.NOTE, "chart_data": {"figures": figures}},
    )


@login_required
def benchmark_report(request, name):
    """One saved HTML report (self-contained: plotly.js inline)."""
    folder = bench_documents.results_dir()
    candidates = {path.stem: path for path in folder.glob("*.html")} if folder.is_dir() else {}
    if name not in candidates:  # only files the folder lists: no path tricks
        raise Http404("no such report")
    response = HttpResponse(candidates[name].read_bytes(), content_type="text/html; charset=utf-8")
    response["Content-Security-Policy"] = (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"
    )
    response["X-Frame-Options"] = "SAMEORIGIN"
    return response

"""Saved benchmark documents, read back for the Benchmarks and Lab pages.

A document says what it is in its ``bench`` field. Documents saved before they did are mapped
once, here (``_LEGACY_KINDS``), from the fields only that benchmark wrote; nothing else guesses.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

from django.conf import settings

from . import BENCHMARKS, get
from .runner import RESULTS_DIR

log = logging.getLogger(__name__)

# Older documents (no "bench" field): the bench whose fields they hold, first match wins.
_LEGACY_KINDS = (
    ("load", ("lost", "devices")),
    ("cases", ("ttft_ratio_full_to_cold",)),
    ("modules", ("accuracy_cached",)),
    ("breakeven", ("presets",)),
    ("peers", ("peers",)),
    ("catalog", ("sweep",)),
    ("scale", ("lengths",)),
    ("lab", ("ks", "table")),
    ("kv", ("kv_types",)),
    ("exact", ("cut_costs",)),
    ("tiers", ("median_ttft_ms", "ratios")),
    ("fleet", ("policies", "boards")),
    ("api", ("first_chunk_ms", "clients")),
)


def results_dir() -> Path:
    """Where benchmarks save what they measure on this machine (not committed; the pages list it)."""
    return Path(settings.BASE_DIR) / RESULTS_DIR


FIGURES_DIR = "docs/figures"  # the documents the docs cite, committed (``manage.py docs --cite``)


def figures_dir() -> Path:
    """The few saved documents the docs cite and ``manage.py docs`` reads (committed)."""
    return Path(settings.BASE_DIR) / FIGURES_DIR


def saved_documents(folder: Path | None = None) -> Iterator[tuple[Path, object]]:
    """(path, document) of every readable JSON file in ``folder`` (``bench-results/``), newest first: by the time
    the document says it was measured (``machine.date``), else its file's time. A clone's files all
    carry the time of the checkout, so the file's time alone put an older run first."""
    folder = results_dir() if folder is None else folder
    found = []
    for path in folder.glob("*.json") if folder.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
            mtime = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        found.append((measured_at(doc) or mtime, mtime, path, doc))
    for _, _, path, doc in sorted(found, key=lambda item: item[:2], reverse=True):
        yield path, doc


def measured_at(doc) -> float | None:
    """When ``doc`` says it was measured (its ``machine.date``, ISO 8601), as a POSIX time; None when it does not say."""
    from datetime import datetime, timezone

    date = (
        (doc.get("machine") or {}).get("date")
        if isinstance(doc, dict) and isinstance(doc.get("machine"), dict)
        else None
    )
    if not isinstance(date, str) or not date:
        return None
    try:
        when = datetime.fromisoformat(date.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def kind_of(doc) -> str | None:
    """The benchmark a document comes from: its ``bench`` field, else (older documents) its fields."""
    if not isinstance(doc, dict):
        return None
    named = doc.get("bench")
    if isinstance(named, str):
        return named
    for kind, fields in _LEGACY_KINDS:
        if all(field in doc for field in fields):
            return kind
    return None


def newest(kinds, folder: Path | None = None) -> dict:
    """The newest saved document of each of ``kinds``: kind -> (path, document)."""
    wanted, found = set(kinds), {}
    for path, doc in saved_documents(folder):
        kind = kind_of(doc)
        if kind in wanted and kind not in found:
            found[kind] = (path, doc)
            if len(found) == len(wanted):
                break
    return found


def headline(doc) -> str:
    """One line about ``doc`` for the Benchmarks page ("" when its benchmark cannot say)."""
    kind = kind_of(doc)
    if kind not in BENCHMARKS:
        return ""
    try:
        return get(kind).headline_of(doc)
    except Exception as exc:  # a document of another version of its bench: list it without a line
        log.warning("no headline for a %s document: %r", kind, exc)
        return ""

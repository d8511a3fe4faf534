"""What a cache entry holds, in words: the first words of its token range (a prefix range), or its
schema and module (a schema entry).

An entry's key is a hash; what it covers is known from the run that stored it: ``record_run``
keeps each run's stored entries (name, range, module) in the run's ``breakdown["entries"]``,
and the run keeps its prompt. The control plane re-tokenizes that prompt with the model's
vocabulary (``inference.engine.llama.Vocabulary``: no weights) and reads the range's first tokens.
"""

from __future__ import annotations

import functools
import re
from datetime import timedelta
from typing import Iterable

from django.conf import settings

from dashboard.models import CacheEntry, InferenceRun
from inference.engine.llama import Vocabulary
from inference.engine.model_file import ModelNotFound, resolve_model

PREVIEW_TOKENS = 12  # tokens of a range shown
NEAR = timedelta(seconds=10)  # a run and the entries it stored are recorded in one transaction
SCHEMA_NAME = re.compile(r"""<prompt\b[^>]*?\bschema\s*=\s*["']([^"']+)["']""")


def stored_entries(uploaded) -> list[dict]:
    """A run's stored entries as its record keeps them (``StoredEntry`` messages or dicts)."""
    rows = []
    for entry in uploaded or []:
        data = entry if isinstance(entry, dict) else entry.dump()
        rows.append({"name": data["name"], "start": data["start"], "end": data["end"], "piece": data.get("piece", "")})
    return rows


@functools.lru_cache(maxsize=2)
def _vocabulary(model_path: str):
    return Vocabulary.load(resolve_model(model_path or None))


def range_words(prompt: str, start: int, end: int, *, special: bool = False, vocabulary=None, answer: str = "") -> str:
    """The first words of tokens [start, end) of ``prompt`` ("…" around when cut); a range past the
    prompt (a chat's next turn, prepared after the answer) reads on into the ``answer``."""
    vocabulary = vocabulary or _vocabulary(settings.EDGECACHE_MODEL)
    tokens = vocabulary.tokenize(prompt, add_bos=True, special=special)
    if answer and start >= len(tokens) - 1:
        tokens = vocabulary.tokenize(prompt + answer, add_bos=True, special=special)
    shown = tokens[start : min(end, start + PREVIEW_TOKENS)]
    if not shown:
        return ""
    text = " ".join(vocabulary.detokenize(shown).split())
    return ("…" if start > 1 else "") + text + ("…" if end > start + PREVIEW_TOKENS else "")


def describe(prompt: str, stored: dict, *, special: bool = False, vocabulary=None, answer: str = "") -> str:
    if stored.get("piece"):
        schema = SCHEMA_NAME.search(prompt or "")
        return f"schema {schema.group(1) if schema else '?'}, {stored['piece']}"
    return range_words(prompt, stored["start"], stored["end"], special=special, vocabulary=vocabulary, answer=answer)


def _storing_runs(entries: list[CacheEntry]) -> dict[str, tuple[InferenceRun, dict]]:
    """{entry key: (the newest run within NEAR of the entry that stored it, its stored record)}.
    Entries whose windows overlap are looked up in one query (the Cache page's newest entries
    mostly do): a query per entry read each run around it again, hundreds of runs' breakdowns
    decoded per page under load."""
    wanted = {entry.key: entry for entry in entries}
    spans: list[list] = []
    for entry in sorted(entries, key=lambda entry: entry.created):
        low, high = entry.created - NEAR, entry.created + NEAR
        if spans and low <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], high)
        else:
            spans.append([low, high])
    found: dict[str, tuple[InferenceRun, dict]] = {}
    for low, high in spans:
        for run in (
            InferenceRun.objects.filter(created__range=(low, high))
            .only("prompt", "text", "breakdown", "source", "created")
            .order_by("-created")
        ):
            for stored in (run.breakdown or {}).get("entries", {}).get("stored", []):
                name = stored.get("name") if isinstance(stored, dict) else None
                entry = wanted.get(name) if isinstance(name, str) else None
                if entry is not None and name not in found and abs(run.created - entry.created) <= NEAR:
                    found[name] = (run, stored)
    return found


def previews(entries: Iterable[CacheEntry]) -> dict[str, str]:
    """{entry key: what it holds} for the entries whose storing run is known ("" otherwise)."""
    entries = list(entries)
    storing = _storing_runs(entries)
    found = {}
    for entry in entries:
        match = storing.get(entry.key)
        if match is None:
            found[entry.key] = ""
            continue
        run, stored = match
        try:
            # A chat's prompt (the API's, the Run page's) holds its template's control tokens.
            found[entry.key] = describe(run.prompt, stored, special=run.source in ("api", "chat"), answer=run.text)
        except (ModelNotFound, OSError, RuntimeError, ValueError):  # no model file here: no words shown
            found[entry.key] = ""
    return found

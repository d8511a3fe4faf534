"""What a cache entry holds, in words: the first words of its token range (a prefix range), or its
schema and module (a schema entry).

An entry's key is a hash; what it covers is known from the run that stored it: ``record_run``
keeps each run's stored entries (name, range, module) in the run's ``breakdown["entries"]``,
and the run keeps its prompt. The control plane re-tokenizes that prompt with the model's
vocabulary (``inference.engine.Vocabulary``: no weights) and reads the range's first tokens.
"""

from __future__ import annotations

import functools
import re
from datetime import timedelta
from typing import Iterable

from django.conf import settings

from cachebox.models import CacheEntry
from inference.model_file import ModelNotFound

from .models import InferenceRun

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
    from inference.engine import Vocabulary
    from inference.model_file import resolve_model

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


def _storing_run(entry: CacheEntry) -> tuple[InferenceRun, dict] | None:
    runs = InferenceRun.objects.filter(created__range=(entry.created - NEAR, entry.created + NEAR)).only("prompt", "text", "breakdown", "source")
    for run in runs.order_by("-created"):
        for stored in (run.breakdown or {}).get("entries", {}).get("stored", []):
            if stored.get("name") == entry.key:
                return run, stored
    return None


def previews(entries: Iterable[CacheEntry]) -> dict[str, str]:
    """{entry key: what it holds} for the entries whose storing run is known ("" otherwise)."""
    found = {}
    for entry in entries:
        match = _storing_run(entry)
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

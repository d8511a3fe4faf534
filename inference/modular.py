"""Serving PML prompts from cached prompt modules (Prompt Cache, sections 3.3-3.4).

Each module's state is encoded once at its schema positions (after the BOS token, which
every prompt starts with and which gives attention a sink), stored in the cache box
under a key of model, namespace, schema version and module path, and announced to
every board's catalog. A prompt is served by loading its modules' states into the main
sequence in position order, computing parameter values (with everything before them as
context) and the prompt's own text, then generating. llama.cpp requires a non-empty
sequence to continue at its last position + 1, so text goes right after the last cell
(as the paper places text after the module it follows); a module that would overlap text
placed before it is shifted right (RoPE re-rotation), and gaps inside a module are made
the same way when it is encoded.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from cachebox.entry import HEADER_PEEK_BYTES, EntryHeader, encode_entry, open_entries, state_checksum
from cachebox.errors import CacheBoxUnavailable, EntryError
from cachebox.keys import check_namespace, module_key, module_key_name, tokens_digest
from cachebox.signing import Keychain, KeyRing, UnknownKey
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry

from .breakdown import Breakdown
from .engine import CONTEXT_SEQ, MAIN_SEQ, WORK_SEQ, Engine, EngineError, Vocabulary
from .modules import ModulePiece, Placement, Run, SchemaLayout, TextPiece, all_pieces, lay_out, piece_runs, plan_prompt
from .pipeline import PromptError, RunResult, decode_answer, ms_since, reject_entry, share_entries, signing_ring
from .pml import PMLError, Schema, parse_prompt, parse_schema
from .sampling import SamplingParams, choose

log = logging.getLogger(__name__)

_SENTINEL = "\u2063EDGECACHE\u2063"


class EngineTokenizer:
    """The model's tokenizer and chat template, as PML layout needs them (an Engine or a Vocabulary)."""

    def __init__(self, engine: Vocabulary):
        self.engine = engine
        self.bos = engine.bos
        self.placeholder = engine.tokenize(" ", add_bos=False)[-1]  # "white space does not change the meaning"

    def text(self, text: str) -> list[int]:
        return self.engine.tokenize(text, add_bos=False) if text else []

    def special(self, text: str) -> list[int]:
        return self.engine.tokenize(text, add_bos=False, special=True) if text else []

    @functools.lru_cache(maxsize=8)
    def wrappers(self, role: str) -> tuple[str, str]:
        for probe in (role, "user"):  # a template without a system role: a user turn stands in
            rendered = self.engine.render_chat([(probe, _SENTINEL)], False)
            if rendered and _SENTINEL in rendered:
                prefix, suffix = rendered.split(_SENTINEL, 1)
                return prefix, suffix
        return f"{role}: ", "\n"

    @functools.lru_cache(maxsize=1)
    def generation_prefix(self) -> str:
        closed = self.engine.render_chat([("user", _SENTINEL)], False) or ""
        opened = self.engine.render_chat([("user", _SENTINEL)], True) or ""
        return opened[len(closed):] if opened.startswith(closed) else ""


@dataclass
class ModularResult(RunResult):
    modules_hit: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**super().as_dict(), "modules_hit": self.modules_hit}


class ModularInference:
    """Prompt Cache on one engine, with module states shared through one cache box."""

    def __init__(
        self,
        engine: Engine,
        store: CacheBox | None,
        catalogs: CatalogRegistry | None,
        *,
        device: str = "",
        namespace: str = "default",
        entry_ttl: int | None = None,
        max_entry_bytes: int = 64 * 1024 * 1024,
        compact: bool | str = "auto",
        keys: Keychain | None = None,
    ):
        self.keys = keys  # signing keys: no ring for a namespace, no cache for it
        self.engine = engine
        self.compact = compact  # True, False, or "auto": only past the model's sliding window
        self.store = store
        self.catalogs = catalogs
        self.device = device
        self.namespace = check_namespace(namespace)
        self.entry_ttl = entry_ttl
        self.max_entry_bytes = max_entry_bytes
        self.tokenizer = EngineTokenizer(engine)
        self._layouts: dict[str, tuple[Schema, SchemaLayout]] = {}

    # -- schemas -------------------------------------------------------------------------------
    def load_schema(self, source: str) -> tuple[Schema, SchemaLayout]:
        """Parse and lay out a schema (remembered by its digest). Raises PMLError."""
        schema = parse_schema(source)
        cached = self._layouts.get(schema.digest)
        if cached is None:
            layout = lay_out(schema, self.tokenizer)
            if layout.positions >= self.engine.n_ctx:
                raise PMLError(f"schema {schema.name!r} spans {layout.positions} positions; the context holds {self.engine.n_ctx}")
            cached = self._layouts[schema.digest] = (schema, layout)
        return cached

    def key_name(self, layout: SchemaLayout, namespace: str, piece: str) -> tuple[bytes, str]:
        key = module_key(self.engine.fingerprint, namespace, layout.digest, piece)
        return key, module_key_name(namespace, self.engine.fingerprint, layout.digest, key)

    # -- encoding ----------------------------------------------------------------------------------
    def _runs(self, layout: SchemaLayout, piece: ModulePiece) -> list[Run]:
        return [run for run, _ in piece_runs(layout, piece)]

    def _digest(self, layout: SchemaLayout, piece: ModulePiece) -> str:
        flat = []
        for run in self._runs(layout, piece):
            flat += [run.start, len(run.tokens), *run.tokens]
        return tokens_digest(flat)

    def encode(self, layout: SchemaLayout, piece: ModulePiece) -> bytes:
        """Prefill one module (or scaffold) alone, after BOS; returns its state at schema positions.

        Runs are prefilled back to back (a scaffold's members attend to each other) and only
        then moved to their schema positions: prefilling at far positions would let
        llama.cpp reuse the sliding-window cells of the earlier runs, which it sees as out
        of reach. One token in a spare sequence then makes llama.cpp apply the moves
        (RoPE re-rotation) before the state is copied out.
        """
        engine = self.engine
        runs = self._runs(layout, piece)
        engine.remove(WORK_SEQ)
        bos = self.tokenizer.bos
        try:
            position = 0
            if bos is not None and runs[0].start > 0:
                engine.prefill([bos], 0, seq=WORK_SEQ)  # attention sink; not exported
                position = 1
            moves = []
            for run in runs:
                start = run.start if position == 0 else position
                engine.prefill(run.tokens, start, seq=WORK_SEQ)
                if start != run.start:
                    moves.append((start, start + len(run.tokens), run.start - start))
                position = start + len(run.tokens)
            for p0, p1, delta in reversed(moves):  # the last run first: targets never overlap sources
                engine.shift(WORK_SEQ, p0, p1, delta)
            if moves:
                engine.remove(CONTEXT_SEQ)
                engine.prefill([runs[0].tokens[0]], 0, seq=CONTEXT_SEQ)  # applies the pending shifts
                engine.remove(CONTEXT_SEQ)
            return engine.export_range(runs[0].start, runs[-1].end, seq=WORK_SEQ)
        finally:
            engine.remove(WORK_SEQ)

    def encode_schema(self, source: str, *, namespace: str | None = None, progress=None, force: bool = False) -> dict:
        """Encode every module and scaffold of a schema into the cache box (skips those already there)."""
        namespace = check_namespace(namespace or self.namespace)
        ring = signing_ring(self.keys, namespace, self.device)
        if ring is None:
            raise ValueError(f"this board holds no signing key for namespace {namespace!r}: enroll it (rotate its token) or pick its namespace")
        schema, layout = self.load_schema(source)
        pieces = all_pieces(layout)
        stored, skipped, total_bytes = [], [], 0
        with self.engine.lock:
            for index, piece in enumerate(pieces):
                key, name = self.key_name(layout, namespace, piece.key_name)
                if not force and self.store.redis.exists(name):
                    skipped.append(piece.key_name)
                else:
                    blob = self._entry(layout, namespace, piece, self.encode(layout, piece), ring)
                    self.store.put_entries([(name, blob)], ttl=self.entry_ttl)
                    self.catalogs.get(namespace).announce([key])
                    stored.append(
                        {"name": name, "namespace": namespace, "model": self.engine.fingerprint, "piece": piece.key_name, "bytes": len(blob), **_span(layout, piece)}
                    )
                    total_bytes += len(blob)
                if progress:
                    progress(index + 1, len(pieces), piece.key_name)
        return {"schema": schema.name, "digest": schema.digest, "stored": stored, "skipped": skipped, "bytes": total_bytes}

    def _entry(self, layout: SchemaLayout, namespace: str, piece: ModulePiece, state: bytes, ring: KeyRing) -> bytes:
        span = _span(layout, piece)
        header = EntryHeader(
            fingerprint=self.engine.fingerprint,
            namespace=namespace,
            start=span["start"],
            end=span["end"],
            tokens_digest=self._digest(layout, piece),
            state_bytes=len(state),
            checksum=state_checksum(state),
            device=self.device,
        )
        return encode_entry(header, state, ring)

    # -- serving -----------------------------------------------------------------------------------
    def run(
        self,
        schema_source: str,
        prompt_source: str,
        *,
        max_tokens: int = 16,
        sampling: SamplingParams = SamplingParams(),
        use_cache: bool = True,
        namespace: str | None = None,
    ) -> ModularResult:
        if max_tokens < 1:
            raise PromptError("max_tokens must be at least 1")
        namespace = check_namespace(namespace or self.namespace)
        engine = self.engine
        caching = use_cache and self.store is not None and self.catalogs is not None
        ring = signing_ring(self.keys, namespace, self.device) if caching else None
        with engine.lock:
            breakdown = Breakdown(cachebox="ok" if caching else "off", decision="modules" if caching else "no-cache")
            if caching and ring is None:
                caching = False
                breakdown.cachebox, breakdown.decision = "no-key", "no-signing-key"
            started = time.perf_counter()
            mark = started
            schema, layout = self.load_schema(schema_source)
            plan = plan_prompt(parse_prompt(prompt_source, schema), layout, self.tokenizer)
            breakdown.token_ms = ms_since(mark)
            module_pieces = [piece for piece in plan.pieces if isinstance(piece, ModulePiece)]
            total = sum(layout.modules[m].token_count for piece in module_pieces for m in piece.members)
            total += sum(len(piece.tokens) for piece in plan.pieces if isinstance(piece, TextPiece))
            if total + max_tokens > engine.n_ctx:
                raise PromptError(f"the prompt has {total} tokens and {max_tokens} more were asked for, but the context holds {engine.n_ctx}")

            cached: dict[str, tuple[bytes, int]] = {}
            names: dict[str, tuple[bytes, str]] = {}
            if caching:
                cached = self._fetch(layout, namespace, module_pieces, names, breakdown, ring)

            engine.clear()
            placement = Placement(compact=self._should_compact(layout, plan))
            fresh: list[tuple[ModulePiece, bytes]] = []
            logits, last_token, last_position, matched, cells = None, None, -1, 0, 0
            for index, piece in enumerate(plan.pieces):
                is_last = index == len(plan.pieces) - 1
                if isinstance(piece, TextPiece):
                    mark = time.perf_counter()
                    position = placement.text(len(piece.tokens))
                    out = engine.prefill(piece.tokens, position, logits_at={position + len(piece.tokens) - 1} if is_last else frozenset())
                    breakdown.prefill_ms += ms_since(mark)
                    logits = out.get(position + len(piece.tokens) - 1)
                    last_token, last_position = piece.tokens[-1], position + len(piece.tokens) - 1
                    cells += len(piece.tokens)
                    continue
                hit = piece.key_name in cached
                mark = time.perf_counter()
                if hit:
                    blob, offset = cached[piece.key_name]
                else:
                    blob, offset = self.encode(layout, piece), 0
                    fresh.append((piece, blob))
                if hit:
                    breakdown.restore_ms += ms_since(mark)
                    matched += sum(layout.modules[m].token_count for m in piece.members)
                else:
                    breakdown.prefill_ms += ms_since(mark)
                mark = time.perf_counter()
                runs = self._runs(layout, piece)
                shift = placement.module([(run.start, run.end) for run in runs])
                last_position, last_token = self._place_module(layout, piece, blob, offset, shift)
                cells += sum(layout.modules[m].token_count for m in piece.members)
                if hit:
                    breakdown.restore_ms += ms_since(mark)
                else:
                    breakdown.prefill_ms += ms_since(mark)
                if piece.args:
                    mark = time.perf_counter()
                    cells += self._fill_args(layout, piece, shift)
                    breakdown.prefill_ms += ms_since(mark)
                logits = None
            if logits is None:
                # The prompt ends inside a module: recompute its last token for the logits.
                mark = time.perf_counter()
                engine.remove(MAIN_SEQ, last_position, -1)
                logits = engine.prefill([last_token], last_position, logits_at={last_position})[last_position]
                breakdown.prefill_ms += ms_since(mark)
            breakdown.redis_ms = breakdown.fetch_ms + breakdown.restore_ms
            breakdown.prompt_tokens = cells
            breakdown.matched_tokens = matched
            hits = [piece.key_name for piece in module_pieces if piece.key_name in cached]
            breakdown.case = "miss" if not hits else ("full" if len(hits) == len(module_pieces) else "partial")

            rng = np.random.default_rng(sampling.seed)
            mark = time.perf_counter()
            token = choose(logits, sampling, rng)
            breakdown.sample_ms = ms_since(mark)
            breakdown.ttft_ms = ms_since(started)
            position = engine.positions(MAIN_SEQ)[1] + 1
            generated, text = decode_answer(engine, token, position, max_tokens, sampling, rng, breakdown, started)

            uploaded = []
            if caching and fresh and breakdown.cachebox == "ok":
                uploaded = self._upload(layout, namespace, fresh, names, breakdown, ring)
            breakdown.state_bytes = breakdown.fetched_bytes + breakdown.uploaded_bytes
            fetched = [names[piece][1] for piece in hits if piece in names]
            return ModularResult(text, generated, breakdown, fetched=fetched, uploaded=uploaded, modules_hit=hits)

    def _should_compact(self, layout: SchemaLayout, plan) -> bool:
        """Close gaps only when they would push the prompt past the sliding window.

        Moving a module costs a RoPE re-rotation of the whole cache at the next decode
        (about 70 ms here), so a prompt that fits in the window keeps its schema positions.
        """
        if self.compact != "auto":
            return bool(self.compact)
        if not self.engine.n_swa:
            return False
        dry = Placement(compact=False)
        for piece in plan.pieces:
            if isinstance(piece, TextPiece):
                dry.text(len(piece.tokens))
            else:
                dry.module([(run.start, run.end) for run in self._runs(layout, piece)])
        return dry.cursor > self.engine.n_swa

    def _fetch(self, layout, namespace, pieces, names, breakdown, ring: KeyRing) -> dict[str, tuple[bytes, int]]:
        """States of the pieces the catalog says the cache box may hold, verified (one round trip)."""
        catalog = self.catalogs.get(namespace).catalog
        mark = time.perf_counter()
        for piece in pieces:
            names[piece.key_name] = self.key_name(layout, namespace, piece.key_name)
        maybe = catalog.lookup([names[piece.key_name][0] for piece in pieces])
        breakdown.bloom_ms = ms_since(mark)
        wanted = [piece for piece, hit in zip(pieces, maybe) if hit]
        if not wanted:
            return {}
        mark = time.perf_counter()
        try:
            # Sizes first: an entry over the limit is refused before its bytes are downloaded.
            sizes = self.store.sizes([names[piece.key_name][1] for piece in wanted])
            limit = self.max_entry_bytes + HEADER_PEEK_BYTES
            for piece, size in zip(wanted, sizes):
                if size > limit:
                    breakdown.rejected_entries += 1
                    reject_entry(self.store, names[piece.key_name][1], EntryError(f"entry is {size} bytes, over the {limit}-byte limit"), self.device)
            wanted = [piece for piece, size in zip(wanted, sizes) if size <= limit]
            blobs = self.store.read_entries([names[piece.key_name][1] for piece in wanted])
        except CacheBoxUnavailable as exc:
            log.warning("cache box unavailable, encoding modules locally: %s", exc)
            breakdown.cachebox = "unavailable"
            breakdown.fetch_ms = ms_since(mark)
            return {}
        found = {}
        checking = time.perf_counter()
        opened = open_entries([blob or b"" for blob in blobs], ring, self.max_entry_bytes)
        breakdown.verify_ms = ms_since(checking)
        for piece, blob, result in zip(wanted, blobs, opened):
            name = names[piece.key_name][1]
            if blob is None:
                catalog.record_false_positive()
                breakdown.false_positives += 1
                continue
            try:
                if isinstance(result, EntryError):
                    raise result
                header, offset = result
                span = _span(layout, piece)
                if header.fingerprint != self.engine.fingerprint or header.namespace != namespace:
                    raise EntryError("entry was made for another model or namespace")
                if (header.start, header.end) != (span["start"], span["end"]) or header.tokens_digest != self._digest(layout, piece):
                    raise EntryError("entry does not hold this module's tokens")
            except UnknownKey as exc:
                log.info("skipping module entry %s: %s", name, exc)
                if self.keys is not None:
                    self.keys.refresh()
                continue
            except EntryError as exc:
                breakdown.rejected_entries += 1
                reject_entry(self.store, name, exc, self.device)
                continue
            catalog.record_true_hit()
            breakdown.fetched_bytes += len(blob)
            found[piece.key_name] = (blob, offset)
        breakdown.fetch_ms = ms_since(mark)
        return found

    def _place_module(self, layout, piece: ModulePiece, blob: bytes, offset: int, shift: int) -> tuple[int, int]:
        """Load a module's state into the main sequence, moved by ``shift``; returns (last position, last token)."""
        engine = self.engine
        runs = self._runs(layout, piece)
        engine.remove(WORK_SEQ)
        engine.import_range(blob, offset, seq=WORK_SEQ)
        first, last = engine.positions(WORK_SEQ)
        # A state longer than a sliding window keeps, in those layers, only the cells its
        # end can see: the first position may come later, the last must be exact.
        if last != runs[-1].end - 1 or not runs[0].start <= first <= last:
            engine.remove(WORK_SEQ)
            raise EngineError(f"module {piece.key_name!r} restored positions {first}..{last}, expected {runs[0].start}..{runs[-1].end - 1}")
        if shift:
            engine.shift(WORK_SEQ, -1, -1, shift)  # RoPE re-rotation at the next decode
        engine.copy_sequence(WORK_SEQ, MAIN_SEQ)
        engine.remove(WORK_SEQ)
        return runs[-1].end - 1 + shift, runs[-1].tokens[-1]

    def _fill_args(self, layout: SchemaLayout, piece: ModulePiece, shift: int) -> int:
        """Put parameter values where their placeholders were, computed with what precedes them.

        Returns the change in the number of cells (values are usually shorter than ``len``).
        """
        engine = self.engine
        moved = piece_runs(layout, piece)
        change = 0
        for start, length, tokens in sorted(piece.args.values()):
            start += shift + next(delta for run, delta in moved if run.start - delta <= start < run.end - delta)
            engine.remove(MAIN_SEQ, start, start + length)
            change += len(tokens) - length
            if not tokens:
                continue
            engine.remove(CONTEXT_SEQ)
            engine.copy_sequence(MAIN_SEQ, CONTEXT_SEQ, -1, start)
            engine.prefill(tokens, start, seq=CONTEXT_SEQ)
            engine.copy_sequence(CONTEXT_SEQ, MAIN_SEQ, start, start + len(tokens))
            engine.remove(CONTEXT_SEQ)
        return change

    def _upload(self, layout, namespace, fresh, names, breakdown, ring: KeyRing) -> list[dict]:
        mark = time.perf_counter()
        items, keys, stored = [], [], []
        for piece, state in fresh:
            key, name = names.get(piece.key_name) or self.key_name(layout, namespace, piece.key_name)
            blob = self._entry(layout, namespace, piece, state, ring)
            if len(blob) > self.max_entry_bytes:
                continue
            items.append((name, blob))
            keys.append(key)
            stored.append({"name": name, "namespace": namespace, "model": self.engine.fingerprint, "bytes": len(blob), **_span(layout, piece)})
        if not share_entries(self.store, self.catalogs, namespace, items, keys, self.entry_ttl, breakdown):
            stored = []
        breakdown.upload_ms = ms_since(mark)
        return stored


def _span(layout: SchemaLayout, piece: ModulePiece) -> dict:
    runs = [run for run, _ in piece_runs(layout, piece)]
    return {"start": runs[0].start, "end": runs[-1].end}

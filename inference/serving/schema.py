"""Schema serving: PML prompts from cached prompt modules (Prompt Cache, sections 3.3-3.4).

Each module's state is encoded once at its schema positions (after the BOS token, which
every prompt starts with and which gives attention a sink), stored in the cache box
under a key of namespace, model, schema version and module path, and announced to
every board's catalog. A prompt is served by loading its modules' states into the main
sequence in position order, computing parameter values (with everything before them as
context) and the prompt's own text, then generating. llama.cpp requires a non-empty
sequence to continue at its last position + 1, so text goes right after the last cell
(as the paper places text after the module it follows); a module that would overlap text
placed before it is shifted right (RoPE re-rotation), and gaps inside a module are made
the same way when it is encoded. A module marked ``cache="false"`` is encoded the same way
for every request and never leaves the board; a module holding only nested modules has no
state at all.

Fetching, checking, restoring and storing module entries is the exchange's work
(``inference.serving.exchange``), the same code prefix serving uses. Approximate by design
(Prompt Cache's masking): a schema run is not expected to equal a full prefill, but a
module fetched is the module encoded, byte for byte.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

from cachebox.entry import EntryHeader
from cachebox.errors import CacheBoxUnavailable, EntryError
from cachebox.keys import check_namespace, tokens_digest
from inference.engine.llama import CONTEXT_SEQ, MAIN_SEQ, WORK_SEQ, Engine, Vocabulary
from inference.engine.model_file import resolve_model
from inference.serving.breakdown import Breakdown, CacheBoxState, Decision, Tier
from inference.serving.exchange import EntryRef, Exchange, ExchangeSession, Fetched, module_ref, run_session
from inference.serving.pml import PMLError, PMLSchema, parse_prompt, parse_schema
from inference.serving.pml_layout import (
    ModulePiece,
    Placement,
    Plan,
    Run,
    SchemaLayout,
    TextPiece,
    all_pieces,
    lay_out,
    piece_runs,
    plan_prompt,
)
from inference.serving.run import FirstToken, RunResult, RunState, ServingStrategy, ms_since

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
        return opened[len(closed) :] if opened.startswith(closed) else ""


@functools.lru_cache(maxsize=2)
def _vocabulary_tokenizer(model_path: str) -> EngineTokenizer:
    return EngineTokenizer(Vocabulary.load(resolve_model(model_path or None)))


def layout_for(source: str, model_path: str = "", n_ctx: int | None = None) -> SchemaLayout:
    """Parse and lay out a schema with a model's tokenizer (its vocabulary only, no weights).

    With ``n_ctx``, a layout that cannot fit the context is refused with the numbers: a schema
    is served at its own positions, so one past the context could never be used. Raises PMLError.
    """
    schema = parse_schema(source)
    layout = lay_out(schema, _vocabulary_tokenizer(model_path))
    if n_ctx is not None and layout.positions >= n_ctx:
        raise PMLError(
            f"schema {schema.name!r} spans {layout.positions} positions, but the model's context holds {n_ctx} "
            "(EDGECACHE_N_CTX): drop or shorten modules, or raise the context on every board"
        )
    return layout


@dataclass
class _SchemaRun:
    """One schema run between the skeleton's steps."""

    namespace: str
    layout: SchemaLayout
    plan: Plan
    session: ExchangeSession | None = None
    refs: dict[str, EntryRef] = field(default_factory=dict)
    fresh: list[tuple[ModulePiece, bytes]] = field(default_factory=list)  # encoded here, to store
    hits: list[str] = field(default_factory=list)  # modules restored from the cache box

    @property
    def prompt_tokens(self) -> int:
        """What the prompt fills of the context: its modules' tokens and its texts'."""
        modules = sum(
            self.layout.modules[m].token_count
            for piece in self.plan.pieces
            if isinstance(piece, ModulePiece)
            for m in piece.members
        )
        return modules + sum(len(piece.tokens) for piece in self.plan.pieces if isinstance(piece, TextPiece))


class SchemaServing(ServingStrategy[_SchemaRun]):
    """Prompt Cache on one engine, with module states shared through the exchange."""

    def __init__(
        self, engine: Engine, exchange: Exchange | None, *, namespace: str = "default", compact: bool | str = "auto"
    ):
        self.engine = engine
        self.exchange = exchange
        self.compact = compact  # True, False, or "auto": only past the model's sliding window
        self.namespace = check_namespace(namespace)
        self.tokenizer = EngineTokenizer(engine)
        self._layouts: dict[str, tuple[PMLSchema, SchemaLayout]] = {}

    # -- schemas -------------------------------------------------------------------------------
    def load_schema(self, source: str) -> tuple[PMLSchema, SchemaLayout]:
        """Parse and lay out a schema (remembered by its digest). Raises PMLError."""
        schema = parse_schema(source)
        cached = self._layouts.get(schema.digest)
        if cached is None:
            layout = lay_out(schema, self.tokenizer)
            if layout.positions >= self.engine.n_ctx:
                raise PMLError(
                    f"schema {schema.name!r} spans {layout.positions} positions; the context holds {self.engine.n_ctx}"
                )
            cached = self._layouts[schema.digest] = (schema, layout)
        return cached

    def ref(self, layout: SchemaLayout, namespace: str, piece: ModulePiece) -> EntryRef:
        """The entry of one module or scaffold, at its schema positions."""
        runs = self._runs(layout, piece)
        return module_ref(
            namespace, self.engine.fingerprint, layout.digest, piece.key_name, runs[0].start, runs[-1].end
        )

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
        """Encode every module and scaffold of a schema into the cache box (skips those already there).

        Raises ValueError without a signing key, CacheBoxUnavailable when the cache box fails.
        """
        namespace = check_namespace(namespace or self.namespace)
        if self.exchange is None or not self.exchange.connected:
            raise CacheBoxUnavailable("this board has no cache box to encode into")
        breakdown = Breakdown()
        session = self.exchange.session(namespace, breakdown)
        if session is None:
            raise ValueError(
                f"this board holds no signing key for namespace {namespace!r}: enroll it (rotate its token) or pick its namespace"
            )
        schema, layout = self.load_schema(source)
        pieces = all_pieces(layout)
        refs = [self.ref(layout, namespace, piece) for piece in pieces]
        present = [False] * len(pieces) if force else session.exists(refs)
        stored, skipped = [], []
        with self.engine.lock:
            for index, (piece, ref, there) in enumerate(zip(pieces, refs, present)):
                if there:
                    skipped.append(piece.key_name)
                else:
                    blob = session.seal(ref, self.encode(layout, piece), self._digest(layout, piece))
                    stored += session.share([(ref, blob)], chain=False)
                    if breakdown.cachebox != CacheBoxState.OK:
                        raise CacheBoxUnavailable(f"the cache box failed while storing {piece.key_name!r}")
                if progress:
                    progress(index + 1, len(pieces), piece.key_name)
        return {
            "schema": schema.name,
            "digest": schema.digest,
            "stored": stored,
            "skipped": skipped,
            "bytes": sum(entry.bytes for entry in stored),
        }

    # -- serving: the skeleton's steps -------------------------------------------------------------
    def new_breakdown(self) -> Breakdown:
        return Breakdown(decision=Decision.MODULES)

    def prepare(self, state: RunState) -> _SchemaRun:
        """The schema laid out and the prompt planned over it (PMLError when either is wrong)."""
        namespace = check_namespace(state.options.namespace or self.namespace)
        schema, layout = self.load_schema(state.prompt.schema)
        plan = plan_prompt(parse_prompt(state.prompt.pml, schema), layout, self.tokenizer)
        return _SchemaRun(namespace, layout, plan)

    def first_token(self, state: RunState, prompt: _SchemaRun) -> FirstToken:
        """Each module from the cache box (or encoded here), each text computed, in position order."""
        engine, breakdown, layout, plan = self.engine, state.breakdown, prompt.layout, prompt.plan
        session = prompt.session = run_session(self.exchange, prompt.namespace, breakdown, state.options.use_cache)
        module_pieces = [piece for piece in plan.pieces if isinstance(piece, ModulePiece)]
        # A cache="false" module has no ref: never looked up, fetched or stored.
        refs = prompt.refs = {
            piece.key_name: self.ref(layout, prompt.namespace, piece) for piece in module_pieces if piece.cache
        }
        cached: dict[str, Fetched] = {}
        if session is not None and refs:
            cached = self._fetch(session, layout, [piece for piece in module_pieces if piece.cache], refs)

        engine.clear()
        placement = Placement(compact=self._should_compact(layout, plan))
        logits, last_token, last_position, matched, cells = None, None, -1, 0, 0
        for index, piece in enumerate(plan.pieces):
            is_last = index == len(plan.pieces) - 1
            if isinstance(piece, TextPiece):
                mark = time.perf_counter()
                position = placement.text(len(piece.tokens))
                out = engine.prefill(
                    piece.tokens, position, logits_at={position + len(piece.tokens) - 1} if is_last else frozenset()
                )
                breakdown.prefill_ms += ms_since(mark)
                logits = out.get(position + len(piece.tokens) - 1)
                last_token, last_position = piece.tokens[-1], position + len(piece.tokens) - 1
                cells += len(piece.tokens)
                continue
            runs = self._runs(layout, piece)
            shift = placement.module([(run.start, run.end) for run in runs])
            item = cached.get(piece.key_name)
            # The restore times itself (restore_ms): only moving it into the main sequence is added here.
            if item is not None and session.restore(engine, item, WORK_SEQ, range(runs[0].start, runs[-1].end)):
                mark = time.perf_counter()
                self._move_into_main(shift)
                breakdown.restore_ms += ms_since(mark)
                prompt.hits.append(piece.key_name)
                matched += sum(layout.modules[m].token_count for m in piece.members)
            else:  # not cached, refused on restore, or cache="false": encode it here
                mark = time.perf_counter()
                blob = self.encode(layout, piece)
                if piece.cache:
                    prompt.fresh.append((piece, blob))
                engine.remove(WORK_SEQ)
                engine.import_range(blob, 0, seq=WORK_SEQ)
                self._move_into_main(shift)
                breakdown.prefill_ms += ms_since(mark)
            last_position, last_token = runs[-1].end - 1 + shift, runs[-1].tokens[-1]
            cells += sum(layout.modules[m].token_count for m in piece.members)
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
        breakdown.classify(matched, cells)  # by tokens: a run with some modules computed is partial
        breakdown.restored(Tier.CACHEBOX, matched)  # every module restored came from the cache box
        return FirstToken(logits, position=engine.positions(MAIN_SEQ)[1] + 1)

    def finish(self, state: RunState, prompt: _SchemaRun, first: FirstToken, result: RunResult) -> None:
        """After the answer: store the modules encoded here."""
        breakdown, session, refs = state.breakdown, prompt.session, prompt.refs
        if session is not None and prompt.fresh and breakdown.cachebox == CacheBoxState.OK:
            mark = time.perf_counter()
            items = [
                (refs[piece.key_name], session.seal(refs[piece.key_name], state, self._digest(prompt.layout, piece)))
                for piece, state in prompt.fresh
            ]
            result.uploaded = session.share(items, chain=False)
            breakdown.upload_ms = ms_since(mark)
        breakdown.state_bytes = breakdown.fetched_bytes + breakdown.uploaded_bytes
        result.fetched = [refs[piece].name for piece in prompt.hits]
        result.modules_hit = prompt.hits

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

    def _fetch(
        self, session: ExchangeSession, layout: SchemaLayout, pieces: list[ModulePiece], refs: dict[str, EntryRef]
    ) -> dict[str, Fetched]:
        """Verified entries of the pieces the cache box holds: headers (one round trip), then states (one more)."""
        by_name = {refs[piece.key_name].name: piece for piece in pieces}

        def expect(ref: EntryRef, header: EntryHeader) -> None:
            if (header.start, header.end) != (ref.start, ref.end) or header.tokens_digest != self._digest(
                layout, by_name[ref.name]
            ):
                raise EntryError("entry does not hold this module's tokens")

        wanted = session.maybe([refs[piece.key_name] for piece in pieces])
        headers = session.read_headers(wanted, expect)
        wanted = session.within_budget([ref for ref in wanted if ref.name in headers], headers)
        fetched = session.fetch(wanted, expect, chain=False)
        return {item.ref.piece: item for item in fetched}

    def _move_into_main(self, shift: int) -> None:
        """Move the module in the work sequence by ``shift`` and share its cells into the main sequence."""
        engine = self.engine
        if shift:
            engine.shift(WORK_SEQ, -1, -1, shift)  # RoPE re-rotation at the next decode
        engine.copy_sequence(WORK_SEQ, MAIN_SEQ)
        engine.remove(WORK_SEQ)

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

"""Auditing a cache entry on a board: recompute its range cold and compare it bit for bit.

Runs on a board (the control plane only picks the entry and the auditor: ``dashboard.actions.
entry_audits``). Reuse is exact within a model configuration, so an honest entry's state is the
very bytes a cold prefill of its prompt exports for its range, and its stored top logits are the
cold logits of its last position. The auditor reads the entry as any reader does (namespace MAC,
producer signature, state digest: ``cachebox.entry``), prefills the prompt of the run that hit it
cold on the same cuts, and compares. A board that re-sealed another prompt's state under this
prompt's header had to sign it as itself: a mismatch names it.

Exact prefix runs only: a schema module's state or a chat turn a board prepared ahead is reported
``inconclusive`` (nothing of it is compared).
"""

from __future__ import annotations

import hashlib

import numpy as np

from cachebox.entry import decoded_state, open_entry
from cachebox.errors import CacheBoxUnavailable, EntryError
from cachebox.keys import grid_cuts, off_grid, parse_entry_key_name, range_boundaries, tokens_digest
from cachebox.signing import UnknownKey
from inference.contract.messages import AuditRequest
from inference.engine.chat import chat_prompt
from inference.engine.llama import EngineError
from inference.engine.sampling import top_candidates
from inference.serving.exchange import prefix_refs
from inference.serving.run import Prompt, PromptError, text_layout


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def prompt_of(board, request) -> Prompt:
    """The prompt a run request asks the board to answer (a chat's, through the model's template)."""
    if request.is_chat_run:
        return chat_prompt(board.engine, [(message.role, message.content) for message in request.messages]).prompt
    return Prompt(tuple(request.segments))


def audit_entry(board, audit: AuditRequest) -> dict:
    """The verdict on ``audit.entry``: the fields of an ``AuditReport`` (without the board's name).

    ``match``: the entry holds the cold state (and top logits) of its range; ``mismatch``: it does
    not (``producer`` names who signed it); ``refused``: it fails a reader's checks (forged, altered,
    an unknown or quarantined producer); ``gone``: no longer stored; ``inconclusive``: nothing to
    compare (another model, a schema run, a prompt that no longer gives that entry).
    """
    verdict = {"request_id": audit.request_id, "entry": audit.entry}
    run = audit.run
    try:
        namespace, fingerprint, _ = parse_entry_key_name(audit.entry)
    except ValueError as exc:
        return {**verdict, "verdict": "inconclusive", "detail": f"not an entry name: {exc}"[:500]}
    engine, prefix = board.engine, board.prefix
    if fingerprint != engine.fingerprint:
        return {
            **verdict,
            "verdict": "inconclusive",
            "detail": f"entry of model {fingerprint}, this board runs {engine.fingerprint}",
        }
    if run.is_schema_run or run.strategy not in ("", "exact"):
        return {**verdict, "verdict": "inconclusive", "detail": "only exact prefix runs are audited"}
    try:
        prompt = prompt_of(board, run)
        tokens, text_cuts = text_layout(engine, prompt.segments) if prompt.tokens is None else (list(prompt.tokens), ())
    except (PromptError, ValueError, EngineError) as exc:
        return {**verdict, "verdict": "inconclusive", "detail": f"the run's prompt cannot be rebuilt: {exc}"[:500]}
    grid = prefix.chunk_tokens
    extra = tuple(cut for cut in off_grid([*prompt.cuts, *text_cuts], grid) if cut < len(tokens))
    refs = prefix_refs(
        namespace, engine.fingerprint, tokens, range_boundaries(len(tokens), grid, extra), grid=grid, extra=extra
    )
    ref = next((ref for ref in refs if ref.name == audit.entry), None)
    if ref is None:
        return {
            **verdict,
            "verdict": "inconclusive",
            "detail": "the run's prompt gives no entry of that name (a prepared chat turn?)",
        }
    try:
        blob = board.store.read_entries([audit.entry])[0]
    except CacheBoxUnavailable as exc:
        return {**verdict, "verdict": "inconclusive", "detail": f"cache box unavailable: {exc}"[:500]}
    if blob is None:
        return {**verdict, "verdict": "gone", "detail": "the entry is no longer stored"}
    ring = board.keys.ring(namespace) if board.keys is not None else None
    if ring is None:
        return {**verdict, "verdict": "inconclusive", "detail": f"this board holds no key of {namespace!r}"}
    try:
        header, encoded = open_entry(blob, ring, board.exchange.max_entry_bytes)
        state = bytes(decoded_state(header, encoded))
    except UnknownKey as exc:  # a key or producer this board has not received yet: not the entry's fault
        return {**verdict, "verdict": "inconclusive", "detail": str(exc)[:500]}
    except EntryError as exc:
        return {**verdict, "verdict": "refused", "detail": str(exc)[:500]}
    found = {**verdict, "producer": header.producer, "entry_state_sha256": _sha256(state)}
    problems = []
    if header.end != ref.end or header.namespace != namespace or header.fingerprint != engine.fingerprint:
        problems.append(
            f"its header claims [{header.start}, {header.end}) of {header.namespace}, the key is of [.., {ref.end})"
        )
    elif header.tokens_digest != tokens_digest(tokens[header.start : header.end]):
        problems.append("its tokens digest is not the prompt's")
    cold, logits = _cold(engine, tokens, ref.end, header.start, grid, extra)
    found["cold_state_sha256"] = _sha256(cold)
    if cold != state:
        problems.append(
            f"its state ({len(state)} bytes) differs from the cold state of [{header.start}, {header.end}) ({len(cold)} bytes)"
        )
    if header.top_ids is not None and header.top_logits is not None and logits is not None:
        ids, values = top_candidates(logits, len(header.top_ids))
        if not (
            np.array_equal(ids, header.top_ids) and values.tobytes() == np.asarray(header.top_logits, "<f4").tobytes()
        ):
            problems.append("its top logits differ from the cold ones")
    if problems:
        return {**found, "verdict": "mismatch", "detail": "; ".join(problems)[:500]}
    return {**found, "verdict": "match", "detail": f"[{header.start}, {header.end}) equal to the cold run, bit for bit"}


def _cold(
    engine, tokens: list[int], end: int, start: int, grid: int, extra: tuple[int, ...]
) -> tuple[bytes, np.ndarray | None]:
    """The state of ``[start, end)`` and the logits of ``end - 1`` after a cold prefill of
    ``tokens[:end]`` on the run's cuts (the engine's context is forgotten before and after)."""
    exported: list[bytes] = []

    def on_batch(next_position: int) -> None:
        # At once, as a run exports: a later batch would reuse the sliding-window cells.
        if not exported and next_position >= end:
            exported.append(engine.export_range(start, end))

    with engine.lock:
        engine.clear()
        try:
            logits = engine.prefill(
                tokens[:end], 0, logits_at={end - 1}, on_batch=on_batch, cuts=grid_cuts(end, grid, 0, extra)
            )
        finally:
            engine.clear()
    return (exported[0] if exported else b""), logits.get(end - 1)

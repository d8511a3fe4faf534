"""The nearest tier: the board's own context, the prompt part of its last sequence still in the
engine. A prompt that shares a prefix with it keeps the cells up to the last cut both share (the
cold run's batches, so the very bits) and drops the rest: no copy at all. Always the first tier
walked: what of the engine's last sequence stays is decided here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from inference.engine.llama import MAIN_SEQ
from inference.serving.breakdown import Tier as TierLabel
from inference.serving.run import ms_since
from inference.tiers.local import Context

from .base import Computed, Held, TierRun


@dataclass
class _Reusable:
    context: Context
    tokens: int  # leading prompt tokens the context serves exactly
    lookup_ms: float


class ContextTier:
    """What the engine holds after the last run (prompt cells only), for the next one."""

    label = TierLabel.CONTEXT

    def __init__(self, reuse: bool):
        self.reuse = (
            reuse  # False: every run starts from an empty context (a conversation's extension still uses ``held``)
        )
        self.held: Context | None = None  # only a run that completes leaves one

    def lookup(self, run: TierRun, held: Held) -> _Reusable | None:
        """How much of the prompt the context serves; consumed either way. When none, the engine
        is cleared here: the farther tiers restore into an empty sequence."""
        context, self.held = self.held, None
        engine = run.engine
        if not (self.reuse and run.use_cache and context is not None and context.generation == engine.generation):
            engine.clear()
            return None
        mark = time.perf_counter()
        reuse = context.reusable(run.tokens, run.grid, run.extra)
        if reuse == 0:
            engine.clear()
            return None
        return _Reusable(context, reuse, ms_since(mark))

    def restore(self, run: TierRun, found: _Reusable, held: Held) -> Held:
        mark = time.perf_counter()
        run.engine.remove(MAIN_SEQ, found.tokens, -1)  # the rest of the old prompt and its answer's cells
        run.breakdown.local_ms += found.lookup_ms + ms_since(mark)
        run.breakdown.tier = self.label
        full = found.tokens == run.prompt_tokens
        return Held(
            found.tokens,
            found.context.top_ids if full else None,
            found.context.top_logits if full else None,
            used=held.used,
        )

    def keep(self, computed: Computed) -> None:
        """What the engine holds now: the next prompt's context, or a conversation's (extend)."""
        run, held = computed.run, computed.held
        if not run.use_cache:
            return
        stored = (held.top_ids, held.top_logits) if held.top_ids is not None else None
        self.held = Context.after(
            run.tokens, run.engine.claim_main(), computed.logits.get(run.prompt_tokens - 1), stored, run.top, run.extra
        )

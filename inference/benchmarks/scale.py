"""`bench scale`: cold and full-hit TTFT from 128 to 2048 prompt tokens (how each cost grows)."""

from __future__ import annotations

import uuid
from typing import Callable

from .common import median

LENGTHS = (128, 256, 512, 1024, 2048)


def filler(tokens_wanted: int, tokenize) -> str:
    """Unstructured text of about ``tokens_wanted`` tokens (no shared prefix between lengths)."""
    words, text = [], ""
    index = 0
    while True:
        words.append(f"item {index} of the inventory is a {['red', 'green', 'blue', 'grey'][index % 4]} box.")
        text = " ".join(words)
        if len(tokenize(text)) >= tokens_wanted:
            return text
        index += 1


def run_scale(board, *, repeats: int = 3, lengths=LENGTHS, progress: Callable[[], None] | None = None) -> dict:
    rows = []
    for length in lengths:
        if length + 8 > board.engine.n_ctx:
            continue
        text = filler(length, lambda t: board.engine.tokenize(t, add_bos=True))
        cold, hit, state = [], [], 0
        for _ in range(repeats):
            namespace = f"bench-scale-{uuid.uuid4().hex[:10]}"
            try:
                first = board.run(text, max_tokens=1, namespace=namespace)
                second = board.run(text, max_tokens=1, namespace=namespace)
            finally:
                board.store.flush(namespace)
                board.catalogs.forget(namespace)
            assert second.breakdown.case == "full", second.breakdown.case
            cold.append(first.breakdown.ttft_ms)
            hit.append(second.breakdown.ttft_ms)
            state = second.breakdown.fetched_bytes
            tokens = first.breakdown.prompt_tokens
        rows.append(
            {
                "prompt_tokens": tokens,
                "cold_ttft_ms": median(cold),
                "hit_ttft_ms": median(hit),
                "ratio": round(median(hit) / median(cold), 4),
                "state_bytes": state,
                "bytes_per_token": round(state / tokens, 1),
            }
        )
        if progress:
            progress()
    return {"lengths": rows, "repeats": repeats}

"""The timing breakdown of one run: the single record used by the engine, the tasks,
the InferenceRun model and the charts (the paper's table 3 columns and more)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

CASES = ("miss", "partial", "full")
CACHEBOX_STATES = ("ok", "unavailable", "off", "no-key")


@dataclass
class Breakdown:
    # Paper's columns, in milliseconds.
    token_ms: float = 0.0  # Token: tokenize the prompt
    bloom_ms: float = 0.0  # Bloom: look the candidate ranges up in the local catalog
    prefill_ms: float = 0.0  # P-decode: prefill the tokens that were not cached
    redis_ms: float = 0.0  # Redis: fetch + verify + restore the cached ranges (= fetch_ms + restore_ms)
    decode_ms: float = 0.0  # R-decode: decode the response tokens after the first
    sample_ms: float = 0.0  # Sample: choose every response token
    ttft_ms: float = 0.0  # time to first token
    ttlt_ms: float = 0.0  # time to last token
    # Finer parts and the off-path upload.
    fetch_ms: float = 0.0  # network part of redis_ms (headers + state bytes)
    restore_ms: float = 0.0  # llama.cpp part of redis_ms (load state into the context)
    verify_ms: float = 0.0  # part of fetch_ms: signatures and state digests checked
    upload_ms: float = 0.0  # export + upload of new ranges, after the answer
    # What happened.
    prompt_tokens: int = 0
    matched_tokens: int = 0  # prompt tokens restored from the cache box
    generated_tokens: int = 0
    state_bytes: int = 0  # prompt state moved: fetched_bytes + uploaded_bytes
    fetched_bytes: int = 0
    uploaded_bytes: int = 0
    case: str = "miss"  # miss / partial / full
    cachebox: str = "ok"  # ok / unavailable / off / no-key (this board holds no signing key)
    decision: str = ""  # why the run fetched or not: "catalog-miss", "fetch", "policy-skip", "no-cache", ...
    candidate_tokens: int = 0  # the longest cached range the catalog offered
    predicted_fetch_ms: float = 0.0  # the break-even policy's forecast, to compare with redis_ms
    predicted_prefill_ms: float = 0.0  # the prefill a fetch would have saved, forecast
    link: str = ""  # "unshaped" or the emulated link every timing was taken through
    false_positives: int = 0  # catalog "maybe"s the cache box did not hold
    rejected_entries: int = 0  # forged, corrupted or mismatched entries evicted (integrity failures)

    def as_dict(self) -> dict:
        return {name: round(value, 3) if isinstance(value, float) else value for name, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> "Breakdown":
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    # The stacked-bar components of the paper's table 3, in order.
    STACK = ("token_ms", "bloom_ms", "prefill_ms", "redis_ms", "decode_ms", "sample_ms")

"""What an answer card says about its run, in a person's words: right or wrong (an MMLU
question), where a hit's time went (slow only when computing would have been faster), what the policy forecast when it skipped a fetch.

Pure functions of a run's stored fields (its breakdown as the board reported it): no I/O.
"""

from __future__ import annotations

from dashboard import mmlu
from inference.serving.breakdown import Case, Decision, Tier

SLOW_SHARE = 0.5  # a hit's fetch is worth a sentence when it took at least this share of its TTFT
SLOW_MS = 200.0  # ... and at least this long (a 3 ms fetch is never worth a sentence); "slow" only if computing would have been faster


def human_bytes(count) -> str:
    """Bytes as people read them, decimal units as the charts use: 950 B, 18.5 kB, 8.4 MB, 1.2 GB."""
    try:
        value = float(count or 0)
    except (TypeError, ValueError):
        return "–"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"  # pragma: no cover - the loop returns at GB


def human_ms(ms) -> str:
    """A duration: 850 ms, 3.4 s."""
    ms = float(ms or 0.0)
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def mmlu_verdict(text: str, expected: str) -> tuple[bool | None, str]:
    """(right?, the sentence) for an answer to a multiple-choice question whose answer is ``expected``;
    (None, sentence) when the answer names no letter."""
    given = mmlu.parse_answer(text or "")
    if given is None:
        return None, f"no answer letter in the reply: the answer is {expected}"
    if given == expected:
        return True, f"right: answered {given}"
    return False, f"wrong: answered {given}, the answer is {expected}"


def _link_words(link: str) -> str:
    """The link a fetch went over, as a sentence names it, from the board's label: "unshaped",
    "emulated link 20.9 Mbit/s, 4 ms RTT" (the client paces it), or a kernel-shaped link's preset
    ("Wi-Fi 4 (20.9 Mbit/s, 4 ms)"). Emulated either way: said once."""
    if not link or link == "unshaped":
        return "the link to the cache box"
    return f"the emulated {link.removeprefix('emulated link ')} link"


def why(breakdown: dict) -> list[str]:
    """Sentences on where a run's time went when a person would ask: a hit whose fetch took most of
    its TTFT (slow only when it took longer than computing those tokens was forecast to take), a
    skipped fetch, a fetch that came late."""
    b = breakdown or {}
    sentences = []
    decision, case, tier = b.get("decision", ""), b.get("case", ""), b.get("tier", "")
    fetch_ms = float(b.get("fetch_ms") or b.get("redis_ms") or 0.0)
    ttft = float(b.get("ttft_ms") or 0.0)
    fetched = b.get("fetched_bytes") or 0
    if (
        case in (Case.PARTIAL, Case.FULL)
        and tier == Tier.CACHEBOX
        and fetch_ms >= SLOW_MS
        and ttft > 0
        and fetch_ms >= SLOW_SHARE * ttft
    ):
        sentences.append(_long_fetch(b, fetch_ms, ttft, fetched))
    if decision == Decision.POLICY_SKIP:
        tokens = b.get("candidate_tokens") or 0
        sentences.append(
            f"Fetch skipped: for the cached {tokens} tokens the policy forecast {human_ms(b.get('predicted_fetch_ms'))} to fetch and restore "
            f"against {human_ms(b.get('predicted_prefill_ms'))} to prefill them here, so it prefilled."
        )
    if b.get("fetch_late"):
        sentences.append(
            "The fetch ran slower than forecast: this board computed past the planned split while it waited."
        )
    return sentences


def _long_fetch(b: dict, fetch_ms: float, ttft: float, fetched: int) -> str:
    """A fetch that took most of the TTFT, against what computing its tokens was forecast to take
    (``predicted_prefill_ms``): "slow" only when it took longer."""
    link = _link_words(b.get("link", ""))
    took = f"{link} took {human_ms(fetch_ms)} for {human_bytes(fetched)}"
    forecast = float(b.get("predicted_fetch_ms") or 0.0)
    if forecast > 0:
        took += f" (forecast {human_ms(forecast)})"
    share = f"{fetch_ms / ttft:.0%} of the time to first token"
    cost = float(b.get("redis_ms") or fetch_ms)  # fetch and restore: what replaced computing
    computing = float(b.get("predicted_prefill_ms") or 0.0)
    tokens = int(b.get("fetched_tokens") or b.get("matched_tokens") or 0)
    those = f"those {tokens} tokens" if tokens else "them"
    if computing <= 0:
        return f"{took[:1].upper()}{took[1:]}, {share}."
    if cost > computing:
        return f"A slow hit: {took}, longer than the {human_ms(computing)} computing {those} here was forecast to take ({share})."
    return f"{took[:1].upper()}{took[1:]}, {share}, and still {computing / cost:.1f}x faster than computing {those} here ({human_ms(computing)} forecast)."


def explain_run(*, text: str, error: str, expected_answer: str, breakdown: dict) -> dict:
    """What the pages add to a run: ``verdict`` (MMLU: right/wrong words, ``right``: True/False/None)
    and ``why`` (sentences, maybe none)."""
    explanation: dict = {"verdict": "", "right": None, "why": []}
    if error:
        return explanation
    if expected_answer:
        explanation["right"], explanation["verdict"] = mmlu_verdict(text, expected_answer)
    explanation["why"] = why(breakdown)
    return explanation

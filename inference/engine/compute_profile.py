"""Compute profiles: pace a board's model work to a named class of hardware.

Link profiles (``cachebox.link``) emulate the paper's network; without these, every board's
compute is this machine's, many times faster than a Raspberry Pi Zero 2 W. A profile gives
the class's prefill rate, taken from the paper as data; the engine then waits after each
batch until the batch has taken as long as it would on that board. Decoding is slowed by
the same factor as prefill (the paper gives no per-token decode rate). Every run of a paced
board says so (``Breakdown.compute_profile`` and ``paced_ms``): figures from it are
emulated, never measurements of the real board.

Pure data and arithmetic, plus ``Pacer`` which sleeps (the only I/O here).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeProfile:
    name: str
    label: str  # shown on every run, chart and report, with "(emulated)"
    prefill_ms_per_token: float
    source: str  # where the rate comes from

    @property
    def emulated_label(self) -> str:
        return f"{self.label} (emulated)"


# Source: the distributed prompt caching paper (shared/seeds/000_...), Raspberry Pi Zero 2W running
# Gemma-3 270M (our model). Table 4 gives T-decode for one 405-token prompt: 27,203.96 ms on a
# miss and 11,220.95 ms on a full hit, so prefilling 404 tokens took 15,983 ms: 39.56 ms per token.
# (Table 3's 12,580.85 ms for a 65-token average prompt, 193 ms per token, is a short-prompt
# figure; batches of several hundred tokens, as ours, are nearer table 4.)
PI_ZERO_2W = ComputeProfile(
    "pi-zero-2w",
    "Raspberry Pi Zero 2 W",
    round(15_983.01 / 404, 2),
    "paper 000, table 4: 405-token prompt, T-decode 27,203.96 ms (miss) - 11,220.95 ms (full hit)",
)

# The paper's Raspberry Pi 5 ran the 1B model: P-decode 2,688.17 ms for a state of 9.94 MB (table 3),
# and there fetching over Wi-Fi 4 lost by 7%. We keep that regime (compute time per byte of state)
# for our model's 18,457 bytes per token: 2,688.17 / 9.94e6 * 18,457 = 4.99 ms per token.
PI_5 = ComputeProfile(
    "pi5",
    "Raspberry Pi 5",
    round(2_688.17 / 9.94e6 * 18_457, 2),
    "paper 000, table 3: high-end P-decode 2,688.17 ms for a 9.94 MB state, at our 18,457 bytes per token",
)

PROFILES: dict[str, ComputeProfile] = {profile.name: profile for profile in (PI_ZERO_2W, PI_5)}


def profile_named(name: str | None) -> ComputeProfile | None:
    """The profile called ``name`` (None or "" or "none": this machine's own speed)."""
    if not name or name == "none":
        return None
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown compute profile {name!r}; choose one of none, {', '.join(PROFILES)}") from None


def pacing_ms(profile: ComputeProfile, tokens: int, real_ms: float) -> float:
    """How long to wait after prefilling ``tokens`` in ``real_ms`` so that it took the profile's time."""
    return max(0.0, tokens * profile.prefill_ms_per_token - real_ms)


class Pacer:
    """Slows one engine's model work to a profile. Thread-safe counters; sleeps in the caller."""

    def __init__(self, profile: ComputeProfile):
        self.profile = profile
        self.slowdown = 1.0  # profile time / real time, learned from prefill batches, applied to decoding
        self._lock = threading.Lock()
        self.total_ms = 0.0  # every pause so far (a run reads the difference)

    def after_prefill(self, tokens: int, real_ms: float) -> None:
        wait = pacing_ms(self.profile, tokens, real_ms)
        if real_ms > 0 and tokens >= 16:  # small batches say little about the rate
            self.slowdown = max(1.0, (real_ms + wait) / real_ms)
        self._pause(wait)

    def after_decode(self, real_ms: float) -> None:
        self._pause(real_ms * (self.slowdown - 1.0))

    def _pause(self, wait_ms: float) -> None:
        if wait_ms <= 0:
            return
        with self._lock:
            self.total_ms += wait_ms
        time.sleep(wait_ms / 1000.0)

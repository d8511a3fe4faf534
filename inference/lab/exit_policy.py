"""Early exit's strategy names and policies, without the reference engine.

An edge board parses every request's strategy; this module lets it do so without importing
PyTorch (about 200 MB of a board's memory), which only ``inference.lab.early_exit`` loads when
a board is asked to run the strategy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MEASURES = ("top-prob", "similarity")
HEADS = ("plain", "lens")
DEFAULT_EXITS = (12, 14, 16)  # exits after this many of the 18 layers (plain exits below 12 are useless here)
STRATEGY_PREFIX = "early-exit"
STRATEGY_PATTERN = r"early-exit:(top-prob|similarity):(0(\.[0-9]{1,4})?|1(\.0{1,4})?)(:lens)?"  # also validates requests
_STRATEGY = re.compile(r"^early-exit:(top-prob|similarity):(0(?:\.[0-9]{1,4})?|1(?:\.0{1,4})?)(:lens)?$")


@dataclass(frozen=True)
class ExitPolicy:
    """When a decode step may stop early. ``exits``: depths (layers run) where confidence is
    checked, ascending, each below the model's depth; ``threshold``: a sequence is confident at
    an exit when its measure reaches it."""

    measure: str
    threshold: float
    exits: tuple[int, ...] = DEFAULT_EXITS
    kv_fill: bool = True
    head: str = "plain"

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise ValueError(f"unknown confidence measure {self.measure!r}: use {' or '.join(MEASURES)}")
        if self.head not in HEADS:
            raise ValueError(f"unknown exit head {self.head!r}: use {' or '.join(HEADS)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"the threshold is a probability or a cosine in [0, 1], got {self.threshold}")
        if not self.exits or list(self.exits) != sorted(set(self.exits)) or self.exits[0] < 1:
            raise ValueError(f"exits must be distinct depths >= 1 in ascending order, got {self.exits}")

    @property
    def label(self) -> str:
        return strategy_name(self)


def strategy_name(policy: ExitPolicy) -> str:
    """How a run names the strategy that answered it, e.g. ``early-exit(similarity>=0.98)``."""
    head = ", lens" if policy.head == "lens" else ""
    exits = "" if policy.exits == DEFAULT_EXITS else f", exits {'/'.join(map(str, policy.exits))}"
    fill = "" if policy.kv_fill else ", no KV fill"
    return f"{STRATEGY_PREFIX}({policy.measure}>={policy.threshold:g}{head}{exits}{fill})"


def parse_strategy(text: str) -> ExitPolicy | None:
    """``"early-exit:top-prob:0.9"`` (``:lens`` at the end: the fitted exit adapters) -> its
    policy; any other strategy (``""``, ``"exact"``, ``"kv-prediction:6"``) -> None. A malformed
    early-exit strategy: ValueError."""
    text = (text or "").strip()
    if not text.startswith(STRATEGY_PREFIX):
        return None
    match = _STRATEGY.match(text)
    if match is None:
        raise ValueError(
            f"unknown strategy {text!r}: use 'early-exit:MEASURE:THRESHOLD[:lens]', MEASURE top-prob or similarity, "
            "THRESHOLD in [0, 1], e.g. early-exit:top-prob:0.9"
        )
    return ExitPolicy(match.group(1), float(match.group(2)), head="lens" if match.group(3) else "plain")

"""Serving strategies by name: the one grammar a run names its strategy in, and the registry.

A run says how it is to be served in one string (``RunRequest.strategy``, the Run page's choice,
``edgecache.strategy`` in the API, ``infer --strategy``): ``""`` or ``exact`` for exact serving
(prefix serving; schema serving for a PML prompt), or a lab strategy: approximate by design, it
never reads or writes the cache box and labels its runs. ``parse_strategy`` reads that string,
here and nowhere else, into a ``StrategySpec``; ``REGISTRY`` says, one line per strategy, how its
name and parameters read and which module opens it on a board (imported on first use: a lab
strategy may load torch or a second model).

A new strategy is one module (a ``Strategy``, ``inference.serving.run``, and its ``open_strategy(board,
spec)``) and one line in ``REGISTRY``; a parameter of a new kind is also a ``StrategySpec`` field.
Pure: no engine, no I/O.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StrategySpec:
    """A strategy as a run asked for it: its registered name and its parameters."""

    name: str = "exact"
    aux_layers: int | None = None  # kv-prediction: layers of the auxiliary model
    measure: str | None = None  # early-exit: the confidence measure (top-prob or similarity)
    threshold: float | None = None  # early-exit: the confidence that lets a token leave
    head: str = "plain"  # early-exit: "lens" exits through the fitted adapters

    @property
    def exact(self) -> bool:
        """Exact serving: a cached answer is the cold answer, bit for bit."""
        return not REGISTRY[self.name].approximate


@dataclass(frozen=True)
class Registered:
    """One registry line: how a strategy is named and where it lives."""

    name: str  # what a run writes before the first ':'
    params: str  # the regex of what follows ``name:`` (its named groups are StrategySpec fields); "" = none
    form: str  # how to write it, for error messages and help
    opens: str  # "module:function(board, spec) -> Strategy"; "" = the board's own (exact serving)
    approximate: bool = True

    def open(self, board, spec: StrategySpec):
        """The board's strategy for ``spec`` (its module imported now, on first use)."""
        module, _, function = self.opens.partition(":")
        return getattr(importlib.import_module(module), function)(board, spec)


_THRESHOLD = r"0(?:\.[0-9]{1,4})?|1(?:\.0{1,4})?"

REGISTRY: dict[str, Registered] = {
    line.name: line
    for line in (
        Registered(
            "exact", "", "'exact' (or nothing: prefix serving, schema serving for a PML prompt)", "", approximate=False
        ),
        Registered(
            "kv-prediction",
            r"(?P<aux_layers>[0-9]{1,2})",
            "'kv-prediction:K' (K auxiliary layers, e.g. kv-prediction:6)",
            "inference.lab.kv_prediction:open_strategy",
        ),
        Registered(
            "early-exit",
            rf"(?P<measure>top-prob|similarity):(?P<threshold>{_THRESHOLD})(?::(?P<head>lens))?",
            "'early-exit:MEASURE:THRESHOLD[:lens]', MEASURE top-prob or similarity, THRESHOLD in [0, 1], e.g. early-exit:top-prob:0.9",
            "inference.lab.early_exit:open_strategy",
        ),
        Registered(
            "anchors",
            "",
            "'anchors' (the served model, pruned to anchor tokens)",
            "inference.lab.anchors:open_strategy",
        ),
        Registered(
            "anchors-tuned",
            "",
            "'anchors-tuned' (the anchor-tuned model, pruned)",
            "inference.lab.anchors:open_strategy",
        ),
    )
}

EXACT = StrategySpec()
_TYPES = {"aux_layers": int, "threshold": float}  # the other parameters are words


def parse_strategy(text: str) -> StrategySpec:
    """The strategy ``text`` names (``""`` means exact); ValueError saying what to write otherwise.

    The text is taken as it is (no spaces trimmed): it is what travels in a run request.
    """
    if text == "":
        return EXACT
    name, colon, params = text.partition(":")
    line = REGISTRY.get(name)
    if line is None:
        forms = "; ".join(line.form for line in REGISTRY.values())
        raise ValueError(f"unknown strategy {text!r}: use one of {forms}")
    match = (
        re.fullmatch(line.params, params) if bool(colon) == bool(line.params) else None
    )  # compiled once, by re's cache
    if match is None:
        raise ValueError(f"unknown strategy {text!r}: use {line.form}")
    values = {field: _TYPES.get(field, str)(value) for field, value in match.groupdict().items() if value is not None}
    return StrategySpec(name, **values)

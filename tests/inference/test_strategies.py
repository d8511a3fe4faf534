"""Strategies and tiers, one contract each: one grammar names a strategy everywhere a run can
ask for one, the registry opens what it names, every strategy runs through one skeleton, and
the tiers are walked nearest first. Fakes only: milliseconds (the real runs are in
test_pipeline, test_tiers, test_lab, test_anchors and test_early_exit)."""

from __future__ import annotations

import importlib
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from inference.serving.breakdown import Tier as TierLabel
from inference.serving.run import FirstToken, Prompt, PromptError, RunOptions, ServingStrategy, Tokens, prompt_tokens
from inference.serving.strategies import EXACT, REGISTRY, StrategySpec, parse_strategy
from inference.tiers import Computed, Held, TierRun, keep_nearest_first, restore_nearest_first


# -- one grammar, one registry -------------------------------------------------------------------
def test_every_strategy_the_run_page_offers_is_registered_and_every_registered_one_is_offered():
    from dashboard.forms import RunForm

    offered = [parse_strategy(value) for value, _ in RunForm.STRATEGIES]
    assert {spec.name for spec in offered} == set(REGISTRY)
    assert [spec.exact for spec in offered].count(True) == 1  # "exact" once; every other choice is a lab strategy


@pytest.mark.django_db
def test_the_api_takes_what_the_run_page_offers_and_refuses_the_rest_in_the_grammars_words():
    from dashboard.api.errors import ApiError
    from dashboard.api.requests import parse_request
    from dashboard.api.views import _run_request
    from dashboard.forms import RunForm

    key = SimpleNamespace(name="tester", key_prefix="ec-test", namespace_id="")
    chat = {"model": "gemma", "messages": [{"role": "user", "content": "Hi"}]}
    for value, _ in RunForm.STRATEGIES:
        api = parse_request({**chat, "edgecache": {"strategy": value}}, "chat")
        run = _run_request(key, api, "")
        assert parse_strategy(run.strategy) == parse_strategy(value)
    for bad in ("telepathy", "kv-prediction", "early-exit:top-prob:1.5", "anchors:3"):
        api = parse_request({**chat, "edgecache": {"strategy": bad}}, "chat")
        with pytest.raises(ApiError) as refused:
            _run_request(key, api, "")
        with pytest.raises(ValueError) as grammar:
            parse_strategy(bad)
        assert refused.value.param == "edgecache.strategy" and str(grammar.value) in refused.value.message


def test_the_grammar_reads_parameters_into_a_typed_spec_and_says_what_to_write():
    assert parse_strategy("") == parse_strategy("exact") == EXACT and EXACT.exact
    assert parse_strategy("kv-prediction:6") == StrategySpec("kv-prediction", aux_layers=6)
    assert parse_strategy("early-exit:similarity:0.975:lens") == StrategySpec(
        "early-exit", measure="similarity", threshold=0.975, head="lens"
    )
    assert parse_strategy("anchors-tuned") == StrategySpec("anchors-tuned") and not parse_strategy("anchors").exact
    with pytest.raises(ValueError, match="kv-prediction:K"):
        parse_strategy("kv-prediction:")
    with pytest.raises(ValueError) as unknown:
        parse_strategy(" exact")  # as it travels: nothing trimmed
    assert all(line.form in str(unknown.value) for line in REGISTRY.values())


def test_every_registered_strategy_names_a_module_that_opens_it():
    for line in REGISTRY.values():
        if line.approximate:
            module, _, function = line.opens.partition(":")
            assert callable(getattr(importlib.import_module(module), function)), line.name
        else:
            assert line.opens == ""  # exact serving is the board's own (prefix, or schema for a PML prompt)


def test_a_new_strategy_is_one_module_and_one_registry_line(monkeypatch):
    from inference.board.runtime import Board
    from inference.serving.strategies import Registered

    class OneBoard:  # what the registry needs of a board: its engine, its memory, and what it opened
        strategy, opened, _check_memory = Board.strategy, Board.opened, Board._check_memory

        def __init__(self):
            self.engine, self._opened = _Engine(), {}

    monkeypatch.setitem(REGISTRY, "echo", Registered("echo", "", "'echo'", f"{__name__}:open_echo"))
    board, spec = OneBoard(), parse_strategy("echo")
    result = board.strategy(spec).run(Prompt.of("abc"), RunOptions(max_tokens=3))
    assert result.breakdown.strategy == "echo" and result.breakdown.cachebox == "off" and result.tokens == [3, 4, 5]
    assert board.strategy(spec) is board._opened[spec]  # opened once


# -- one skeleton ------------------------------------------------------------------------------
class _Engine:
    """Tokens are characters' codes mod 50; the 'model' always predicts the previous token + 1."""

    n_ctx = 12

    def __init__(self):
        self.lock = threading.RLock()
        self.cleared = 0

    def tokenize(self, text, add_bos):
        return ([0] if add_bos else []) + [ord(ch) % 50 for ch in text]

    def detokenize(self, tokens):
        return "".join(chr(97 + token % 26) for token in tokens)

    def is_end_of_generation(self, token):
        return token == 49

    def decode_one(self, token, position):
        return _logits_for(token + 1)

    def clear(self):
        self.cleared += 1


def _logits_for(token: int) -> np.ndarray:
    logits = np.zeros(50, np.float32)
    logits[token] = 10.0
    return logits


class _Echo(ServingStrategy[Tokens]):
    """A strategy that 'prefills' by predicting the prompt's last token + 1."""

    approximate = True
    clears_context = True
    label = "echo"

    def __init__(self, engine):
        self.engine = engine
        self.finished = []

    def prepare(self, run):
        return Tokens(prompt_tokens(self.engine, run.prompt)[1:])  # no BOS: 'abc' is [47, 48, 49]

    def first_token(self, run, prompt):
        assert self.engine.cleared % 2 == 1, "an approximate strategy starts from an empty context"
        return FirstToken(_logits_for(prompt.tokens[0] - 44), position=prompt.prompt_tokens)

    def finish(self, run, prompt, first, result):
        self.finished.append(result.tokens)


def open_echo(board, spec):
    return board.opened(spec, lambda: _Echo(board.engine))


def test_the_skeleton_checks_tokenizes_fits_the_context_answers_and_finishes():
    engine = _Engine()
    echo = _Echo(engine)
    streamed = []
    result = echo.run("abc", max_tokens=8, on_token=lambda token, text: streamed.append(token) or len(streamed) < 2)
    assert result.tokens == [3, 4] and streamed == [3, 4]  # on_token stopped it after two
    b = result.breakdown
    assert (
        b.prompt_tokens == 3 and b.generated_tokens == 2 and b.ttft_ms >= b.token_ms >= 0 and b.decision == "no-cache"
    )
    assert engine.cleared == 2 and echo.finished == [[3, 4]]  # cleared before and after; finished after the answer
    with pytest.raises(PromptError, match="context holds 12"):
        echo.run("abcdefgh", max_tokens=8)
    with pytest.raises(PromptError, match="empty"):
        echo.run(["  "], max_tokens=1)
    with pytest.raises(PromptError, match="max_tokens"):
        echo.run("abc", RunOptions(max_tokens=0))
    assert echo.run(Prompt.of("", tokens=[0, 47]), max_tokens=1).tokens == [3]  # a chat's tokens need no text


# -- one tier contract, walked nearest first -----------------------------------------------------
class _Tier:
    """Holds the prompt up to ``upto``; records what it was asked."""

    def __init__(self, label, upto, log):
        self.label, self.upto, self.log = label, upto, log

    def lookup(self, run, held):
        self.log.append(("lookup", self.label, held.matched))
        return self.upto if self.upto > held.matched else None

    def restore(self, run, upto, held):
        run.breakdown.tier = self.label
        return Held(upto)

    def keep(self, computed):
        self.log.append(("keep", self.label, computed.held.matched))


def test_tiers_are_walked_nearest_first_each_extending_what_the_nearer_ones_hold():
    from inference.serving.breakdown import Breakdown

    log = []
    tiers = [_Tier(TierLabel.CONTEXT, 128, log), _Tier(TierLabel.LOCAL, 0, log), _Tier(TierLabel.CACHEBOX, 384, log)]
    run = TierRun(_Engine(), list(range(400)), 128, (), [128, 256, 384, 400], Breakdown())
    held = restore_nearest_first(tiers, run)
    assert held.matched == 384 and run.breakdown.tier == "cachebox"
    assert log == [("lookup", "context", 0), ("lookup", "local", 128), ("lookup", "cachebox", 128)]
    settled = []
    held.loader = SimpleNamespace(stop=lambda: settled.append("stop"), join=lambda timeout: settled.append("join"))
    keep_nearest_first(tiers, Computed(run, held, {}, {}))
    assert settled == ["stop", "join"] and log[3:] == [
        ("keep", "context", 384),
        ("keep", "local", 384),
        ("keep", "cachebox", 384),
    ]

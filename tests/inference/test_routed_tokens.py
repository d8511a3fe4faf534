"""A prompt is tokenized once (issue 41): the tokens and cuts the control plane made to route it
travel in the signed request (``RunRequest.tokenized``), and a board of the same vocabulary
answers from them without tokenizing again; a board of another vocabulary tokenizes itself."""

from __future__ import annotations

import uuid

import pytest
from django.conf import settings

from dashboard import actions, router
from dashboard.models import Dispatch
from inference.board import serve
from inference.contract.messages import MAX_PROMPT_TOKENS, MessageRefused, PromptTokens, RunRequest
from tests.dashboard.test_dashboard import control_plane, register, sent_tasks  # noqa: F401  (fixtures)

SEGMENTS = [
    "Instruction: answer in one word.\n\n",
    "Notes.\n\nQuestion: what colour is the sky on a clear day?\nAnswer:",
]
CHAT = [("system", "Be terse."), ("user", "Name a colour of the rainbow.")]


def _digest() -> str:
    return router._vocabulary(settings.EDGECACHE_MODEL).digest


# -- the message ---------------------------------------------------------------------------------
def test_carried_tokens_are_bounded_and_their_cuts_lie_inside_them():
    ok = {"tokens": [2, 10, 11], "cuts": [1, 2], "vocabulary": "0123456789abcdef"}
    assert PromptTokens.parse(ok).cuts == [1, 2]
    for bad, reason in [
        ({**ok, "cuts": [3]}, "cuts"),
        ({**ok, "cuts": [2, 1]}, "cuts"),
        ({**ok, "tokens": []}, "tokens"),
        ({**ok, "tokens": [-1]}, "tokens"),
        ({**ok, "tokens": [2**31]}, "tokens"),
        ({**ok, "vocabulary": "a model"}, "vocabulary"),
        ({**ok, "tokens": [1] * (MAX_PROMPT_TOKENS + 1)}, "tokens"),
    ]:
        with pytest.raises(MessageRefused, match=reason):
            PromptTokens.parse(bad)
    request = {
        "request_id": str(uuid.uuid4()),
        "schema": "<schema name='s'>x</schema>",
        "pml": "<prompt schema='s'/>",
        "tokenized": ok,
    }
    with pytest.raises(MessageRefused, match="schema run"):
        RunRequest.parse(request)
    plain = RunRequest.parse({"request_id": str(uuid.uuid4()), "segments": ["hi"]})
    assert "tokenized" not in plain.dump()  # absent where none was made (what boards of the version before read)


# -- the control plane ---------------------------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_dispatched_run_carries_the_tokens_and_cuts_routing_made_of_its_prompt(control_plane, sent_tasks):
    device, _ = register()
    asked = actions.run_request(SEGMENTS, max_tokens=3)
    actions.dispatch_run(None, [device], asked)
    message = sent_tasks[0]["args"][0]  # as the board opens it
    tokens, cuts = router.prompt_tokens(asked)
    assert cuts and message["tokenized"] == {"tokens": tokens, "cuts": list(cuts), "vocabulary": _digest()}
    assert RunRequest.parse(message).tokenized.tokens == tokens
    # What a re-send sends (the stored request) carries them too.
    assert Dispatch.objects.get(request_id=message["request_id"]).request["tokenized"] == message["tokenized"]

    chat = actions.run_request(messages=CHAT, max_tokens=3)
    routed = router.plan([device], chat, all_online=True)  # the any-board path: the chosen board's request
    tokens, cuts = router.prompt_tokens(chat)
    carried = routed.request(chat).tokenized
    assert carried is not None and (carried.tokens, carried.cuts) == (tokens, list(cuts)) and len(cuts) == 1

    schema_run = actions.run_request(schema="<schema name='s'>x</schema>", pml="<prompt schema='s'/>")
    assert router.plan([device], schema_run, all_online=True).request(schema_run).tokenized is None


# -- the board -----------------------------------------------------------------------------------
def _count_tokenize(monkeypatch, engine) -> list[str]:
    calls: list[str] = []
    tokenize = type(engine).tokenize

    def counted(text, *, add_bos, special=False):
        calls.append(text)
        return tokenize(engine, text, add_bos=add_bos, special=special)

    monkeypatch.setattr(engine, "tokenize", counted)
    return calls


def _request(kind: str, tokenized: PromptTokens | None) -> RunRequest:
    prompt = (
        {"segments": SEGMENTS}
        if kind == "text"
        else {"messages": [{"role": role, "content": content} for role, content in CHAT]}
    )
    # use_cache off: both runs are cold, and a chat's next turn is not prepared (which tokenizes it)
    return RunRequest.parse(
        {
            "request_id": str(uuid.uuid4()),
            **prompt,
            "max_tokens": 8,
            "use_cache": False,
            **({"tokenized": tokenized.dump()} if tokenized else {}),
        }
    )


@pytest.mark.model
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_board_answers_from_the_routed_tokens_as_it_answers_tokenizing_itself_and_does_not_tokenize_again(
    monkeypatch, namespace, make_board, kind
):
    board = make_board(None, namespace)
    assert board.engine.digest == _digest()  # one model file, one llama.cpp: one vocabulary
    calls = _count_tokenize(monkeypatch, board.engine)
    cold = serve(board, _request(kind, None))
    assert cold.error == "" and calls  # it tokenized the prompt itself
    layout = router.prompt_tokens(_request(kind, None))
    routed = PromptTokens(tokens=layout[0], cuts=list(layout[1]), vocabulary=_digest())
    calls.clear()
    given = serve(board, _request(kind, routed))
    assert given.error == "" and calls == []
    assert given.tokens == cold.tokens and given.text == cold.text and given.prompt == cold.prompt
    assert given.breakdown.prompt_tokens == cold.breakdown.prompt_tokens == len(routed.tokens)


@pytest.mark.model
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_tokens_declared_for_another_vocabulary_are_ignored_and_the_board_tokenizes_itself(
    monkeypatch, namespace, make_board, kind
):
    board = make_board(None, namespace)
    cold = serve(board, _request(kind, None))
    calls = _count_tokenize(monkeypatch, board.engine)
    foreign = PromptTokens(
        tokens=[2, 4000, 5000, 6000], cuts=[2], vocabulary="0123456789abcdef"
    )  # another model's tokens
    assert foreign.vocabulary != board.engine.digest
    answered = serve(board, _request(kind, foreign))
    assert answered.error == "" and calls  # tokenized here
    assert answered.tokens == cold.tokens and answered.breakdown.prompt_tokens == cold.breakdown.prompt_tokens != len(
        foreign.tokens
    )

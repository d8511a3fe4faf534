"""Conversations: a chat's next turn reuses the previous turn's state, its answer included, on the
same board (its context) or another (the cache box), and answers exactly as its cold run does.

A turn's prompt ends where the next turn's answer begins, and batches are cut where every
message begins, so a turn's stored state is a batch-exact prefix of the next turn. The answer's
cells come one token per batch while decoding, so after each answer the board computes the shared
prefix of the next turn (``Board.follow_up``) on that turn's cuts and shares it."""

import pytest

from inference.tiers.local import Context

GRID = 128


# -- pure: where a context may be resumed -------------------------------------------------------
def test_a_context_resumes_at_a_cut_both_prompts_share():
    held = Context(list(range(100)), generation=1, extra=(40,))
    # The new prompt is cut at 40 too and shares 70 tokens: resume at 40.
    assert held.reusable(list(range(70)) + [999] * 30, GRID, (40, 90)) == 40
    # A prompt cut elsewhere before 40 has another batch history: nothing below the grid is shared.
    assert held.reusable(list(range(70)) + [999] * 30, GRID, (20, 40)) == 0
    # The held prompt's end is a batch end: a prompt that continues it resumes there.
    assert held.reusable(list(range(100)) + [7] * 20, GRID, (40, 100)) == 100
    # ... but not when the new prompt is not cut there (its cold run computes past it in one batch).
    assert held.reusable(list(range(100)) + [7] * 20, GRID, (40,)) == 40


def test_grid_points_still_serve_when_the_extra_cuts_differ_above_them():
    held = Context(list(range(300)), generation=1, extra=(200,))
    assert held.reusable(list(range(290)) + [5], GRID, (150,)) == 128


def test_a_board_keeps_preparing_next_turns_its_conversations_take_up_even_interleaved():
    from inference.engine.chat import FollowUps

    ledger = FollowUps()
    conversations = {
        c: [c * 1000 + t for t in range(50)] for c in range(ledger.EXPIRE_RUNS)
    }  # as many conversations as it waits runs for
    for turn in range(5):
        for c, prompt in conversations.items():  # interleaved: the others' turns come between
            ledger.saw(prompt)
            assert ledger.worth_preparing()
            prepared = prompt + [7, 8, 9]  # the answer and the next turn's opening
            ledger.prepared(prepared)
            conversations[c] = prepared + [c, turn]  # the next turn goes on from it
    assert list(ledger.outcomes) == [True] * ledger.OUTCOMES


def test_a_board_whose_clients_never_go_on_stops_preparing_and_sees_them_turn_to_conversations():
    from inference.engine.chat import FollowUps

    ledger = FollowUps()
    system = list(range(400))
    decisions = []
    for question in range(20):  # one question after another under one system prompt, never a second turn
        prompt = system + [10_000 + question] * 5
        ledger.saw(prompt)
        worth = ledger.worth_preparing()
        decisions.append(worth)
        next_turn = prompt + [1, 2, 3]
        ledger.prepared(next_turn) if worth else ledger.watched(next_turn)
    # nothing known for the first ones: it prepares until two have gone untaken for EXPIRE_RUNS runs
    assert decisions[: ledger.EXPIRE_RUNS + 1] == [True] * (ledger.EXPIRE_RUNS + 1)
    assert not any(decisions[ledger.EXPIRE_RUNS + 1 :])  # then never again: no preparation spent as a probe
    # the client turns to a conversation: its first next turn goes on from a watched prefix
    prompt = system + [20_000] * 5
    ledger.saw(prompt)
    assert not ledger.worth_preparing()
    ledger.watched(prompt + [1, 2, 3])
    ledger.saw(prompt + [1, 2, 3, 42])
    assert ledger.worth_preparing()  # it prepares the turns again


def test_a_turn_neither_prepared_nor_watched_teaches_nothing():
    from inference.engine.chat import FollowUps

    ledger = FollowUps()
    for _ in range(10):
        ledger.saw(list(range(50)))
    assert list(ledger.outcomes) == [] and ledger.worth_preparing()


# -- the real model ------------------------------------------------------------------------------
FIRST = [
    ("system", "You are a terse assistant for ferry passengers."),
    ("user", "Name three things to bring on a ferry trip."),
]
NEXT = ["Which of them matters most in winter?", "Why?", "Thanks. Anything else for children?"]


def turns(board, count: int, max_tokens: int = 24, **options):
    """Play ``count`` turns of the conversation on ``board``; yields (messages, result) per turn."""
    messages = list(FIRST)
    for number in range(count):
        if number:
            messages.append(("user", NEXT[number - 1]))
        chat, result = board.run_chat(messages, max_tokens=max_tokens, **options)
        yield list(messages), chat, result
        board.follow_up(messages, result.text, namespace=options.get("namespace"))
        messages.append(("assistant", result.text))


@pytest.mark.model
def test_a_turn_prompt_is_a_cut_prefix_of_the_next_turn(engine):
    from inference.engine.chat import chat_prompt, follow_up

    first = chat_prompt(engine, FIRST)
    prefix = follow_up(engine, FIRST, "Water, a jacket and snacks.")
    second = chat_prompt(engine, [*FIRST, ("assistant", "Water, a jacket and snacks."), ("user", NEXT[0])])
    assert second.tokens[: len(first.tokens)] == first.tokens
    assert second.tokens[: len(prefix.tokens)] == prefix.tokens
    assert (
        len(first.tokens) in second.cuts and len(prefix.tokens) in second.cuts
    )  # where the answer and the new message begin
    assert [cut for cut in second.cuts if cut < len(prefix.tokens)] == list(prefix.cuts)


@pytest.mark.model
@pytest.mark.cachebox
def test_later_turns_prefill_only_their_new_message_from_the_context_and_answer_as_cold(
    valkey_url, namespace, make_board
):
    board = make_board(valkey_url, namespace, context_reuse=True)
    played = list(turns(board, 4, namespace=namespace))
    for number, (messages, chat, result) in enumerate(played[1:], start=2):
        b = result.breakdown
        previous_messages, previous_chat, previous = played[number - 2]
        assert b.tier == "context" and b.fetched_bytes == 0, number
        # Everything up to where the new message begins was held: the previous prompt and its answer.
        assert (
            b.matched_tokens == chat.starts[-1] > len(previous_chat.tokens) + previous.breakdown.generated_tokens - 2
        ), number
        cold = board.run(chat.text, tokens=chat.tokens, cuts=chat.cuts, max_tokens=24, use_cache=False)
        assert result.tokens == cold.tokens, number
    assert (
        played[1][2].breakdown.prompt_tokens - played[1][2].breakdown.matched_tokens < 24
    )  # the new message and its markup


@pytest.mark.model
@pytest.mark.cachebox
def test_another_board_continues_a_conversation_from_the_cache_box(valkey_url, namespace, make_board):
    first_board = make_board(valkey_url, namespace, device="dev-a", context_reuse=True)
    ((messages, chat, result),) = turns(first_board, 1, namespace=namespace)
    turn = first_board.follow_up(messages, result.text, namespace=namespace)  # already prepared: nothing more to do
    assert turn.tokens == 0

    other = make_board(valkey_url, namespace, device="dev-b", context_reuse=True)
    other.catalogs.sync_all()
    second = [*messages, ("assistant", result.text), ("user", NEXT[0])]
    chat2, continued = other.run_chat(second, max_tokens=32)
    b = continued.breakdown
    assert b.tier == "cachebox" and b.fetched_bytes > 0
    assert b.matched_tokens == chat2.starts[-1] >= len(chat.tokens) + result.breakdown.generated_tokens - 1
    cold = other.run(chat2.text, tokens=chat2.tokens, cuts=chat2.cuts, max_tokens=32, use_cache=False)
    assert continued.tokens == cold.tokens


@pytest.mark.model
@pytest.mark.cachebox
def test_a_follow_up_needs_the_turn_it_follows(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace, context_reuse=True)
    _, result = board.run_chat(FIRST, max_tokens=8)
    board.run(["Something unrelated, about lighthouses."], max_tokens=2)  # the engine moved on
    assert board.follow_up(FIRST, result.text, namespace=namespace).tokens == 0
    assert board.follow_up(FIRST, "   ", namespace=namespace).tokens == 0  # no answer to keep


@pytest.mark.model
@pytest.mark.cachebox
def test_a_waiting_run_goes_before_preparing_the_next_turn(valkey_url, namespace, make_board):
    import uuid

    from inference.board import serve
    from inference.contract.messages import ChatMessage, RunRequest

    board = make_board(valkey_url, namespace, context_reuse=True)

    def turn(work_waiting):
        request = RunRequest(
            request_id=str(uuid.uuid4()),
            messages=[ChatMessage(role=r, content=c) for r, c in FIRST],
            max_tokens=6,
            namespace=namespace,
        )
        return serve(board, request, work_waiting=work_waiting)

    idle = turn(lambda within=0.0: False)
    assert idle.error == "" and idle.breakdown.next_turn_tokens > 0  # nothing waits: the next turn's prefix is ready
    prepared = list(board.follow_ups.pending)[-1][:2]  # its length and key
    busy = turn(lambda within=0.0: True)
    assert (
        busy.error == "" and busy.breakdown.next_turn_tokens == 0 and busy.text == idle.text
    )  # another run waits: it goes first
    # not prepared but watched: the board remembers the very prefix a preparation would have kept,
    # so a next turn that goes on from it still counts as one its clients take up
    assert len(board.follow_ups.pending) == 2 and list(board.follow_ups.pending)[-1][:2] == prepared

    def broker_down(within=0.0):
        raise ConnectionError("broker unreachable")

    assert turn(broker_down).breakdown.next_turn_tokens > 0  # unknown counts as nothing waiting


@pytest.mark.model
@pytest.mark.cachebox
def test_a_board_whose_clients_send_at_once_and_never_go_on_stops_looking_for_their_next_turn(
    valkey_url, namespace, make_board
):
    import uuid

    from inference.board import serve
    from inference.contract.messages import ChatMessage, RunRequest

    board = make_board(valkey_url, namespace, context_reuse=True)
    looks = []

    def next_request_already_here(within=0.0):
        looks.append(within)
        return True  # a client that sends its next request at once: seen while the board looks

    for question in range(8):  # one question after another under one system prompt, never a second turn
        messages = [
            ChatMessage(role="system", content=FIRST[0][1]),
            ChatMessage(role="user", content=f"Question {question}: how long is the crossing?"),
        ]
        report = serve(
            board,
            RunRequest(request_id=str(uuid.uuid4()), messages=messages, max_tokens=2, namespace=namespace),
            work_waiting=next_request_already_here,
        )
        assert (
            report.error == "" and report.breakdown.next_turn_tokens == 0
        )  # never prepared: the next request went first
    # it learned from the turns it watched: after the first EXPIRE_RUNS + 1 it no longer looks, so
    # such a client's next request no longer waits behind the look (and the report after it)
    assert len(looks) == board.follow_ups.EXPIRE_RUNS + 1


@pytest.mark.cachebox
def test_the_board_sees_messages_waiting_in_its_queues(valkey_url):
    import uuid

    from celery import Celery

    from inference.board import messages_waiting
    from inference.board.app import celery_settings

    app = Celery("waiting-test", set_as_current=False)  # not the process's current app
    app.conf.update(celery_settings(valkey_url))
    own, shared = f"device.t-{uuid.uuid4().hex[:8]}", f"boards-{uuid.uuid4().hex[:8]}"
    assert messages_waiting(app, [own, shared]) == 0  # queues never used
    app.send_task("edgecache.run_prompt", args=[{}], queue=own)
    app.send_task("edgecache.run_prompt", args=[{}], queue=shared)
    app.send_task("edgecache.run_prompt", args=[{}], queue=shared)
    assert messages_waiting(app, [own]) == 1 and messages_waiting(app, [own, shared]) == 3
    with app.connection_for_write() as connection:
        for name in (own, shared):
            connection.default_channel.queue_purge(name)
    assert messages_waiting(app, [own, shared]) == 0


@pytest.mark.cachebox
def test_a_board_waiting_for_its_next_run_wakes_when_it_lands_and_leaves_it_queued(valkey_url):
    import threading
    import time
    import uuid

    from celery import Celery

    from inference.board import messages_waiting
    from inference.board.app import celery_settings
    from inference.board.serve import work_arrives

    app = Celery("arrives-test", set_as_current=False)
    app.conf.update(celery_settings(valkey_url))
    own, shared = f"device.t-{uuid.uuid4().hex[:8]}", f"boards-{uuid.uuid4().hex[:8]}"
    assert work_arrives(app, own, shared, 0.05) is False  # nothing came
    threading.Timer(0.2, lambda: app.send_task("edgecache.run_prompt", args=[{}], queue=own)).start()
    started = time.monotonic()
    assert work_arrives(app, own, shared, 20) is True
    assert time.monotonic() - started < 10  # woken by the message, not by the end of the wait
    assert messages_waiting(app, [own]) == 1  # still there for the worker to take
    app.send_task("edgecache.run_prompt", args=[{}], queue=shared)
    assert work_arrives(app, own, shared, 0) is True  # the shared queue counts too
    with app.connection_for_write() as connection:
        for name in (own, shared):
            connection.default_channel.queue_purge(name)


def test_a_run_sent_just_after_the_answer_goes_before_the_next_turns_preparation():
    from inference.board.serve import _waiting

    arrivals = iter([False, False, True])  # the next request lands in the queue on the third look
    assert _waiting(lambda within: next(arrivals), "run", grace_s=30) is True
    assert _waiting(lambda within: False, "run", grace_s=0.05) is False  # nothing came: the next turn is prepared


def test_a_broker_without_blmove_is_looked_at_again_after_the_wait(monkeypatch):
    from redis.exceptions import ResponseError

    from cachebox.broker import wait_in_queue

    class Refusing:
        def blmove(self, *args):
            raise ResponseError("NOPERM this user has no permissions to run the 'blmove' command")

    class Landing:
        def blmove(self, *args):
            return b"a message"

    assert wait_in_queue(Refusing(), "device.x", 0.01) is None  # the caller sleeps and looks again
    assert wait_in_queue(Landing(), "device.x", 0.01) is True

"""Serving a dispatched run on the board: the strategy it names answers (``Board.serve``), this
room streams, stops at stop strings, obeys a signed cancel, prepares a chat's next turn when no
other work waits, and always returns a report (an error is a report too); and encoding a schema.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from celery import current_app

from cachebox.broker import wait_in_queue
from cachebox.errors import CacheBoxUnavailable
from inference.board import enrollment
from inference.board.devices import UNREAD
from inference.board.enrollment import identity, sender
from inference.board.streaming import AnswerText, StreamPublisher, signed_cancel, signed_cancel_set
from inference.contract.messages import (
    CANCELLED,
    EncodeReport,
    EncodeRequest,
    Queue,
    RunReport,
    RunRequest,
    StreamEvent,
)
from inference.engine.chat import chat_prompt, chat_text, follow_up
from inference.engine.llama import EngineError
from inference.engine.sampling import SamplingParams
from inference.serving.run import Prompt, PromptError, RunOptions
from inference.serving.strategies import parse_strategy

log = logging.getLogger("inference.board")


def serve(
    board,
    request: RunRequest,
    work_waiting: Callable[[float], bool] | None = None,
    behind_ms: float = 0.0,
    cancel_flag=UNREAD,
) -> RunReport:
    """Run one dispatched prompt; returns the report for the control plane (an error is a report too).

    A streamed run (``request.stream``) publishes each answer piece on its channel as it is
    chosen and a last ``done`` (or ``error``) event, sealed and signed by this board, and stops
    when the control plane's signed cancel flag appears; ``request.stop`` ends the answer at the
    first stop string, streamed or not. After a chat turn's answer, the next turn's prefix is
    prepared unless ``work_waiting()`` says another run waits for this board (a waiting answer
    goes before a turn that may never come) or this board's clients lately took up none of the
    turns it prepared or watched (``FollowUps``). Only a board process (an identity) streams.
    ``behind_ms``: how long the run waited for this board's earlier work (in its breakdown);
    ``cancel_flag``: the run's cancel flag as read already (else it is read here).
    """
    me = enrollment.current()
    streaming = request.stream and board.store is not None and me is not None
    stream = StreamPublisher(board.store, request.request_id, me, cancel_flag=cancel_flag) if streaming else None
    if _cancelled_before_start(board, request, me, stream, cancel_flag):
        if stream is not None:
            stream.close()
        return RunReport.for_request(request, **sender(), error=CANCELLED)
    answer = _Answer(request, stream)
    answer.stage("started")
    conversation = [(message.role, message.content) for message in request.messages]
    try:
        options = _run_options(request, answer)
        asked, prompt = _asked(board, request, conversation)
        if request.is_chat_run and asked.tokens is not None:
            board.follow_ups.saw(asked.tokens)
        spec = parse_strategy(request.strategy)  # a lab strategy is approximate: it never reads or writes the cache box
        result = board.serve(spec, asked, options)
    except (PromptError, ValueError, EngineError) as exc:  # PMLError is a ValueError
        answer.failed(str(exc))
        return RunReport.for_request(request, **sender(), error=str(exc))
    except BaseException as exc:  # a bug or a broken engine: the waiting client hears it now (tasks.py reports it)
        answer.failed(f"the board failed: {type(exc).__name__}: {exc}")
        raise
    breakdown = result.breakdown
    breakdown.behind_ms = behind_ms
    answer.finish(result)
    uploaded = list(result.uploaded)
    if request.is_chat_run and spec.exact and request.use_cache and not answer.cancelled:
        if board.follow_ups.worth_preparing() and not _waiting(work_waiting, request.request_id):
            uploaded += _prepare_next_turn(
                board, request.request_id, conversation, answer.text, options.namespace, breakdown
            )
        else:  # not prepared: still watched (its tokens only, under a millisecond), so the board learns whether it would have paid
            _watch_next_turn(board, conversation, answer.text)
    return RunReport(
        **sender(),
        request_id=request.request_id,
        meta=request.meta,
        prompt=prompt,
        text=answer.text,
        error=CANCELLED if answer.cancelled else "",
        tokens=result.tokens,
        breakdown=breakdown,
        fetched=result.fetched,
        uploaded=uploaded,
        modules_hit=result.modules_hit,
    )


def _cancelled_before_start(board, request: RunRequest, me, stream: StreamPublisher | None, cancel_flag) -> bool:
    """Whether the run's signed cancel flag was set before it started: its client left while it
    waited (a streamed run), or it was revoked while queued or re-sent elsewhere."""
    if stream is not None:
        return stream.cancelled.is_set() if cancel_flag is not UNREAD else stream.cancel_requested()
    if me is None or board.store is None:
        return False
    if cancel_flag is not UNREAD:
        return signed_cancel(me, request.request_id, cancel_flag)
    return signed_cancel_set(board.store, me, request.request_id)


def _run_options(request: RunRequest, answer: "_Answer") -> RunOptions:
    """The engine's options for ``request``: sampling, cache use, its namespace, the tokens it
    continues from, and the answer's callbacks where something listens to them."""
    streamed = answer.stream is not None
    return RunOptions(
        max_tokens=request.max_tokens,
        sampling=SamplingParams(**request.sampling.model_dump()),
        use_cache=request.use_cache,
        namespace=_namespace(request.namespace),
        approximate_from=dict(request.approximate_from),
        forced=answer.forced,
        on_token=answer.on_token if streamed or request.stop or answer.forced else None,
        on_stage=answer.stage if streamed and not request.is_schema_run else None,
    )


class _Answer:
    """One run's answer as its tokens are chosen: cut at its stop strings, continued from the tokens
    a re-sent run already gave its client (``forced``), published on its stream (None when not
    streamed) and stopped by its signed cancel flag; the stream's events are made here only."""

    def __init__(self, request: RunRequest, stream: StreamPublisher | None):
        self.request, self.stream = request, stream
        continues = request.continues
        self.forced: tuple[int, ...] = tuple(continues.tokens) if continues is not None else ()
        self._text = AnswerText(request.stop, already=len(continues.text) if continues is not None else 0)
        self.cancelled = False
        self._seen = 0  # answer tokens so far, the forced ones included
        self._unsent: list[int] = []  # ids chosen since the last token event (a re-sent run goes on from those)

    @property
    def text(self) -> str:
        return self._text.text

    def _event(self, type: str, **fields) -> StreamEvent:
        return StreamEvent(type=type, request_id=self.request.request_id, device=self.stream.device, **fields)

    def stage(self, stage: str) -> None:
        if self.stream is not None:
            started = stage == "started"
            self.stream.send(self._event("stage", stage=stage), now=started, unanswered=started)

    def on_token(self, token: int, piece: str) -> bool:
        """The engine chose ``token``: False stops the run (a stop string, or a cancel)."""
        self._seen += 1
        if self._seen > len(self.forced):
            self._unsent.append(token)
        released = self._text.add(piece)
        if released and self.stream is not None:
            self._send_token(released, first_now=True)
        if self._text.stopped:
            return False
        if self.stream is not None and self.stream.cancelled.is_set():
            self.cancelled = True
            return False
        return True

    def _send_token(self, text: str, first_now: bool = False) -> None:
        """A token event with the ids chosen since the last one (``first_now``: the first goes out from
        this thread at once, as a waiting client's first chunk depends on it)."""
        index = self.stream.count()  # takes the index
        ids, self._unsent = self._unsent, []
        self.stream.send(self._event("token", index=index, text=text, tokens=ids), now=first_now and index == 0)

    def failed(self, error: str) -> None:
        if self.stream is not None:
            self.stream.close(self._event("error", error=error[:10_000]))

    def finish(self, result) -> None:
        """The engine is done: the answer's last piece, its breakdown's continued tokens, and the
        stream's last token and ``done`` events."""
        tail = self._text.finish(result.text)
        breakdown = result.breakdown
        breakdown.continued_tokens = min(len(self.forced), breakdown.generated_tokens)
        if self.forced and result.tokens[: len(self.forced)] != list(self.forced):
            log.warning(
                "run %s: its answer ended inside the tokens it was given to continue from", self.request.request_id
            )
        if self.stream is None:
            return
        if tail and not self.cancelled:
            self._send_token(tail)
        if self.cancelled:
            finish = "cancelled"
        elif self._text.stopped or breakdown.generated_tokens < self.request.max_tokens:
            finish = "stop"
        else:
            finish = "length"
        extra = {"modules_hit": result.modules_hit} if result.modules_hit is not None else {}
        self.stream.close(
            self._event("done", text=self.text, finish_reason=finish, breakdown={**breakdown.as_dict(), **extra})
        )


def _asked(board, request: RunRequest, conversation: list[tuple[str, str]]) -> tuple[Prompt, str]:
    """What the strategy answers, and the prompt's text as the run records it (a chat's, templated).

    The prompt's tokens are the ones the control plane made to route it where its vocabulary is
    this board's (the same model file and llama.cpp: the very tokens this board would make);
    else, or where it sent none, the board tokenizes the prompt itself."""
    given = request.tokenized
    if given is not None and given.vocabulary != board.engine.digest:
        given = None  # made by another model's vocabulary: its tokens are not this board's
    if request.is_chat_run:
        if given is not None:
            text = chat_text(board.engine, conversation)
            return Prompt((text,), tuple(given.tokens), tuple(given.cuts)), text
        chat = chat_prompt(board.engine, conversation)
        return chat.prompt, chat.text
    if given is not None:
        return Prompt(tuple(request.segments), tuple(given.tokens), tuple(given.cuts)), request.prompt_text
    return Prompt(tuple(request.segments), schema=request.schema_source, pml=request.pml), request.prompt_text


def _watch_next_turn(board, conversation: list[tuple[str, str]], answer: str) -> None:
    """The answer is out and its next turn is not prepared: remember the prefix that turn would
    share (tokens only, no model work); failing to leaves the report as it is."""
    try:
        turn = follow_up(board.engine, conversation, answer)
    except (PromptError, ValueError, EngineError) as exc:
        log.warning("a chat turn's next prefix was not watched: %s", exc)
        return
    if turn is not None:
        board.follow_ups.watched(turn.tokens)


def _prepare_next_turn(
    board, request_id: str, conversation: list[tuple[str, str]], answer: str, namespace: str | None, breakdown
) -> list:
    """The answer is out: compute and share the next chat turn's shared prefix now; the entries it
    stored (none when it fails: this answer's report still goes to the control plane)."""
    try:
        turn = board.follow_up(conversation, answer, namespace=namespace)
    except (PromptError, ValueError, EngineError) as exc:
        log.warning("run %s: the next turn's prefix was not prepared: %s", request_id, exc)
        return []
    breakdown.next_turn_tokens, breakdown.next_turn_ms = turn.tokens, turn.total_ms
    board.follow_ups.prepared(turn.prefix)
    return list(turn.uploaded)


def messages_waiting(app, queues: Sequence[str]) -> int:
    """How many messages wait in ``queues`` of ``app``'s broker (a queue never used counts 0)."""
    from kombu.exceptions import ChannelError

    waiting = 0
    with app.pool.acquire(block=True, timeout=5) as connection:
        channel = connection.default_channel
        for name in queues:
            try:
                waiting += channel.queue_declare(queue=name, passive=True).message_count
            except ChannelError:  # no such queue yet: nothing waits in it
                continue
    return waiting


def board_work_waiting(within: float = 0.0) -> bool:
    """Whether a run or an encode waits for this board, in its own queue or its namespace's shared
    one, or lands in its own queue within ``within`` seconds (``work_arrives``)."""
    me = identity()
    return work_arrives(current_app, Queue.device(me.name), Queue.shared(me.record.cache_namespace), within)


def work_arrives(app, own: str, shared: str, within: float) -> bool:
    """Whether a message waits in queue ``own`` or ``shared`` of ``app``'s broker, or lands in ``own``
    within ``within`` seconds: a blocking BLMOVE from ``own`` to its own end, which wakes the moment
    a message lands and leaves it where it was, for the worker to take (looking every 20 ms
    instead made the next request wait 6 ms at p50). Without BLMOVE (Redis before 6.2, or an ACL
    that lacks it) it sleeps ``within`` and looks again."""
    if messages_waiting(app, [own, shared]) > 0:
        return True
    if within <= 0:
        return False

    with app.pool.acquire(block=True, timeout=5) as connection:
        landed = wait_in_queue(connection.default_channel.client, own, within)
    if landed is not None:
        return landed
    time.sleep(within)  # no BLMOVE here: look again after the wait
    return messages_waiting(app, [own, shared]) > 0


# A client that answers at once (a script, a chat app sending the next turn, another user of the
# API) sends its next request within tens of milliseconds of the answer: the board looks for it
# this long before it starts the speculative next-turn work, which would otherwise make that
# request wait (750-860 ms under load in `bench vs-server`, the system-prompt questions).
FOLLOW_UP_GRACE_S = 0.25
_GRACE_LOOK_S = (
    0.02  # each look blocks this long (woken at once by a run in its own queue), then the shared queue is looked at too
)


def _waiting(work_waiting: Callable[[float], bool] | None, request_id: str, grace_s: float = FOLLOW_UP_GRACE_S) -> bool:
    """Whether another run waits for this board, or arrives within ``grace_s`` (never raises:
    unknown counts as no)."""
    if work_waiting is None:
        return False
    deadline = time.monotonic() + grace_s
    try:
        while (
            not (waiting := bool(work_waiting(min(_GRACE_LOOK_S, max(0.0, deadline - time.monotonic())))))
            and time.monotonic() < deadline
        ):
            pass
    except Exception as exc:  # the broker unreachable: the next turn is prepared as usual
        log.warning("run %s: could not see whether work waits: %s", request_id, exc)
        return False
    if waiting:
        log.info("run %s: another run waits; the next turn's prefix is not prepared", request_id)
    return waiting


def encode(board, request: EncodeRequest, on_progress=None) -> EncodeReport:
    """Encode a schema's modules into the cache box; returns the report for the control plane."""
    base = dict(**sender(), request_id=request.request_id, schema_id=request.schema_id)
    try:
        result = board.schemas.encode_schema(
            request.schema_source, namespace=_namespace(request.namespace), progress=on_progress
        )
    except (ValueError, EngineError) as exc:
        return EncodeReport(**base, error=str(exc))
    except CacheBoxUnavailable as exc:
        return EncodeReport(**base, error=f"the cache box is unavailable: {exc}")
    return EncodeReport(**base, stored=result["stored"], skipped=result["skipped"], bytes=result["bytes"])


def _namespace(requested: str) -> str | None:
    """The namespace a message may use: on a board, its own (a foreign one is refused)."""
    me = enrollment.current()
    if me is None:  # not a board process (tests, commands): as asked
        return requested or None
    return me.check_namespace(requested)

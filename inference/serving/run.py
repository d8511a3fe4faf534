"""The run skeleton every serving strategy fills in, and what strategies share.

A strategy (prefix serving, schema serving, a lab strategy) is a ``Strategy``: ``run(prompt,
options)`` answers a ``Prompt`` under ``RunOptions`` and returns a ``RunResult`` whose
``Breakdown`` times every step. ``ServingStrategy.run`` is the skeleton, written once: check the
prompt, tokenize (``token_ms``), fit the context (``context_error``), restore or prefill up to the
first token's logits, choose it (``sample_ms``, ``ttft_ms``), decode the rest (``decode_answer``),
then keep what the run leaves (after the answer, off the TTFT path). A strategy supplies three
steps: ``prepare`` (tokenize), ``first_token`` (restore or prefill) and ``finish`` (keep).
Strategies are registered by name in ``inference.serving.strategies``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Protocol, Sequence, TypeVar

import numpy as np

from inference.contract.messages import StoredEntry
from inference.engine.llama import Engine
from inference.engine.sampling import TOP_CANDIDATES, SamplingParams, choose, sample
from inference.serving.breakdown import Breakdown, CacheBoxState, Decision


class PromptError(ValueError):
    """A prompt that cannot be run as given; the message says what to change."""


def ms_since(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def segment_tokens(vocabulary, segments: Sequence[str]) -> tuple[list[int], list[int]]:
    """Token ids of a prompt given as segments, and the index where each segment ends. Each
    segment is tokenized on its own (BOS before the first), so its tokens, and its cache key, do
    not depend on the text that follows it."""
    tokens: list[int] = []
    ends: list[int] = []
    for index, segment in enumerate(segments):
        tokens += vocabulary.tokenize(segment, add_bos=index == 0)
        ends.append(len(tokens))
    return tokens, ends


def text_layout(vocabulary, segments: Sequence[str]) -> tuple[list[int], tuple[int, ...]]:
    """A text prompt's tokens, and where its batches end besides the grid: where its last segment
    begins, and where the last paragraph of that segment begins (after its last blank line).

    A prompt that shares all but its last segment, or all but its last paragraph, with an earlier
    one then reuses that part whole, not only up to the grid point below it: five-shot examples
    before a question (373 tokens shared by two astronomy prompts, of which the grid alone reused
    256), a document before a request. The paragraph's cut is kept only where the text before it
    tokenizes to the very tokens the segment starts with, so the tokens never change. It costs at
    most one batch more than the grid's. The board (``PrefixServing.prepare``) and the control
    plane's router lay a prompt out with this one function, so their keys agree."""
    tokens, ends = segment_tokens(vocabulary, segments)
    cuts = set(ends[-2:-1])
    if segments:
        start = ends[-2] if len(ends) > 1 else 0
        last = segments[-1]
        found = last.rfind("\n\n")
        if found >= 0:
            end = found + 2
            while end < len(last) and last[end] == "\n":
                end += 1
            if last[end:].strip():
                head = vocabulary.tokenize(last[:end], add_bos=len(segments) == 1)
                cut = start + len(head)
                if start < cut < len(tokens) and tokens[start:cut] == head:
                    cuts.add(cut)
    return tokens, tuple(sorted(cuts))


def context_error(prompt_tokens: int, max_tokens: int, n_ctx: int) -> PromptError:
    return PromptError(
        f"the prompt has {prompt_tokens} tokens and {max_tokens} more were asked for, but the "
        f"context holds {n_ctx}; shorten the prompt, ask for fewer tokens, or raise EDGECACHE_N_CTX on the board"
    )


@dataclass
class RunResult:
    text: str
    tokens: list[int]
    breakdown: Breakdown
    # Cache-box entries this run used and stored, for the control plane's mirror.
    fetched: list[str] = field(default_factory=list)
    uploaded: list[StoredEntry] = field(default_factory=list)
    modules_hit: list[str] | None = None  # schema runs: the modules served from the cache box

    def as_dict(self) -> dict:
        extra = {"modules_hit": self.modules_hit} if self.modules_hit is not None else {}
        return {"text": self.text, **self.breakdown.as_dict(), **extra}


# Called with each answer token as it is chosen (the first one too) and the text it adds; returning
# False stops the generation there (a client that went away). Streaming builds on it.
OnToken = Callable[[int, str], bool]


# -- what a run is asked ------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """What a run answers: text segments (each tokenized on its own, where entries may be cut), a
    chat's token ids and the cuts where its turns begin (``inference.engine.chat``: the template's markup
    holds control tokens no text tokenizes to; ``segments`` is then its text), or a PML prompt and
    its schema."""

    segments: tuple[str, ...] = ()
    tokens: tuple[int, ...] | None = None
    cuts: tuple[int, ...] = ()
    schema: str = ""
    pml: str = ""

    @classmethod
    def of(
        cls, prompt: "str | Sequence[str] | Prompt", *, tokens: Sequence[int] | None = None, cuts: Sequence[int] = ()
    ) -> "Prompt":
        """A prompt given as its text or its segments (in order), with its tokens and cuts if known."""
        if isinstance(prompt, Prompt):
            return prompt
        segments = (prompt,) if isinstance(prompt, str) else tuple(prompt)
        return cls(segments, None if tokens is None else tuple(tokens), tuple(cuts))

    @property
    def is_schema(self) -> bool:
        return bool(self.schema)

    @property
    def text(self) -> str:
        """The prompt as a person reads it."""
        return self.pml if self.schema else "".join(self.segments)

    def check(self, max_tokens: int) -> None:
        """PromptError for a prompt with no text (unless its tokens are given) or no tokens asked for."""
        if not self.schema and self.tokens is None and not "".join(self.segments).strip():
            raise PromptError("the prompt is empty: give it some text")
        if max_tokens < 1:
            raise PromptError("max_tokens must be at least 1")


@dataclass(frozen=True)
class RunOptions:
    """How to run it. Approximate (lab) strategies use only ``max_tokens``, ``sampling`` and
    ``on_token``: they never read or write a cache."""

    max_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    use_cache: bool = True
    namespace: str | None = None  # None: the strategy's own
    upload: bool = True  # False: leave the cache box as it was (benchmarks measure one state many ways)
    use_catalog: bool = (
        True  # False: ask the cache box about every candidate range, as a design without a catalog would
    )
    on_token: OnToken | None = None  # sees each answer token as it is chosen (streaming) and may stop the generation
    on_stage: Callable[[str], None] | None = None  # hears "fetching" and "prefilling" as a prefix run starts them
    # Approximate sharing across kernel classes (a namespace's choice, off by default): {fingerprint: kernel class} of
    # the same model computed by other kernels. Where the board's own entries miss, a state one of them stored may be
    # restored; the run then says so (``Breakdown.approximate``) and keeps nothing it computed on top of it.
    approximate_from: dict[str, str] = field(default_factory=dict)
    # The answer's first tokens, given (another board chose them before it stopped): each is
    # decoded as the cold run decoded it, one per step, and the sampler draws as it would have, so
    # the tokens after them are the cold run's (under greedy decoding, or the same seed).
    forced: tuple[int, ...] = ()


class Strategy(Protocol):
    """A way of answering prompts on a board (registered by name in ``inference.serving.strategies``)."""

    label: str  # what its runs' ``Breakdown.strategy`` says: "" for exact serving
    approximate: bool  # True: its answers are not the cold run's, and it never touches the cache box

    def run(self, prompt: Prompt, options: RunOptions) -> RunResult:
        """Answer ``prompt``; raises PromptError (or another ValueError) for a run that cannot be served."""

    def close(self) -> None:
        """Free what the strategy loaded (a second model, a reference engine)."""


# -- the skeleton ------------------------------------------------------------------------------
@dataclass
class RunState:
    """One run as the skeleton hands it to a strategy's steps."""

    prompt: Prompt
    options: RunOptions
    breakdown: Breakdown
    started: float  # perf_counter() when the run began: TTFT and TTLT count from here


@dataclass
class FirstToken:
    """Where the first answer token comes from (the prompt's last logits, or the top candidates an
    entry stored with them), where it goes, and what decodes the rest."""

    logits: np.ndarray | None
    stored: tuple[np.ndarray, np.ndarray] | None = None  # (ids, logits) when ``logits`` is None
    position: int = 0
    decoder: object = None  # what decodes the rest (``decode_answer``'s engine); None: the strategy's engine

    def choose(self, sampling: SamplingParams, rng, top: int) -> int:
        if self.logits is not None:
            return choose(self.logits, sampling, rng, top)
        return sample(*self.stored, sampling, rng)


Prepared = TypeVar("Prepared")


class ServingStrategy(Generic[Prepared]):
    """The run skeleton: a strategy is this with its three steps filled in.

    ``prepare(run)`` tokenizes (timed as ``token_ms``) and returns what the later steps need,
    with ``prompt_tokens`` (what must fit the context); ``first_token(run, prepared)`` restores
    or prefills until the first token's logits; ``finish(run, prepared, first, result)`` keeps
    what the run leaves, after the answer. Every step runs under the engine's lock.
    """

    engine: Engine
    label = ""
    approximate = False
    top = TOP_CANDIDATES  # candidates kept when choosing a token
    clears_context = (
        False  # True: the engine's context is cleared before and after (an approximate state must not stay)
    )

    def run(self, prompt: "Prompt | str | Sequence[str]", options: RunOptions | None = None, /, **fields) -> RunResult:
        """Answer ``prompt`` (a ``Prompt``, or its text or segments, with ``tokens=`` and ``cuts=``
        as keywords) under ``options`` (a ``RunOptions``, or its fields as keywords)."""
        if not isinstance(prompt, Prompt):
            prompt = Prompt.of(prompt, tokens=fields.pop("tokens", None), cuts=fields.pop("cuts", ()))
        if options is None:
            options = RunOptions(**fields)
        elif fields:
            raise TypeError(f"run() takes options or their fields, not both ({', '.join(fields)})")
        prompt.check(options.max_tokens)
        engine = self.engine
        with engine.lock:
            breakdown = self.new_breakdown()
            started = time.perf_counter()
            run = RunState(prompt, options, breakdown, started)
            prepared = self.prepare(run)
            breakdown.token_ms = ms_since(started)
            prompt_tokens = breakdown.prompt_tokens = prepared.prompt_tokens
            if prompt_tokens + options.max_tokens > engine.n_ctx:
                raise context_error(prompt_tokens, options.max_tokens, engine.n_ctx)
            if self.clears_context:
                engine.clear()  # no exact run may keep or find an approximate cell
            try:
                first = self.first_token(run, prepared)
                rng = np.random.default_rng(options.sampling.seed)
                mark = time.perf_counter()
                token = first.choose(options.sampling, rng, self.top)
                if options.forced:
                    token = options.forced[0]
                breakdown.sample_ms = breakdown.first_sample_ms = ms_since(mark)
                breakdown.ttft_ms = ms_since(started)
                decoder = first.decoder if first.decoder is not None else engine
                generated, text = decode_answer(
                    decoder,
                    token,
                    first.position,
                    options.max_tokens,
                    options.sampling,
                    rng,
                    breakdown,
                    started,
                    self.top,
                    options.on_token,
                    forced=options.forced,
                )
            finally:
                if self.clears_context:
                    engine.clear()
            result = RunResult(text, generated, breakdown)
            self.finish(run, prepared, first, result)
            return result

    def new_breakdown(self) -> Breakdown:
        """An approximate strategy's runs are labelled and never read or write the cache box."""
        if not self.approximate:
            return Breakdown()
        breakdown = Breakdown(strategy=self.label)
        breakdown.cache_off(CacheBoxState.OFF, Decision.NO_CACHE)
        return breakdown

    def prepare(self, run: RunState) -> Prepared:
        raise NotImplementedError

    def first_token(self, run: RunState, prepared: Prepared) -> FirstToken:
        raise NotImplementedError

    def finish(self, run: RunState, prepared: Prepared, first: FirstToken, result: RunResult) -> None:
        """After the answer: what the run leaves (entries to store, a context to keep). Nothing by default."""

    def close(self) -> None:
        pass


@dataclass
class Tokens:
    """A prompt as token ids (what ``prepare`` returns for a strategy that needs nothing else)."""

    tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)


def prompt_tokens(vocabulary, prompt: Prompt) -> list[int]:
    """The token ids of ``prompt``: its own (a chat's), or its segments' (``segment_tokens``)."""
    return list(prompt.tokens) if prompt.tokens is not None else segment_tokens(vocabulary, prompt.segments)[0]


# -- the decode loop ---------------------------------------------------------------------------
class _TextPieces:
    """The text each new token adds (multi-byte characters complete once their last byte arrives)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.engine.detokenize(self.tokens)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the rest
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece


def decode_answer(
    engine: Engine,
    token: int,
    position: int,
    max_tokens: int,
    sampling: SamplingParams,
    rng,
    breakdown: Breakdown,
    started: float,
    top: int = TOP_CANDIDATES,
    on_token: OnToken | None = None,
    forced: Sequence[int] = (),
) -> tuple[list[int], str]:
    """Decode the answer after its first token (R-decode + Sample), stopping at end of generation.

    Fills ``decode_ms``, ``sample_ms``, ``ttlt_ms``, ``generated_tokens`` and the time between
    answer tokens (``tbt_p50_ms``, ``tbt_p99_ms``: from one token chosen to the next, the
    ``on_token`` hook included, as a streaming client sees them); returns the answer's tokens
    (without the end-of-generation token) and its text. ``on_token`` sees each token as it is
    chosen and may stop the generation. ``forced``: the answer's first tokens, taken instead of the
    ones chosen (``RunOptions.forced``; ``token`` is the first of them); ``on_token`` sees them too.
    """
    generated = [token]
    between: list[float] = []  # ms from one answer token chosen to the next
    pieces = _TextPieces(engine) if on_token is not None else None
    going = True
    if pieces is not None and not engine.is_end_of_generation(token):
        going = on_token(token, pieces.add(token)) is not False
    last = time.perf_counter()
    while going and len(generated) < max_tokens and not engine.is_end_of_generation(token):
        mark = time.perf_counter()
        logits = engine.decode_one(token, position)
        breakdown.decode_ms += ms_since(mark)
        position += 1
        mark = time.perf_counter()
        token = choose(
            logits, sampling, rng, top
        )  # drawn for a forced token too: the sampler's draws stay the cold run's
        if len(generated) < len(forced):
            token = forced[len(generated)]
        breakdown.sample_ms += ms_since(mark)
        generated.append(token)
        if engine.is_end_of_generation(token):
            break  # not an answer token: no time between tokens to count
        if pieces is not None:
            going = on_token(token, pieces.add(token)) is not False
        now = time.perf_counter()
        between.append((now - last) * 1000.0)
        last = now
    breakdown.ttlt_ms = ms_since(started)
    if between:
        breakdown.tbt_p50_ms, breakdown.tbt_p99_ms = (float(value) for value in np.percentile(between, [50, 99]))
    if engine.is_end_of_generation(generated[-1]):
        generated.pop()
    breakdown.generated_tokens = len(generated)
    return generated, engine.detokenize(generated)

"""What boards and the control plane say to each other: one typed definition of each message.

Every message crosses the broker as JSON (never pickle), inside a signed envelope that seals
what a tenant wrote (``inference.contract.envelope``), and is validated where it is received
(``Message.receive``): a malformed or unknown message is refused with a logged reason and never
reaches the code that acts on it, so no worker crashes on a bad dict.
Queue and task names are enums here; the run's own words (case, decision, cache-box
state) are enums of ``inference.serving.breakdown``.

Control plane -> board: ``RunRequest``, ``EncodeRequest`` (on ``device.NAME`` or the namespace's
``boards.NS``), sealed and signed by the control plane.
Board -> control plane (queue ``control``): ``RunReport``, ``EncodeProgress``, ``EncodeReport``
(sealed) and ``Heartbeat``, each signed by the board, and once ``EnrollRequest`` (signed with the
token's key); on a streamed run's pub/sub channel: ``StreamEvent`` (sealed, signed by the board).
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from cachebox.events import security_event
from inference.contract.envelope import CONTROL, Kind, open_envelope, peek
from inference.serving.breakdown import Breakdown, Case, Decision  # noqa: F401 (re-exported: the run's words)
from inference.serving.strategies import parse_strategy

# Bounds that keep a hostile message from costing memory before it is refused.
MAX_PROMPT_CHARS = 1_000_000
MAX_SEGMENTS = 10_000
MAX_TOKENS = 32_768
MAX_PROMPT_TOKENS = (
    131_072  # a prompt's tokens a request carries (a longer one fits no board's context: its board tokenizes it)
)
MAX_LIST = 100_000
MAX_STOPS = 4  # stop strings per run (OpenAI's limit)
MAX_STOP_CHARS = 200
CANCELLED = (
    "cancelled by the client"  # a run's error when its client cancelled it (its text: what was answered until then)
)

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_UUID = r"^[0-9a-fA-F-]{32,36}$"


class Queue(StrEnum):
    CONTROL = "control"  # the control plane's worker: reports, heartbeats, progress
    SHARED = "boards"  # work any board of a namespace may take: ``boards.NS``

    @staticmethod
    def device(name: str) -> str:
        """A board's own queue."""
        return f"device.{name}"

    @staticmethod
    def shared(namespace: str) -> str:
        """The queue any board of ``namespace`` takes work from (boards of other tenants cannot read it)."""
        return f"boards.{namespace}"


class Task(StrEnum):
    # control plane -> boards
    RUN_PROMPT = "edgecache.run_prompt"
    ENCODE_SCHEMA = "edgecache.encode_schema"
    AUDIT_ENTRY = "edgecache.audit_entry"  # recompute a hit cold and compare (AuditRequest)
    # boards -> control plane
    RECORD_RUN = "edgecache.record_run"
    HEARTBEAT = "edgecache.heartbeat"
    ENCODE_PROGRESS = "edgecache.encode_progress"
    ENCODED = "edgecache.encoded"
    ENROLL = "edgecache.enroll"
    RECORD_AUDIT = "edgecache.record_audit"  # an audit's verdict (AuditReport)


CONTROL_TASKS = (Task.RECORD_RUN, Task.ENCODE_PROGRESS, Task.ENCODED, Task.ENROLL, Task.RECORD_AUDIT)


class MessageRefused(ValueError):
    """A message that does not follow the contract; the text says which field and why."""


class Message(BaseModel):
    """Base of every message: unknown fields are refused, values are checked, instances frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_max_length=MAX_PROMPT_CHARS)

    @classmethod
    def parse(cls, raw: Any) -> Self:
        """The message in ``raw`` (a dict from the broker), or MessageRefused saying what is wrong."""
        if not isinstance(raw, dict):
            raise MessageRefused(f"{cls.__name__} must be a JSON object, got {type(raw).__name__}")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'message'}: {err['msg']}" for err in exc.errors()[:5]
            )
            raise MessageRefused(f"malformed {cls.__name__}: {problems}") from None

    @classmethod
    def receive(cls, raw: Any, *, receiver: str) -> Self | None:
        """``parse`` at a boundary: None (and one security-log line) for a refused message."""
        try:
            return cls.parse(raw)
        except MessageRefused as exc:
            sender = raw.get("device") if isinstance(raw, dict) and isinstance(raw.get("device"), str) else None
            security_event(
                "message_refused",
                message=cls.__name__,
                receiver=receiver,
                device=(sender or "")[:64],
                reason=str(exc)[:500],
            )
            return None

    def dump(self) -> dict:
        """The JSON-ready dict that travels."""
        return self.model_dump(mode="json", by_alias=True)


# -- control plane -> board ------------------------------------------------------------------


class SamplingSpec(Message):
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_k: int = Field(40, ge=1, le=1_000_000)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)


class RunMeta(Message):
    """Where a run came from, carried through the board back to the control plane."""

    source: str = Field("text", max_length=32)
    title: str = Field("", max_length=200)
    expected_answer: str = Field("", max_length=16)
    received_at: float = Field(
        0.0, ge=0
    )  # the control plane's clock when the request arrived (the API's); 0: when it was sealed


class ChatMessage(Message):
    """One turn of a conversation; the board renders them through the model's chat template."""

    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)

    @field_validator("content")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("a message needs some text")
        return value


class Continuation(Message):
    """An answer another board began and stopped (killed, paused): its tokens, which this board
    takes as the answer's forced beginning (decoded one by one as the cold run decoded them, so
    what follows is the cold run's), and the text its client already has (not streamed again)."""

    tokens: list[int] = Field(default_factory=list, max_length=MAX_TOKENS)
    text: str = ""
    device: str = Field("", max_length=64)  # the board that began it


class PromptTokens(Message):
    """A prompt's tokens and where its batches end besides the grid, as the control plane made them
    to route it (``dashboard.router.prompt_tokens``: a text's ``text_layout``, a chat's
    ``chat_prompt``), named by the vocabulary that made them (``Vocabulary.digest``: the model file
    and the llama.cpp that reads it). A board whose own vocabulary is that one takes them instead of
    tokenizing again; any other board tokenizes the prompt itself."""

    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    cuts: list[int] = Field(default_factory=list, max_length=MAX_SEGMENTS)
    vocabulary: str = Field(pattern=r"^[0-9a-f]{16}$")

    @model_validator(mode="after")
    def _cuts_inside(self) -> Self:
        if any(not 0 < cut < len(self.tokens) for cut in self.cuts) or any(
            a >= b for a, b in zip(self.cuts, self.cuts[1:])
        ):
            raise ValueError(f"cuts rise strictly, inside the prompt's {len(self.tokens)} tokens")
        return self


class RunRequest(Message):
    """A prompt to answer: its segments (cut where entries may be stored), chat messages (rendered
    and tokenized by the board, ``inference.engine.chat``), or a PML prompt and its schema.

    ``stream``: publish each answer token, and a last ``done`` event, on the run's pub/sub channel
    (``StreamEvent``; the OpenAI-compatible API listens there), and stop when the run's cancel
    flag is set. ``stop``: end the answer where its text first contains one of these (the stop
    string itself is not part of the answer).
    """

    request_id: str = Field(pattern=_UUID)
    segments: list[str] = Field(default_factory=list, max_length=MAX_SEGMENTS)
    messages: list[ChatMessage] = Field(default_factory=list, max_length=MAX_SEGMENTS)
    schema_source: str = Field("", alias="schema")
    pml: str = ""
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS)
    sampling: SamplingSpec = SamplingSpec()
    use_cache: bool = True
    namespace: str = Field("", pattern=r"^$|" + _NAME)
    meta: RunMeta = RunMeta()
    stream: bool = False
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS)
    # "" (exact serving) or a lab strategy (approximate; never uses the cache box), as
    # ``inference.serving.strategies.parse_strategy`` reads it: "kv-prediction:K", "anchors", ...
    strategy: str = Field("", max_length=64)
    # The namespace shares states across kernel classes (off by default, approximate): {fingerprint: kernel class} of
    # the same model computed by other kernels, whose entries the board may restore where its own miss.
    approximate_from: dict[str, str] = Field(default_factory=dict, max_length=8)
    # A run re-sent to this board after its first board stopped mid-answer: go on from there.
    continues: Continuation | None = None
    # The prompt's tokens as the control plane made them to route it (a text or chat prompt).
    tokenized: PromptTokens | None = None

    model_config = ConfigDict(populate_by_name=True)

    @field_validator("approximate_from")
    @classmethod
    def _other_classes(cls, value: dict[str, str]) -> dict[str, str]:
        for fingerprint, kernel_class in value.items():
            if not re.fullmatch(r"[0-9a-f]{1,32}", fingerprint) or not re.fullmatch(
                r"[a-z0-9_][a-z0-9_.+-]{0,63}", kernel_class
            ):
                raise ValueError(
                    "approximate_from maps model fingerprints (hex) to kernel classes such as 'x86_64-avx2'"
                )
        return value

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        parse_strategy(value)  # ValueError saying what to write
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str]) -> list[str]:
        for stop in value:
            if not stop or len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has 1 to {MAX_STOP_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _one_kind_of_prompt(self) -> Self:
        kinds = [
            name
            for name, given in (
                ("segments", self.segments),
                ("messages", self.messages),
                ("schema", self.schema_source),
            )
            if given
        ]
        if len(kinds) > 1:
            raise ValueError(f"a run has one kind of prompt, got {' and '.join(kinds)}")
        if self.schema_source and not self.pml:
            raise ValueError("a schema run needs its PML prompt ('pml')")
        if self.schema_source and self.strategy not in ("", "exact"):
            raise ValueError("a schema run serves exact modules: it takes no lab strategy")
        if self.tokenized is not None and self.schema_source:
            raise ValueError("a schema run's prompt is laid out by its board: it carries no tokens")
        if self.continues is not None and len(self.continues.tokens) >= self.max_tokens:
            raise ValueError(
                f"a continued answer forces fewer tokens than max_tokens ({self.max_tokens}), got {len(self.continues.tokens)}"
            )
        if self.messages:
            if sum(len(message.content) for message in self.messages) > MAX_PROMPT_CHARS:
                raise ValueError(f"the messages are over {MAX_PROMPT_CHARS} characters")
            return self
        if not self.schema_source and not "".join(self.segments).strip():
            raise ValueError("the prompt is empty: give it some text")
        if sum(len(segment) for segment in self.segments) > MAX_PROMPT_CHARS:
            raise ValueError(f"the prompt is over {MAX_PROMPT_CHARS} characters")
        return self

    def dump(self) -> dict:
        body = super().dump()
        for optional in (
            "continues",
            "tokenized",
        ):  # what some runs carry (boards of the version before know no such field)
            if body.get(optional) is None:
                body.pop(optional, None)
        return body

    @property
    def is_schema_run(self) -> bool:
        return bool(self.schema_source)

    @property
    def is_chat_run(self) -> bool:
        return bool(self.messages)

    @property
    def prompt_text(self) -> str:
        """The prompt as the control plane shows it."""
        if self.schema_source:
            return self.pml
        if self.messages:
            return "\n".join(f"{message.role}: {message.content}" for message in self.messages)
        return "".join(self.segments)


class EncodeRequest(Message):
    """Encode every module of a schema into the cache box."""

    request_id: str = Field(pattern=_UUID)
    schema_id: int | None = None
    schema_source: str = Field(alias="schema", min_length=1)
    namespace: str = Field("", pattern=r"^$|" + _NAME)

    model_config = ConfigDict(populate_by_name=True)


# -- board -> control plane ------------------------------------------------------------------


class StoredEntry(Message):
    """One entry a board stored in the cache box (the control plane mirrors it)."""

    name: str = Field(max_length=200)
    namespace: str = Field(pattern=_NAME)
    model: str = Field(pattern=r"^[0-9a-f]{1,32}$")
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    bytes: int = Field(ge=0)
    piece: str = Field("", max_length=200)  # a schema module's path; "" for a prefix range

    @model_validator(mode="after")
    def _range(self) -> Self:
        if self.start >= self.end:
            raise ValueError(f"empty range [{self.start}, {self.end})")
        return self


class BoardMessage(Message):
    """What every board message names: the board that sends it. It travels in an envelope the
    board signs (``inference.contract.envelope``), whose sender must be this device; no secret: a reader of
    the broker learns nothing that lets it act as the board."""

    device: str = Field(pattern=_NAME)


class EnrollRequest(Message):
    """A board's public keys and its Redis password's hash, sent once, signed with the key the
    device's token gives (``inference.board.identity.enrollment_key``)."""

    device: str = Field(pattern=_NAME)
    signing_public_key: str = Field(pattern=r"^[0-9a-f]{64}$")
    box_public_key: str = Field(pattern=r"^[0-9a-f]{64}$")
    redis_password_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    ts: float
    proof: str = Field(pattern=r"^[A-Za-z0-9+/]{86}==$")  # an Ed25519 signature, base64


class RunReport(BoardMessage):
    """The answer to one RunRequest (or why there is none)."""

    request_id: str = Field(pattern=_UUID)
    meta: RunMeta = RunMeta()
    prompt: str = ""
    text: str = ""
    error: str = Field("", max_length=10_000)
    tokens: list[int] = Field(default_factory=list, max_length=MAX_TOKENS)
    breakdown: Breakdown = Field(default_factory=Breakdown)
    fetched: list[str] = Field(default_factory=list, max_length=MAX_LIST)
    uploaded: list[StoredEntry] = Field(default_factory=list, max_length=MAX_LIST)
    modules_hit: list[str] | None = None

    @field_validator("breakdown", mode="before")
    @classmethod
    def _known_fields(cls, value):
        # Boards of another version may add fields; the ones this side knows are checked (types too).
        if isinstance(value, dict):
            return {key: item for key, item in value.items() if key in Breakdown.__dataclass_fields__}
        return value

    @classmethod
    def for_request(cls, request: RunRequest, *, device: str, error: str = "") -> "RunReport":
        """The report of a request that did not run (refused, expired, failed)."""
        return cls(
            device=device, request_id=request.request_id, meta=request.meta, prompt=request.prompt_text, error=error
        )


class AuditRequest(Message):
    """Recompute one cache entry cold and compare it bit for bit: ``run`` is the request whose run
    hit the entry (its prompt gives the entry's tokens), ``entry`` the entry's name."""

    request_id: str = Field(pattern=_UUID)
    entry: str = Field(max_length=200)
    run: RunRequest


AuditVerdict = Literal["match", "mismatch", "refused", "gone", "inconclusive"]


class AuditReport(BoardMessage):
    """An audit's verdict: ``producer`` is the board the entry's verified signature names ("" when
    it was refused before that); the digests are SHA-256 of the entry's state and of the cold one."""

    request_id: str = Field(pattern=_UUID)
    entry: str = Field(max_length=200)
    verdict: AuditVerdict
    producer: str = Field("", max_length=64)
    detail: str = Field("", max_length=500)
    entry_state_sha256: str = Field("", pattern=r"^$|^[0-9a-f]{64}$")
    cold_state_sha256: str = Field("", pattern=r"^$|^[0-9a-f]{64}$")


class StreamEvent(Message):
    """What a board publishes on a streamed run's channel (``cachebox.keys.stream_channel``): each
    answer piece as it is chosen (``token``), then one ``done`` (the answer's text, why it ended,
    its breakdown) or ``error``; before the first token, ``stage`` events say how far the board is
    (``started``: it took the run off its queue; lookup, fetch and prefill follow). Each travels
    sealed and signed by the board (``inference.contract.envelope``); a reader accepts events only from the
    board the run was dispatched to. The RunReport that follows on the control queue stays the
    record; these carry the answer to a waiting client sooner."""

    type: Literal["token", "done", "error", "stage", "resent"]  # resent: the control plane moved the run to ``device``
    request_id: str = Field(pattern=_UUID)
    device: str = Field("", max_length=64)
    index: int = Field(0, ge=0)  # token events: 0, 1, 2, ...
    text: str = ""  # token: the piece; done: the whole answer
    # token events: the ids of the answer tokens chosen since the last token event (its text, or
    # text still held back at a stop string's possible start); a re-sent run continues from them
    tokens: list[int] = Field(default_factory=list, max_length=MAX_TOKENS)
    finish_reason: Literal["", "stop", "length", "cancelled"] = ""
    error: str = Field("", max_length=10_000)
    breakdown: dict[str, Any] = Field(default_factory=dict)
    stage: Literal["", "started", "fetching", "prefilling", "waiting"] = (
        ""  # stage events, in this order (a run may skip some)
    )
    # "waiting": the control plane's word that the run's board went quiet and the run waits for it (``error``: why)

    def compact(self) -> dict:
        """The fields that differ from their defaults (what travels)."""
        return self.model_dump(mode="json", exclude_defaults=True)

    @classmethod
    def open(
        cls, data: bytes | str, *, request_id: str, signer_public_key: str, ring_for, control_plane_key: str = ""
    ) -> "StreamEvent":
        """The event published on a run's channel, if the board ``signer_public_key`` names sealed
        and signed it for run ``request_id`` (or, with ``control_plane_key``, the control plane did:
        a run it re-sent or gave up on); MessageRefused (with why) for anything else."""

        try:
            envelope = json.loads(data)
            signer = control_plane_key if control_plane_key and peek(envelope)["from"] == CONTROL else signer_public_key
            message, _ = open_envelope(
                envelope, kind=Kind.STREAM, to=request_id, signer_public_key=signer, ring_for=ring_for
            )
        except (ValueError, UnicodeDecodeError) as exc:  # EnvelopeRefused is a ValueError
            raise MessageRefused(f"StreamEvent refused: {exc}") from None
        event = cls.parse(message)
        if event.request_id != request_id:
            raise MessageRefused("StreamEvent refused: it names another run")
        return event


class EncodeProgress(BoardMessage):
    request_id: str = Field(pattern=_UUID)
    schema_id: int | None = None
    done: int = Field(ge=0)
    total: int = Field(ge=0)
    piece: str = Field("", max_length=200)


class EncodeReport(BoardMessage):
    request_id: str = Field(pattern=_UUID)
    schema_id: int | None = None
    error: str = Field("", max_length=10_000)
    stored: list[StoredEntry] = Field(default_factory=list, max_length=MAX_LIST)
    skipped: list[str] = Field(default_factory=list, max_length=MAX_LIST)
    bytes: int = Field(0, ge=0)


class CatalogStatus(Message):
    """One catalog replica of a board, as its heartbeat reports it (``Board.status``)."""

    approx_items: int = Field(0, ge=0)
    size_bytes: int = Field(0, ge=0)
    fill_ratio: float = Field(0.0, ge=0.0, le=1.0)
    estimated_fp_rate: float = Field(0.0, ge=0.0, le=1.0)
    configured_fp_rate: float = Field(0.0, ge=0.0, le=1.0)
    last_sync: float | None = None
    epoch: str = Field("", max_length=64)
    # its lookup counters (cachebox.catalog.CatalogStats)
    lookups: int = Field(0, ge=0)
    maybe_hits: int = Field(0, ge=0)
    true_hits: int = Field(0, ge=0)
    false_positives: int = Field(0, ge=0)
    # maybes never asked about, by why (None: a board of a version that does not count them)
    held_on_board: int | None = Field(None, ge=0)  # the board's own tiers held them
    policy_skipped: int | None = Field(None, ge=0)  # the break-even policy chose computing
    cachebox_down: int | None = Field(None, ge=0)  # the cache box did not answer


class BoardRates(Message):
    """What a board measured of itself when it started (``inference.board.runtime.calibrate``): the router
    weighs a board by these until its own runs say better, never by the fleet-wide prior."""

    prefill_ms_per_token: float = Field(gt=0, le=100_000)
    decode_ms_per_token: float = Field(gt=0, le=1_000_000)
    prompt_tokens: int = Field(0, ge=0, le=MAX_TOKENS)  # the calibration's prompt length
    decode_tokens: int = Field(0, ge=0, le=MAX_TOKENS)  # decode steps it timed
    compute_profile: str = Field("", max_length=100)  # the class its model work is paced to ("": this machine)


class TierStatus(Message):
    """A board's RAM or flash tier, as its heartbeat reports it (``status()`` of inference.tiers)."""

    entries: int = Field(0, ge=0)
    bytes: int = Field(0, ge=0)
    budget_bytes: int | None = Field(None, ge=0)
    hits: int = Field(0, ge=0)
    misses: int = Field(0, ge=0)
    rss_limit_bytes: int | None = Field(None, ge=0)  # RAM tier: the RSS it keeps entries under
    evicted_for_rss: int = Field(0, ge=0)
    refused: int = Field(0, ge=0)
    directory: str = Field("", max_length=1024)  # flash tier: where its files are


class BoardMemory(Message):
    """A board process's memory now and at its peak, against what the board registered (``Board.memory``)."""

    rss_mb: float | None = Field(None, ge=0)
    peak_rss_mb: float | None = Field(None, ge=0)
    pss_mb: float | None = Field(None, ge=0)
    memory_mb: int | None = Field(None, ge=0)
    budget_mb: float | None = Field(None, ge=0)
    n_ctx: int | None = Field(None, ge=0)
    kv_cache_mb: float | None = Field(None, ge=0)  # the memory plan's KV cache: what a smaller context frees


# A board reports one catalog per namespace it serves (its own, a private one): a few, never thousands.
MAX_BOARD_CATALOGS = 64
# The largest heartbeat a receiver reads (its signed envelope as it travels, in bytes). A real one is
# about 1-2 KB (64 catalogs: about 25 KB); anything larger is refused before it is parsed.
MAX_HEARTBEAT_BYTES = 64 * 1024
_NAMESPACE_KEY = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class BoardStatus(Message):
    """What a heartbeat says of its board. Every field is named and bounded (nested ones too), and an
    unknown one refuses the whole heartbeat: a board can store nothing else in ``Device.status``."""

    pid: int = Field(0, ge=0, le=2**31)
    sent: float = Field(0.0, ge=0.0)
    model: str = Field("", max_length=200)
    fingerprint: str = Field("", pattern=r"^$|^[0-9a-f]{1,32}$")
    kernel_class: str = Field(
        "", pattern=r"^$|^[a-z0-9_][a-z0-9_.+-]{0,63}$"
    )  # its llama.cpp's kernels (inference.engine.kernels)
    threads: int = Field(0, ge=0, le=4096)
    heartbeat_s: float = Field(5.0, gt=0, le=3600)  # how often it beats (the control plane counts missed ones)
    catalogs: dict[_NAMESPACE_KEY, CatalogStatus] = Field(default_factory=dict, max_length=MAX_BOARD_CATALOGS)
    rates: BoardRates | None = None  # its measured prefill and decode rates (None: a board of an older version)
    ram_tier: TierStatus | None = None
    flash_tier: TierStatus | None = None
    kv_type: str = Field("", max_length=16)
    codec: str = Field("", max_length=32)
    compute_profile: str = Field("", max_length=100)  # the class its model work is paced to ("": this machine)
    memory: BoardMemory | None = None
    simulated: bool = False  # a board of ``bench fleet-sim``


class Heartbeat(BoardMessage):
    status: BoardStatus = BoardStatus()


# What each inbox may carry: a board's own (``ec:inbox:NAME``) its reports, progress and encoding
# results; a device's enrollment inbox (``ec:enroll:NAME``) its enrollment. Heartbeats have a key
# of their own (``ec:hb:NAME``). Nothing else is ever run for a message from a board.
BOARD_INBOX_TASKS = frozenset({Task.RECORD_RUN, Task.ENCODE_PROGRESS, Task.ENCODED, Task.RECORD_AUDIT})
ENROLL_INBOX_TASKS = frozenset({Task.ENROLL})
MAX_INBOX_MESSAGE_BYTES = 8 * 1024 * 1024  # a sealed report of the longest prompt and answer fits


class InboxMessage(Message):
    """One message on an inbox: which of EdgeCache's own messages it is, and its signed envelope
    (``body``), checked by the receiver of that message (``dashboard.actions``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: Task
    body: dict

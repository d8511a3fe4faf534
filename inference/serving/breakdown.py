"""The timing breakdown of one run: the single record used by the engine, the tasks,
the InferenceRun model and the charts (the paper's table 3 columns and more).

The words a run is described with (its case, what the cache box said, the decision
taken) are enums here, and the chart stack order with its labels is ``STACK``: every
other place (models, charts, ``live.js`` through the page, reports) reads them from here.
TTFT and TTLT as the sums of their parts (table 3's groups and "other") are ``time_sums``; the
run page's headings for every field are ``FIELD_GROUPS``.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from decimal import ROUND_HALF_UP, Decimal
from enum import StrEnum


class Case(StrEnum):
    """How much of the prompt a cache served."""

    MISS = "miss"
    PARTIAL = "partial"
    FULL = "full"


class CacheBoxState(StrEnum):
    OK = "ok"
    UNAVAILABLE = "unavailable"  # down, or it answered with an error: the run prefilled locally
    OFF = "off"  # the run asked for no cache
    NO_KEY = "no-key"  # this board holds no signing key for the namespace


class Tier(StrEnum):
    """Where the furthest restored part of the prompt came from, nearest first."""

    NONE = ""  # computed
    CONTEXT = "context"  # the board's own last sequence: no copy at all
    LOCAL = "local"  # the board's RAM tier: no network
    FLASH = "flash"  # the board's flash tier (its own disk): no network
    CACHEBOX = "cachebox"  # fetched over the link


class Decision(StrEnum):
    """Why a run fetched or not."""

    NONE = ""
    CATALOG_MISS = "catalog-miss"  # a sure miss: no network at all
    FETCH = "fetch"
    LOCAL = "local"  # served from the board's own context or RAM: no lookup over the network needed
    POLICY_SKIP = "policy-skip"  # recomputing was forecast to be faster on this board and link
    DEADLINE = "deadline"  # the fetch ran slower than forecast: the board stopped waiting and computed the rest
    NO_USABLE_ENTRY = "no-usable-entry"  # catalog "maybe"s, but nothing complete and valid was there
    CACHEBOX_UNAVAILABLE = "cachebox-unavailable"
    NO_CACHE = "no-cache"
    NO_SIGNING_KEY = "no-signing-key"
    MODULES = "modules"  # schema serving: modules from the cache box, the rest computed


# Where a prompt's tokens came from, nearest first, in the words every page, chart and metric uses:
# (short label, where), and the breakdown field that counts a tier's tokens.
TIER_WORDS = {
    Tier.CONTEXT: ("context", "the board's own context"),
    Tier.LOCAL: ("RAM tier", "the board's RAM tier"),
    Tier.FLASH: ("flash tier", "the board's flash tier"),
    Tier.CACHEBOX: ("cache box", "the cache box"),
}
TIER_TOKENS = {
    Tier.CONTEXT: "context_tokens",
    Tier.LOCAL: "local_tokens",
    Tier.FLASH: "flash_tokens",
    Tier.CACHEBOX: "fetched_tokens",
}
BOARD_TIERS = (Tier.CONTEXT, Tier.LOCAL, Tier.FLASH)  # on the board itself: nothing crosses the link
COMPUTED = "computed"


CROSS_CLASS = "cross-class"  # a run restored a state computed by another kernel class (approximate)
APPROXIMATE_LABELS = ("", CROSS_CLASS)
_CLASS_RE = re.compile(r"^$|^[a-z0-9_][a-z0-9_.+-]{0,63}$")  # inference.engine.kernels.CLASS_RE, or nothing


def approximate_label(breakdown: dict) -> str:
    """What a run's pages, exports and metrics say of a run that used another class's state: "approximate:
    cross-class from x86_64-avx512"; '' for an exact run."""
    b = breakdown if isinstance(breakdown, dict) else {}
    if b.get("approximate") != CROSS_CLASS:
        return ""
    source = b.get("approximate_from")
    return (
        f"approximate: cross-class from {source}" if isinstance(source, str) and source else "approximate: cross-class"
    )


def _int(value) -> int:
    try:
        number = int(value) if not isinstance(value, bool) else 0
    except (TypeError, ValueError):
        return 0
    return max(number, 0)


def tokens_by_tier(breakdown: dict) -> dict[str, int]:
    """Prompt tokens each tier served (``Tier`` value -> tokens), from a breakdown as stored. A run
    recorded before boards counted them per tier gives all its matched tokens to ``tier`` (the
    furthest it restored from), or to the cache box when it names no board-local tier (schema runs,
    runs recorded before boards kept tiers)."""
    b = breakdown if isinstance(breakdown, dict) else {}
    counts = {tier.value: _int(b.get(name)) for tier, name in TIER_TOKENS.items()}
    matched = _int(b.get("matched_tokens"))
    rest = matched - sum(counts.values())
    if rest > 0:
        tier = b.get("tier")
        counts[tier if tier in BOARD_TIERS else Tier.CACHEBOX.value] += rest
    return counts


def served_from(breakdown: dict) -> str:
    """Where a run's prompt came from, said one way on every page: "468/468 prompt tokens from the
    board's own context", "256/300 prompt tokens from the cache box, 44 computed"."""
    b = breakdown if isinstance(breakdown, dict) else {}
    total = _int(b.get("prompt_tokens"))
    parts = [(tokens, TIER_WORDS[Tier(tier)][1]) for tier, tokens in tokens_by_tier(b).items() if tokens]
    if not parts:
        return f"all {total} prompt tokens computed"
    served = sum(tokens for tokens, _ in parts)
    where = parts[0][1] if len(parts) == 1 else ", ".join(f"{tokens} from {words}" for tokens, words in parts)
    sentence = (
        f"{served}/{total} prompt tokens from {where}"
        if len(parts) == 1
        else f"{served}/{total} prompt tokens reused: {where}"
    )
    approximate = approximate_label(b)
    return (
        sentence
        + (f", {total - served} computed" if total > served else "")
        + (f" ({approximate})" if approximate else "")
    )


def source_label(breakdown: dict) -> str:
    """The short word for where a run's prompt came from: a tier's label ("context", "RAM tier",
    "cache box"), several joined by "+", or "computed"."""
    labels = [TIER_WORDS[Tier(tier)][0] for tier, tokens in tokens_by_tier(breakdown).items() if tokens]
    approximate = " (approximate)" if isinstance(breakdown, dict) and breakdown.get("approximate") else ""
    return (" + ".join(labels) or COMPUTED) + approximate


# Runs with these never consulted a cache (for the lookup counters).
NO_LOOKUP_DECISIONS = frozenset({Decision.NO_CACHE, Decision.NO_SIGNING_KEY})
NO_LOOKUP_CACHEBOX = frozenset({CacheBoxState.OFF, CacheBoxState.NO_KEY})

# The stacked-bar components of the paper's table 3: (field, label), in its order and words.
STACK = (
    ("token_ms", "Token"),
    ("bloom_ms", "Bloom"),
    ("prefill_ms", "P-decode"),
    ("redis_ms", "Redis"),
    ("decode_ms", "R-decode"),
    ("sample_ms", "Sample"),
)
STACK_FIELDS = tuple(field for field, _ in STACK)


# -- TTFT and TTLT as the sums they are -----------------------------------------------------------
# The parts of TTFT and TTLT, grouped as the paper's table 3 groups them, each with the fields it
# adds up (a group of two says what each is), then "other": the whole less its named parts (the
# run's setup, handing each token to its stream, Python between the steps). Every page, chart and
# answer card shows these (``time_sums``); the fields themselves stay as the board measured them.
TIME_GROUPS = (
    ("Token", (("token_ms", "tokenize the prompt"),)),
    ("Bloom", (("bloom_ms", "look the ranges up in the board's catalog"),)),
    ("P-decode", (("prefill_ms", "prefill the tokens not restored"),)),
    (
        "Redis",
        (
            ("redis_ms", "from the cache box: fetch, verify, restore"),
            ("local_ms", "from the board's own context, RAM or flash tier"),
        ),
    ),
    ("R-decode", (("decode_ms", "decode the answer's tokens after the first"),)),
    ("Sample", (("sample_ms", "choose each answer token"),)),
)
TIME_LABELS = tuple(label for label, _ in TIME_GROUPS)
OTHER = "other"
# In TTFT: no R-decode, and of Sample only the first token's (``first_sample_ms``).
_TTFT_FIELDS = {"decode_ms": None, "sample_ms": "first_sample_ms"}
TIME_DIGITS = 1  # the rounding every page shows (0.1 ms): the shown parts add up to the shown whole


@dataclass(frozen=True)
class TimePart:
    label: str  # a table-3 group ("Token" ... "Sample") or ``OTHER``
    ms: float  # rounded to TIME_DIGITS
    pieces: tuple[tuple[str, float], ...] = ()  # a group of several fields: (what, ms) of each


@dataclass(frozen=True)
class TimeSum:
    """TTFT or TTLT as the sum of its parts, each rounded as shown; ``other`` is the whole less the
    named parts, so the shown numbers add up exactly. A negative ``other`` says the named parts
    exceed the whole (steps that ran at the same time: a fetch while the front was prefilled)."""

    name: str  # "TTFT" or "TTLT"
    total_ms: float
    parts: tuple[TimePart, ...]  # the named groups, then ``OTHER``

    @property
    def other_ms(self) -> float:
        return self.parts[-1].ms

    @property
    def named_ms(self) -> float:
        return round(self.total_ms - self.other_ms, TIME_DIGITS)

    @property
    def exceeded(self) -> bool:
        return self.other_ms < 0

    def sentence(self) -> str:
        """ "TTFT 266.8 ms = Token 1.2 + Bloom 0.1 + P-decode 250.3 + Redis 0.0 + Sample 0.4 + other 14.8"."""
        terms = " + ".join(f"{part.label} {part.ms:.{TIME_DIGITS}f}" for part in self.parts[:-1])
        other = self.other_ms
        sentence = f"{self.name} {self.total_ms:.{TIME_DIGITS}f} ms = {terms} + {OTHER} {other:.{TIME_DIGITS}f}"
        return sentence + (
            f" (the named parts exceed {self.name} by {-other:.{TIME_DIGITS}f} ms: some ran at the same time)"
            if other < 0
            else ""
        )

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "total_ms": self.total_ms,
            "named_ms": self.named_ms,
            "other_ms": self.other_ms,
            "exceeded": self.exceeded,
            "parts": [
                {"label": part.label, "ms": part.ms, "pieces": [list(piece) for piece in part.pieces]}
                for part in self.parts
            ],
            "sentence": self.sentence(),
        }


def _tenths(value) -> int:
    """``value`` (ms) in units of the shown rounding; anything not a finite number is 0."""
    try:
        number = float(value) if not isinstance(value, bool) else 0.0
    except (TypeError, ValueError):
        return 0
    if not math.isfinite(number):
        return 0
    # Half up on the decimal digits, as Django's floatformat shows a number (not Python's half-even).
    return int(Decimal(repr(number)).scaleb(TIME_DIGITS).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def _time_sum(breakdown: dict, name: str, whole: str, first_token: bool) -> TimeSum:
    scale = 10**TIME_DIGITS
    parts, named = [], 0
    for label, members in TIME_GROUPS:
        pieces = []
        for field, words in members:
            source = _TTFT_FIELDS.get(field, field) if first_token else field
            if source is None:
                break
            value = breakdown.get(source)
            if field == "redis_ms" and value is None:  # a breakdown without the sum: its parts
                value = (breakdown.get("fetch_ms") or 0) + (breakdown.get("restore_ms") or 0)
            pieces.append((words, _tenths(value)))
        if not pieces:
            continue  # R-decode is no part of TTFT
        total = sum(tenths for _, tenths in pieces)
        named += total
        # A group of several fields names those that took any time (a context hit: no cache box).
        shown = tuple((words, tenths / scale) for words, tenths in pieces if tenths) if len(pieces) > 1 else ()
        parts.append(TimePart(label, total / scale, shown))
    whole_tenths = _tenths(breakdown.get(whole))
    parts.append(TimePart(OTHER, (whole_tenths - named) / scale))
    return TimeSum(name, whole_tenths / scale, tuple(parts))


def time_sums(breakdown: dict) -> dict[str, TimeSum]:
    """TTFT and TTLT of a run (its breakdown as stored) as the sums they are: ``{"ttft": ...,
    "ttlt": ...}``. TTFT: Token, Bloom, P-decode, Redis, the first token's Sample, other. TTLT: the
    six groups of table 3, other."""
    b = breakdown if isinstance(breakdown, dict) else {}
    return {"ttft": _time_sum(b, "TTFT", "ttft_ms", True), "ttlt": _time_sum(b, "TTLT", "ttlt_ms", False)}


# What a run's page lists under each heading: every field of ``Breakdown``, each once.
FIELD_GROUPS = (
    (
        "Time to first token (ms)",
        (
            "ttft_ms",
            "token_ms",
            "bloom_ms",
            "prefill_ms",
            "redis_ms",
            "fetch_ms",
            "verify_ms",
            "decompress_ms",
            "restore_ms",
            "local_ms",
            "first_sample_ms",
        ),
    ),
    ("The answer", ("ttlt_ms", "decode_ms", "sample_ms", "generated_tokens", "tbt_p50_ms", "tbt_p99_ms")),
    (
        "Where the prompt came from (tokens)",
        (
            "case",
            "tier",
            "prompt_tokens",
            "matched_tokens",
            "context_tokens",
            "local_tokens",
            "flash_tokens",
            "fetched_tokens",
        ),
    ),
    (
        "The cache box",
        ("cachebox", "decision", "candidate_tokens", "false_positives", "rejected_entries", "codec", "link"),
    ),
    (
        "The break-even forecast",
        ("predicted_fetch_ms", "predicted_prefill_ms", "planned_split", "met_at", "fetch_late"),
    ),
    ("Bytes moved", ("state_bytes", "fetched_bytes", "uploaded_bytes")),
    ("After the answer", ("upload_ms", "next_turn_tokens", "next_turn_ms")),
    (
        "The board",
        (
            "behind_ms",
            "compute_profile",
            "paced_ms",
            "strategy",
            "kernel_class",
            "approximate",
            "approximate_from",
            "continued_tokens",
        ),
    ),
    ("Lab: KV prediction", ("aux_prefill_ms", "predict_ms", "kv_import_ms")),
)


@dataclass
class Breakdown:
    # Paper's columns, in milliseconds.
    token_ms: float = 0.0  # Token: tokenize the prompt
    bloom_ms: float = 0.0  # Bloom: look the candidate ranges up in the local catalog
    prefill_ms: float = 0.0  # P-decode: prefill the tokens that were not cached
    redis_ms: float = 0.0  # Redis: fetch + verify + restore the cached ranges (= fetch_ms + restore_ms)
    local_ms: float = 0.0  # restore from the board's own tiers (context, RAM, flash): no network
    decode_ms: float = 0.0  # R-decode: decode the response tokens after the first
    sample_ms: float = 0.0  # Sample: choose every response token
    first_sample_ms: float = 0.0  # of it, choosing the first one (Sample's part of TTFT)
    ttft_ms: float = 0.0  # time to first token
    ttlt_ms: float = 0.0  # time to last token
    # Finer parts and the off-path upload.
    fetch_ms: float = 0.0  # network part of redis_ms (headers + state bytes)
    restore_ms: float = 0.0  # llama.cpp part of redis_ms (load state into the context)
    verify_ms: float = 0.0  # part of fetch_ms: signatures and state digests checked
    decompress_ms: float = 0.0  # part of fetch_ms: compressed states decoded (``cachebox.codec``)
    upload_ms: float = 0.0  # export + upload of new ranges, after the answer
    # A chat turn, after its answer: the prefix the next turn shares (the answer, the next turn's
    # opening) computed on that turn's cuts and shared (``PrefixServing.extend``).
    next_turn_tokens: int = 0
    next_turn_ms: float = 0.0
    # What happened.
    prompt_tokens: int = 0
    matched_tokens: int = 0  # prompt tokens restored instead of prefilled, from any tier (the three below add up to it)
    context_tokens: int = 0  # of them, kept in the board's own context
    local_tokens: int = 0  # restored from the board's RAM tier
    flash_tokens: int = 0  # restored from the board's flash tier
    fetched_tokens: int = 0  # fetched from the cache box (schema runs: their modules)
    generated_tokens: int = 0
    continued_tokens: int = (
        0  # of them, given: another board chose them before it stopped (a re-sent run goes on from there)
    )
    state_bytes: int = 0  # prompt state moved: fetched_bytes + uploaded_bytes
    fetched_bytes: int = 0
    uploaded_bytes: int = 0
    case: Case = Case.MISS
    cachebox: CacheBoxState = CacheBoxState.OK
    decision: Decision = Decision.NONE
    tier: Tier = Tier.NONE  # where the furthest restored range came from
    candidate_tokens: int = 0  # the longest cached range the catalog offered
    predicted_fetch_ms: float = 0.0  # the break-even policy's forecast, to compare with redis_ms
    predicted_prefill_ms: float = 0.0  # the prefill a fetch would have saved, forecast
    link: str = ""  # "unshaped" or the emulated link every timing was taken through
    false_positives: int = 0  # catalog "maybe"s the cache box did not hold
    rejected_entries: int = 0  # forged, corrupted or mismatched entries evicted (integrity failures)
    # Loading while computing (inference.serving.overlap): the front of the prompt is prefilled while
    # later ranges download; both meet at ``met_at``.
    planned_split: int = 0  # where the plan expected compute and load to meet (0: no overlap)
    met_at: int = 0  # where they met: tokens before it were computed here, the loaded ranges follow
    fetch_late: bool = False  # the fetch ran slower than forecast: compute went past the plan (the deadline)
    codec: str = ""  # how the fetched entries' states were stored ("raw", "zstd-shuffle", ...)
    # Where the time went, beyond the paper's columns.
    kernel_class: str = ""  # the kernels of the board's llama.cpp (inference.engine.kernels): what computed its bits
    # Approximate sharing across kernel classes (a namespace's choice): "cross-class" when a restored state was
    # computed by other kernels, whose class ``approximate_from`` names; "" = exact (the cold run's bits).
    approximate: str = ""
    approximate_from: str = ""
    compute_profile: str = (
        ""  # a paced (emulated) board class, e.g. "Raspberry Pi Zero 2 W (emulated)"; "" = this machine
    )
    paced_ms: float = 0.0  # time added by the compute profile's pacing (inside prefill_ms and decode_ms)
    strategy: str = ""  # "" = exact prefix/schema serving; a lab strategy names itself (approximate)
    tbt_p50_ms: float = 0.0  # time between answer tokens, median
    tbt_p99_ms: float = 0.0  # time between answer tokens, 99th percentile
    # How long the run waited on its board for earlier work to end (the board's clock when that work
    # ended, against the control plane's when the request arrived, or when it was sealed): the
    # fleet's queue, not the path to the board (boards on other hosts: as exact as the clocks agree).
    behind_ms: float = 0.0
    # KV prediction (inference.lab.kv_prediction): prefill_ms = aux_prefill_ms + the base model's last prompt token.
    aux_prefill_ms: float = 0.0  # the auxiliary model's prefill and the export of its state
    predict_ms: float = 0.0  # predicted keys and values for the base model's other layers
    kv_import_ms: float = 0.0  # the predicted state loaded into the base context (also in restore_ms)

    def __post_init__(self) -> None:
        # Values from a board's JSON arrive as strings: an unknown word is refused (ValueError).
        self.case = Case(self.case)
        self.cachebox = CacheBoxState(self.cachebox)
        self.decision = Decision(self.decision)
        self.tier = Tier(self.tier)
        if self.approximate not in APPROXIMATE_LABELS:
            raise ValueError(
                f"unknown approximate label {self.approximate!r}: one of {', '.join(map(repr, APPROXIMATE_LABELS))}"
            )
        for name in ("kernel_class", "approximate_from"):
            if not isinstance(getattr(self, name), str) or not _CLASS_RE.match(getattr(self, name)):
                raise ValueError(f"{name} must be a kernel class such as 'x86_64-avx2' (got {getattr(self, name)!r})")

    def as_dict(self) -> dict:
        return {
            name: round(value, 3) if isinstance(value, float) else (str(value) if isinstance(value, StrEnum) else value)
            for name, value in asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Breakdown":
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    def cache_off(self, state: CacheBoxState, decision: Decision) -> None:
        """This run uses no cache (asked for none, or holds no key): say why."""
        self.cachebox, self.decision = state, decision

    def cachebox_failed(self, decision: Decision | None = None) -> None:
        """The cache box failed during this run: the answer comes from local work."""
        self.cachebox = CacheBoxState.UNAVAILABLE
        if decision is not None:
            self.decision = decision

    def restored(self, tier: Tier, tokens: int) -> None:
        """``tokens`` more prompt tokens came from ``tier`` (the walk over the tiers says so)."""
        if tokens > 0 and tier in TIER_TOKENS:
            name = TIER_TOKENS[tier]
            setattr(self, name, getattr(self, name) + tokens)

    def classify(self, matched: int, total: int) -> None:
        """Set ``matched_tokens`` and the case from how many of ``total`` prompt tokens were served."""
        self.matched_tokens = matched
        self.case = Case.MISS if matched == 0 else (Case.FULL if matched >= total else Case.PARTIAL)

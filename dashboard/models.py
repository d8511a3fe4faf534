"""What the control plane keeps: devices, runs, saved prompts, prompt schemas and its mirror of
the cache box's entries. Boards never read these rows (a board installs no Django)."""

from __future__ import annotations

import math
import uuid
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.urls import reverse
from django.utils import timezone

from cachebox.signing import private_namespace
from dashboard.security.at_rest import SealedJSONField, SealedTextField
from inference.contract.messages import CANCELLED, Queue
from inference.engine.kernels import CLASS_RE
from inference.serving.breakdown import (
    NO_LOOKUP_CACHEBOX,
    NO_LOOKUP_DECISIONS,
    Breakdown,
    CacheBoxState,
    Decision,
    Tier,
    approximate_label,
    served_from,
    source_label,
    tokens_by_tier,
)
from inference.serving.pml import PMLError, parse_schema

ONLINE_WITHIN = timedelta(seconds=30)  # a board that never said how often it beats


def offline_after(status: dict | None) -> timedelta:
    """How long a board may stay silent before it counts as offline: ``EDGECACHE_MISSED_HEARTBEATS``
    of the heartbeats it said it sends (its status's ``heartbeat_s``), plus one for slack."""
    interval = (status or {}).get("heartbeat_s")
    if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not 0 < interval <= 3600:
        return ONLINE_WITHIN
    return timedelta(seconds=interval * (settings.EDGECACHE_MISSED_HEARTBEATS + 1))


namespace_name = RegexValidator(r"^[A-Za-z0-9_-]{1,40}$", "Use 1-40 letters, digits, '-' or '_'.")


class Namespace(models.Model):
    """A tenant: its boards share cache entries with each other and with no one else.

    Entries of a namespace are signed with its own key (derived from the control plane's
    signing secret and ``key_generation``); rotating bumps the generation, boards receive
    the new ring at their next heartbeat and entries signed two generations back are refused.
    """

    name = models.CharField(max_length=40, unique=True, validators=[namespace_name])
    share_across_devices = models.BooleanField(
        default=True,
        help_text="off for sensitive prompts: each board then caches for itself only, so no board can "
        "learn from a fast answer that another one saw the same prompt (timing side channel)",
    )
    share_across_kernel_classes = models.BooleanField(
        "share across kernel classes (approximate)",
        default=False,
        help_text="on: a board whose own entries miss may restore a state another kernel class of the same model computed "
        "(another CPU's llama.cpp build: other bits). Faster, but not the board's cold answer: every such run is labelled "
        "approximate (cross-class) wherever runs are shown. Off: boards share states only within their class (exact)",
    )
    members_manage_api_keys = models.BooleanField(
        "members manage API keys",
        default=False,
        help_text="members of this namespace (not only staff) may create and revoke its API keys on the API keys page",
    )
    key_generation = models.PositiveIntegerField(default=1, editable=False)
    key_rotated_at = models.DateTimeField(null=True, blank=True, editable=False)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Device(models.Model):
    name = models.SlugField(
        max_length=40, unique=True, help_text="letters, digits, '-' and '_'; the board's queue is device.<name>"
    )
    kind = models.CharField(max_length=100, blank=True, help_text='e.g. "Raspberry Pi Zero 2W"')
    cpu_threads = models.PositiveSmallIntegerField("CPU threads", default=1)
    memory_mb = models.PositiveIntegerField("Memory (MB)", default=512)
    link_bandwidth_mbps = models.FloatField(
        null=True, blank=True, help_text="link bandwidth to the cache box in megabits/s; empty for an unshaped link"
    )
    link_rtt_ms = models.FloatField(null=True, blank=True, help_text="round-trip time to the cache box in ms")
    namespace = models.ForeignKey(
        Namespace,
        to_field="name",
        db_column="namespace",
        default="default",
        on_delete=models.PROTECT,
        related_name="devices",
        help_text="the tenant whose cache entries this board may read and write",
    )
    # The enrollment token is shown once; kept are its hash (the board checks a token locally
    # before enrolling) and, until the board enrolls or the token expires, the public key that
    # checks the enrollment's signature (a copy of the database enrolls nobody with it) and the
    # token's proof of the control plane's key (which the board pins).
    token_sha256 = models.CharField(max_length=64, editable=False)
    enroll_key = models.CharField(
        max_length=64,
        editable=False,
        blank=True,
        help_text="the token's Ed25519 public key (hex) until the board enrolls",
    )
    pin_proof = models.CharField(max_length=64, editable=False, blank=True)
    enroll_redis_sha256 = models.CharField(
        max_length=64,
        editable=False,
        blank=True,
        help_text="the SHA-256 of the enrollment Redis user's password (the token gives it)",
    )
    token_expires = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="after this the token enrolls nothing (EDGECACHE_TOKEN_TTL_HOURS)",
    )
    # The board's own public keys, sent once at enrollment: Ed25519 checks every message it
    # sends, X25519 is what its namespace's key ring is sealed to. Its private keys never leave it.
    signing_public_key = models.CharField(max_length=64, editable=False, blank=True)
    box_public_key = models.CharField(max_length=64, editable=False, blank=True)
    # The SHA-256 of the board's own Redis password (its ACL user's, ``#<hash>``): the password never travels.
    redis_password_sha256 = models.CharField(max_length=64, editable=False, blank=True)
    enrolled_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_message_ts = models.FloatField(
        default=0.0, editable=False, help_text="send time of the newest heartbeat accepted (replays are older)"
    )
    token_created = models.DateTimeField(default=timezone.now)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    # What the open pages were last told: online (a heartbeat came) or offline (the sweeper saw it
    # miss EDGECACHE_MISSED_HEARTBEATS heartbeats). Kept here so that one sweeper, of however many,
    # tells them once, and a control worker that restarts still tells them.
    announced_online = models.BooleanField(default=False, editable=False)
    status = models.JSONField(default=dict, blank=True, help_text="the board's last heartbeat (catalog size, ...)")
    # An audit recomputed an entry it made, cold on another board, and got other bits: its entries
    # are quarantined (the producer table lists it; readers refuse them) until a staff member clears it.
    audit_mismatches = models.PositiveIntegerField(
        default=0, editable=False, help_text="entries of this board an audit found not to be what they claim"
    )
    quarantined_at = models.DateTimeField(
        null=True, blank=True, editable=False, help_text="when its entries were quarantined (an audit caught it)"
    )
    quarantine_reason = models.CharField(max_length=300, blank=True, editable=False)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("device-detail", args=[self.name])

    @property
    def queue(self) -> str:
        return Queue.device(self.name)

    @property
    def cache_namespace(self) -> str:
        """Where this board's entries live (its own namespace when its tenant does not share)."""

        if self.namespace.share_across_devices:
            return self.namespace_id
        return private_namespace(self.namespace_id, self.name)

    @property
    def online(self) -> bool:
        return self.online_at(timezone.now())

    def online_at(self, now) -> bool:
        """Whether the board counted as online at ``now`` (it beat within ``offline_after``)."""
        return (
            self.revoked_at is None and self.last_seen is not None and now - self.last_seen < offline_after(self.status)
        )

    @property
    def kernel_class(self) -> str:
        """The kernels its llama.cpp computes with, as its heartbeat says (``inference.engine.kernels``;
        '' before its first heartbeat or from a board of an older version)."""
        value = (self.status or {}).get("kernel_class")
        return value if isinstance(value, str) and CLASS_RE.match(value) else ""

    @property
    def link_label(self) -> str:
        if not self.link_bandwidth_mbps:
            return "unshaped link"
        rtt = f", {self.link_rtt_ms:g} ms RTT" if self.link_rtt_ms else ""
        return f"{self.link_bandwidth_mbps:g} Mbit/s{rtt}"


class Dispatch(models.Model):
    """A request sent to boards: only the device it went to (or, sent to any board, a board of its
    namespace) may answer it, once."""

    KINDS = [("run", "run"), ("encode", "encode")]

    request_id = models.UUIDField(unique=True)
    kind = models.CharField(max_length=8, choices=KINDS)
    device = models.ForeignKey(
        Device,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="dispatches",
        help_text="empty: any board of the namespace",
    )
    namespace = models.CharField(max_length=64)
    routing = models.JSONField(
        default=dict,
        blank=True,
        help_text="the prompt's prefix keys and expected work; for a run sent to any board, the router's choice and its expected saving",
    )
    created = models.DateTimeField(auto_now_add=True, db_index=True)
    # How it ended: answered (a report came), lost (no board answered: a failed run says why) or
    # revoked (someone took it back from the queue page: a failed run says who);
    # "" while it is under way (``attempt`` 2 once it was re-sent to another board, for a client
    # still waiting). The request is kept while it is under way, for that one re-send.
    OUTCOMES = [("", "under way"), ("answered", "answered"), ("lost", "lost"), ("revoked", "revoked")]
    outcome = models.CharField(max_length=10, choices=OUTCOMES, blank=True, default="", db_index=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="no board takes it after this")
    waits_until = models.DateTimeField(
        null=True, blank=True, help_text="how long its client (the API, the Run page) waits for the answer"
    )
    attempt = models.PositiveSmallIntegerField(default=1, help_text="2 once re-sent to another board")
    request = SealedJSONField(
        default=dict,
        blank=True,
        help_text="the request while it is under way (for a re-send); emptied when it ends; sealed at rest",
    )
    # A re-send: the sweeper moves the run to ``device`` and tells its client's follower, which
    # listens to the new board's channel first and then sends it with what it streamed so far.
    moving = models.BooleanField(
        default=False,
        help_text="moved to ``device`` and not yet sent there: its client's follower sends it once it listens there",
    )
    streamed = SealedTextField(
        blank=True,
        default="",
        help_text="the answer its client had when it stopped following it (a run that ends unanswered keeps it); sealed at rest",
    )

    class Meta:
        # The router reads each device's newest dispatches for every request it routes: with this
        # index that stays ~4 ms at 50,000 dispatches (66 ms without: a sort of all of them).
        indexes = [models.Index(fields=["device", "kind", "-created"], name="dispatch_device_recent")]

    def __str__(self) -> str:
        return f"{self.kind} {self.request_id} -> {self.device or 'any board'}"

    def answerable_by(self, device: Device) -> bool:
        if self.device_id is not None:
            return self.device_id == device.pk
        return device.namespace_id == self.namespace or device.cache_namespace == self.namespace


class EntryAudit(models.Model):
    """One cache hit recomputed cold on another board of the same model, to compare bit for bit."""

    VERDICTS = [
        ("", "under way"),
        ("match", "match: the entry is what it claims"),
        ("mismatch", "mismatch: the entry is not what its producer signed it to be"),
        ("refused", "refused: the entry failed its checks on the auditor"),
        ("gone", "gone: the entry was no longer there"),
        ("inconclusive", "inconclusive: the run's prompt no longer gives that entry"),
    ]

    request_id = models.UUIDField(unique=True)
    entry = models.CharField(max_length=200, db_index=True)
    namespace = models.CharField(max_length=64)
    run_device = models.CharField(max_length=64, help_text="the board whose run hit the entry")
    auditor = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="audits_made")
    producer = models.CharField(
        max_length=64, blank=True, help_text="the board the entry's signature names (as the auditor verified it)"
    )
    verdict = models.CharField(max_length=12, choices=VERDICTS, blank=True, default="", db_index=True)
    detail = models.CharField(max_length=500, blank=True)
    created = models.DateTimeField(auto_now_add=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"audit of {self.entry} on {self.auditor_id}: {self.verdict or 'under way'}"


class SavedPrompt(models.Model):
    name = models.CharField(max_length=100, unique=True)
    text = SealedTextField()
    split_on = models.CharField(
        max_length=20,
        blank=True,
        default="",
        help_text=r"cut the prompt after each of these (e.g. \n\n) into cacheable ranges",
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class InferenceRun(models.Model):
    SOURCES = [
        ("chat", "chat"),
        ("text", "free text"),
        ("mmlu", "MMLU question"),
        ("saved", "saved prompt"),
        ("api", "API"),
    ]

    request_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="runs")
    source = models.CharField(max_length=10, choices=SOURCES, default="text")
    title = SealedTextField(blank=True)  # at most 200 characters (RunMeta); it starts with the prompt
    prompt = SealedTextField(blank=True)  # sealed at rest (dashboard.security.at_rest), as the answer
    expected_answer = models.CharField(max_length=8, blank=True)
    text = SealedTextField(blank=True)
    error = models.TextField(blank=True)
    breakdown = models.JSONField(default=dict)
    # Denormalized from ``breakdown`` for filtering and aggregates.
    case = models.CharField(max_length=10, blank=True)
    ttft_ms = models.FloatField(default=0)
    ttlt_ms = models.FloatField(default=0)
    prompt_tokens = models.PositiveIntegerField(default=0)
    matched_tokens = models.PositiveIntegerField(default=0)
    state_bytes = models.PositiveBigIntegerField(default=0)
    # Also from ``breakdown`` (set on save), so that /metrics is SQL aggregates only.
    fetched_bytes = models.PositiveBigIntegerField(default=0)
    uploaded_bytes = models.PositiveBigIntegerField(default=0)
    false_positives = models.PositiveIntegerField(default=0)
    rejected_entries = models.PositiveIntegerField(default=0)
    cache_lookup = models.BooleanField(default=False)
    cachebox_unavailable = models.BooleanField(default=False)
    # Where the matched tokens came from (``inference.serving.breakdown.tokens_by_tier``): the tier label of /metrics.
    context_tokens = models.PositiveIntegerField(default=0)
    local_tokens = models.PositiveIntegerField(default=0)
    flash_tokens = models.PositiveIntegerField(default=0)
    fetched_tokens = models.PositiveIntegerField(default=0)
    tpot_ms = models.FloatField(default=0, help_text="time per output token after the first (0: fewer than two tokens)")
    created = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created"]
        indexes = [
            models.Index(fields=["device", "-created"], name="run_device_recent")
        ]  # the router's rates, the device page

    def __str__(self) -> str:
        return f"{self.device} {self.case} {self.ttft_ms:.0f} ms"

    def get_breakdown(self) -> Breakdown:
        return Breakdown.from_dict(self.breakdown)

    @property
    def cancelled(self) -> bool:
        """Its client cancelled it: answered in part (its text, its TTFT), no failure."""
        return self.error == CANCELLED

    @property
    def measured(self) -> bool:
        """Its board served it (answered, or cancelled on the way): its breakdown holds its times."""
        return not self.error or self.cancelled

    @property
    def shown_case(self) -> str:
        """Its case as the pages show it: a cancelled run recorded before cancelled runs kept one says its breakdown's."""
        return self.case or (str((self.breakdown or {}).get("case") or "") if self.measured else "")

    @property
    def served_from(self) -> str:
        """Where its prompt came from, in the words of every page ("468/468 prompt tokens from the board's own context")."""
        return served_from(self.breakdown) if self.measured else ""

    @property
    def approximate_label(self) -> str:
        """ "approximate: cross-class from x86_64-avx512" for a run that restored another kernel class's state; ''."""
        return approximate_label(self.breakdown) if not self.error else ""

    @property
    def source_label(self) -> str:
        """The short word for it: "context", "RAM tier", "cache box", "computed"."""
        return source_label(self.breakdown) if self.measured else ""

    @property
    def routing(self) -> dict:
        """How the router chose this run's board, for a run sent to any board (else {}): expected
        time, what the board held, the expected saving (``dashboard.router``)."""
        record = Dispatch.objects.filter(request_id=self.request_id).values_list("routing", flat=True).first() or {}
        return (
            {key: value for key, value in record.items() if key not in ("prompt", "work_ms")}
            if record.get("policy") == "cache-aware"
            else {}
        )

    def save(self, *args, **kwargs):
        for name, value in breakdown_counts(self.breakdown, self.error).items():
            setattr(self, name, value)
        super().save(*args, **kwargs)


def _finite(value) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else 0.0
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0


def _count(value) -> int:
    """A count from a board's JSON: a finite non-negative number, anything else 0."""
    try:
        number = float(value) if not isinstance(value, bool) else 0.0
    except (TypeError, ValueError):
        return 0
    return int(number) if math.isfinite(number) and number > 0 else 0


def breakdown_counts(breakdown, error: str = "") -> dict:
    """The counters /metrics sums, from one run's breakdown (whatever a board sent)."""
    breakdown = breakdown if isinstance(breakdown, dict) else {}
    decision, cachebox = breakdown.get("decision"), breakdown.get("cachebox")
    tiers = tokens_by_tier(breakdown) if not error else {}
    generated = _count(breakdown.get("generated_tokens"))
    decoding = _finite(breakdown.get("ttlt_ms")) - _finite(breakdown.get("ttft_ms"))
    return {
        "context_tokens": tiers.get(Tier.CONTEXT.value, 0),
        "local_tokens": tiers.get(Tier.LOCAL.value, 0),
        "flash_tokens": tiers.get(Tier.FLASH.value, 0),
        "fetched_tokens": tiers.get(Tier.CACHEBOX.value, 0),
        "tpot_ms": decoding / (generated - 1) if not error and generated > 1 and decoding > 0 else 0.0,
        "fetched_bytes": _count(breakdown.get("fetched_bytes")),
        "uploaded_bytes": _count(breakdown.get("uploaded_bytes")),
        "false_positives": _count(breakdown.get("false_positives")),
        "rejected_entries": _count(breakdown.get("rejected_entries")),
        "cache_lookup": not error and decision not in NO_LOOKUP_DECISIONS and cachebox not in NO_LOOKUP_CACHEBOX,
        "cachebox_unavailable": cachebox == CacheBoxState.UNAVAILABLE or decision == Decision.CACHEBOX_UNAVAILABLE,
    }


class AuditEvent(models.Model):
    """Who did what to devices and the cache: every destructive action is logged here."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    action = models.CharField(max_length=40)
    target = models.CharField(max_length=200)
    detail = models.TextField(blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.created:%Y-%m-%d %H:%M} {self.user or 'system'} {self.action} {self.target}"


class Membership(models.Model):
    """A user's access to one namespace (tenant): a user who is not staff sees only the devices,
    runs and live events of the namespaces they are a member of. Staff see every namespace."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    namespace = models.ForeignKey(Namespace, to_field="name", on_delete=models.CASCADE, related_name="memberships")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        unique_together = [("user", "namespace")]
        ordering = ["namespace", "user"]

    def __str__(self) -> str:
        return f"{self.user} in {self.namespace_id}"


class ApiKey(models.Model):
    """A key of the OpenAI-compatible API (``/v1/``): it reaches only its namespace's boards.

    The key is shown once when created (the API keys page, ``python manage.py apikey create`` or
    Admin > API keys);
    kept are its SHA-256 and its first characters (to recognize it in a list). Revoking is
    immediate: the next request with it is a 401.
    """

    PREFIX = "ec-"

    name = models.CharField(max_length=100, blank=True, help_text="what it is for (shown in lists and run titles)")
    namespace = models.ForeignKey(
        Namespace,
        to_field="name",
        db_column="namespace",
        on_delete=models.CASCADE,
        related_name="api_keys",
        help_text="the tenant whose boards (and so cache entries) the key reaches",
    )
    key_sha256 = models.CharField(max_length=64, unique=True, editable=False)
    key_prefix = models.CharField(
        max_length=16, editable=False, help_text="the key's first characters, to recognize it"
    )
    rate_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="requests per minute; empty: EDGECACHE_API_RATE (60); 0: no limit"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created = models.DateTimeField(auto_now_add=True)
    last_used = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["namespace", "name", "pk"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.key_prefix}… ({self.name or 'unnamed'}, {self.namespace_id})"

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def rate(self) -> int:
        """Requests per minute this key may send (0: no limit)."""
        return settings.EDGECACHE_API_RATE if self.rate_per_minute is None else self.rate_per_minute


# A prompt schema travels to a board inside its task message.
class Schema(models.Model):
    name = models.CharField(max_length=64, unique=True, editable=False, help_text="from <schema name=...>")
    source = SealedTextField(help_text="the PML document (sealed at rest: dashboard.security.at_rest)")
    digest = models.CharField(max_length=16, editable=False, help_text="changes whenever the source does")
    # The tenant whose keys, pages and boards may use it; "" is shared with every namespace (staff
    # choose to share one). A name (``dashboard.Namespace``), not a foreign key: boards' app
    # (inference) knows nothing of the control plane's models.
    namespace = models.CharField(
        max_length=40,
        blank=True,
        default="",
        help_text="the namespace that owns it; empty: shared with every namespace",
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("schema-detail", args=[self.pk])

    def clean(self):
        try:
            parsed = parse_schema(self.source)
        except PMLError as exc:
            raise ValidationError({"source": str(exc)})
        try:
            # lazy: the serving schema code (cache-box exchange, rbloom) only to validate a schema
            from inference.serving.schema import layout_for  # the vocabulary loads on first use only

            layout_for(self.source, settings.EDGECACHE_MODEL, settings.EDGECACHE_N_CTX)
        except PMLError as exc:
            raise ValidationError({"source": str(exc)})
        duplicate = Schema.objects.filter(name=parsed.name).exclude(pk=self.pk)
        if duplicate.exists():
            raise ValidationError(
                {"source": f"a schema named {parsed.name!r} exists already; rename this one or edit that one"}
            )
        self.name, self.digest = parsed.name, parsed.digest


# The store (Redis/Valkey) is the truth; rows are written when boards report uploads and hits, and
# ``python manage.py reconcile`` rebuilds them from the store.
class CacheEntry(models.Model):
    key = models.CharField(max_length=200, unique=True, help_text="Redis key of the entry")
    model = models.CharField(max_length=32, db_index=True, help_text="model fingerprint")
    namespace = models.CharField(max_length=64, db_index=True)
    start = models.PositiveIntegerField(help_text="first token position of the range")
    end = models.PositiveIntegerField(help_text="one past the last token position")
    bytes = models.PositiveBigIntegerField()
    hits = models.PositiveIntegerField(default=0)
    last_hit = models.DateTimeField(null=True, blank=True)
    creator_device = models.CharField(max_length=64, blank=True)
    pinned = models.BooleanField(default=False)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created"]
        verbose_name_plural = "cache entries"

    def __str__(self) -> str:
        return f"{self.namespace}/{self.model} [{self.start}, {self.end})"

    @property
    def tokens(self) -> int:
        return self.end - self.start


def token_usable(device: Device) -> bool:
    """Whether the device's token may still enroll a board: not spent, not expired."""
    return bool(device.enroll_key) and (device.token_expires is None or device.token_expires > timezone.now())

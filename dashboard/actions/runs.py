"""Verbs on runs: dispatch a prompt to boards, store what a board reports (once), and its JSON."""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import timedelta
from typing import Callable

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cachebox.errors import CacheBoxError
from cachebox.events import security_event
from cachebox.keys import cancel_key_name, heard_key_name, stream_channel
from dashboard import admission, router
from dashboard.live.broadcast import broadcast
from dashboard.outbox import sealed_for_board, send_sealed, send_to_board
from dashboard.pages.chart_series import hit_tier
from dashboard.pages.colors import device_color
from dashboard.pages.entry_preview import stored_entries
from dashboard.pages.explain import explain_run
from dashboard.pages.stats import explain_error, run_figures
from dashboard.security.signing import cancel_flag, control_plane_signer, device_ring
from dashboard.store import mirror
from inference.contract.envelope import CONTROL, Kind, seal
from inference.contract.messages import (
    CANCELLED,
    ChatMessage,
    Continuation,
    RunMeta,
    RunReport,
    RunRequest,
    SamplingSpec,
    StreamEvent,
    Task,
)
from inference.serving.breakdown import time_sums

from ..models import Device, Dispatch, InferenceRun
from . import entry_audits
from .audit import AuditAction, audit
from .cache import acceptable_entries, cachebox, kept_cachebox
from .devices import receive_board_message

log = logging.getLogger("dashboard.actions")

PAGE_WAIT_MARGIN_S = 30  # the Run page follows its runs this long past their expiry (dashboard.live.run_stream)


def run_request(
    segments=(),
    *,
    source: str = "text",
    title: str = "",
    expected_answer: str = "",
    messages=(),
    sampling: dict | None = None,
    **fields,
) -> RunRequest:
    """A run as the Run page, the API or a script asks for it: the board's own ``RunRequest`` (the
    one prompt type from the form to the board); ``dispatch_run`` gives each device its own id and
    namespace. ``messages``: a chat's (role, content) turns; ``fields``: RunRequest's others
    (max_tokens, use_cache, schema, pml, stream, strategy, stop, namespace)."""
    return RunRequest(
        request_id=str(uuid.uuid4()),
        segments=list(segments),
        messages=[ChatMessage(role=role, content=content) for role, content in messages],
        sampling=SamplingSpec(**(sampling or {})),
        meta=RunMeta(source=source[:32], title=title[:200], expected_answer=expected_answer[:16]),
        **fields,
    )


def dispatch_run(
    user,
    devices: list[Device],
    asked: RunRequest,
    request_ids: list[str] | None = None,
    routed: router.Routed | None = None,
) -> list[dict]:
    """Send the run ``asked`` to each device's own queue, each with its own request id (and its
    namespace unless one was asked); returns one {request_id, device} per device.

    ``request_ids`` (one per device) are for a caller that subscribed to the runs' channels first."""
    sent = []
    meta = asked.meta
    for index, device in enumerate(devices):
        request = asked.model_copy(
            update={
                "request_id": request_ids[index] if request_ids else str(uuid.uuid4()),
                "namespace": asked.namespace or device.namespace_id,
                "approximate_from": approximate_sources(device) if not asked.strategy else {},
            }
        )
        # ``routed``: the router chose this (one) device for a prompt sent to any board; a run to a
        # named board keeps its prompt's keys too (the routing history: what each board holds).
        # Either way the request carries the tokens routing made of its prompt.
        here = routed if routed is not None and routed.device.pk == device.pk else router.named(device, request)
        record, request = here.record, here.request(request)
        now = timezone.now()
        expires = timedelta(seconds=settings.EDGECACHE_TASK_EXPIRES)
        row = Dispatch.objects.create(
            request_id=request.request_id,
            kind="run",
            device=device,
            namespace=request.namespace,
            routing=record,
            request=request.dump(),
            expires_at=now + expires,
            waits_until=now + expires + timedelta(seconds=PAGE_WAIT_MARGIN_S) if request.stream else None,
        )
        router.STATE.feed(str(row.request_id), device.name, record, row.created)
        send_to_board(device, Task.RUN_PROMPT, request.dump(), settings.EDGECACHE_TASK_EXPIRES)
        sent.append(
            {
                "request_id": request.request_id,
                "device": device.name,
                **({"routing": router.shown(record)} if routed is not None else {}),
            }
        )
        broadcast("run.dispatched", {"request_id": request.request_id, "device": device.name, "title": meta.title})
    log.info("dispatched user=%s devices=%s", getattr(user, "username", None), [d.name for d in devices])
    return sent


def approximate_sources(device: Device) -> dict[str, str]:
    """{fingerprint: kernel class} of the same model computed by other kernel classes in ``device``'s
    namespace, whose entries its board may restore where its own miss: only where the namespace
    shares states across kernel classes (off by default: approximate) and across its boards. From
    the boards' heartbeats: the same model file and KV type, another class; revoked boards left out."""
    namespace = device.namespace
    status = device.status or {}
    own = (status.get("fingerprint"), status.get("model"), status.get("kv_type"))
    if not (
        namespace.share_across_kernel_classes and namespace.share_across_devices and all(own) and device.kernel_class
    ):
        return {}
    found: dict[str, str] = {}
    for other in (
        Device.objects.filter(namespace=namespace, revoked_at__isnull=True)
        .exclude(pk=device.pk)
        .only("status")
        .order_by("-last_seen")
    ):
        theirs = other.status or {}
        fingerprint, kernel_class = theirs.get("fingerprint"), other.kernel_class
        if (
            (theirs.get("model"), theirs.get("kv_type")) != own[1:]
            or not kernel_class
            or kernel_class == device.kernel_class
        ):
            continue
        if isinstance(fingerprint, str) and fingerprint != own[0] and fingerprint not in found and len(found) < 8:
            found[fingerprint] = kernel_class
    return found


def route_run(candidates: list[Device], asked: RunRequest, namespace: str) -> router.Routed | None:
    """The board of ``candidates`` a run sent to "any board" goes to (None: none is online):
    the one expected to answer first, given what it holds and its queue (``dashboard.router``).

    Only boards of ``namespace`` (the run's tenant: its namespace or a board's own cache namespace
    in it) are weighed, whatever else ``candidates`` holds: a run never goes to, and its record
    never names as the next best, another tenant's board."""
    if not namespace:
        raise ValueError("a run sent to any board is routed within one namespace: name it")
    own = [device for device in candidates if namespace in (device.namespace_id, device.cache_namespace)]
    return router.plan(own, asked)


def record_run(payload: RunReport | dict) -> InferenceRun | None:
    """Store a board's report as an InferenceRun and broadcast it (once, however often delivered).

    A report that does not follow the contract, is not signed by its enrolled board, or answers
    a request that was not dispatched to that board is refused (logged) and stores nothing.
    """
    report, device, _ = receive_board_message(RunReport, payload)
    if device is None or not answers_dispatch(device, report.request_id, "run"):
        return None
    breakdown = report.breakdown
    accepted = acceptable_entries(device, report.uploaded)
    # The entries the run used and stored, by name (the run page lists them; the Cache page reads
    # what an entry holds from the prompt of the run that stored it: dashboard.pages.entry_preview).
    entries = {"fetched": list(report.fetched), "stored": stored_entries(accepted)}
    asked = asked_of(report.request_id)
    audited = entry_audits.sample(device, report)  # before the request is emptied: an audit recomputes it
    moved = Dispatch.objects.filter(request_id=report.request_id).values_list("routing", flat=True).first() or {}
    moved = moved.get("moved") if isinstance(moved, dict) else None
    with transaction.atomic():
        run, created = InferenceRun.objects.get_or_create(
            request_id=report.request_id,
            defaults={
                "device": device,
                "source": report.meta.source,
                "title": report.meta.title,
                "expected_answer": report.meta.expected_answer,
                "prompt": report.prompt,
                "text": report.text,
                "error": report.error,
                "breakdown": {
                    **breakdown.as_dict(),
                    **({"modules_hit": report.modules_hit} if report.modules_hit is not None else {}),
                    **({"entries": entries} if entries["fetched"] or entries["stored"] else {}),
                    **({"asked": asked} if asked else {}),
                    **({"resent_from": moved} if moved else {}),
                },
                "case": breakdown.case.value
                if not report.error or report.error == CANCELLED
                else "",  # a cancelled run was served: its case holds
                "ttft_ms": breakdown.ttft_ms,
                "ttlt_ms": breakdown.ttlt_ms,
                "prompt_tokens": breakdown.prompt_tokens,
                "matched_tokens": breakdown.matched_tokens,
                "state_bytes": breakdown.state_bytes,
            },
        )
        if not created:
            if run.error.startswith(LOST_PREFIX) and (
                not report.error or (report.error == CANCELLED and len(report.text) >= len(run.text))
            ):
                # The board was slow, not gone (nobody else answered): its answer replaces the run
                # given up on; one it stopped (its client left) keeps what it answered.
                _answer_lost_run(run, report)
                transaction.on_commit(lambda: broadcast("run", run_json(run)))
            return run  # a redelivered message: stored once, broadcast once
        Dispatch.objects.filter(request_id=report.request_id, outcome="").update(outcome="answered", request={})
        transaction.on_commit(lambda: admission.answered(device.namespace_id, report.request_id))  # no longer under way
        mirror.record_uploads([entry.dump() for entry in accepted], device.name)
        mirror.record_hits(report.fetched)
        Device.objects.filter(pk=device.pk).update(last_seen=timezone.now())
        transaction.on_commit(lambda: broadcast("run", run_json(run)))
    if audited is not None:
        entry_audits.dispatch_audit(*audited)
    return run


LOST_PREFIX = "lost: "


def asked_of(request_id: str) -> dict:
    """What a run asked for that its report does not say (the request is emptied once answered):
    the tokens asked for, the sampling, a chat's turns. "Run again" fills the Run page with it."""
    request = Dispatch.objects.filter(request_id=request_id).values_list("request", flat=True).first() or {}
    if not request:
        return {}
    asked = {"max_tokens": request.get("max_tokens")}
    sampling = request.get("sampling") or {}
    asked.update({name: sampling[name] for name in ("temperature", "top_p", "seed") if name in sampling})
    if request.get("messages"):
        asked["messages"] = [{"role": m["role"], "content": m["content"]} for m in request["messages"]]
    return asked


def _answer_lost_run(run: InferenceRun, report: RunReport) -> None:
    breakdown = report.breakdown
    run.text, run.error, run.breakdown = report.text, report.error, breakdown.as_dict()
    run.case, run.ttft_ms, run.ttlt_ms = (
        breakdown.case.value if not report.error else "",
        breakdown.ttft_ms,
        breakdown.ttlt_ms,
    )
    run.prompt_tokens, run.matched_tokens, run.state_bytes = (
        breakdown.prompt_tokens,
        breakdown.matched_tokens,
        breakdown.state_bytes,
    )
    run.save()
    Dispatch.objects.filter(request_id=report.request_id).update(outcome="answered", request={})


def answers_dispatch(device: Device, request_id: str, kind: str) -> bool:
    """True when ``request_id`` was dispatched (as ``kind``) to ``device`` or to any board of its namespace."""
    dispatch = Dispatch.objects.filter(request_id=request_id, kind=kind).first()
    if dispatch is not None and dispatch.answerable_by(device):
        return True
    security_event(
        "report_refused",
        device=device.name,
        request_id=request_id,
        reason="no such request was dispatched"
        if dispatch is None
        else f"dispatched to {dispatch.device.name if dispatch.device else 'namespace ' + dispatch.namespace}",
    )
    return False


def run_json(run: InferenceRun) -> dict:
    """A run as the pages receive it live: with its error in the page's words and its device's
    updated figures (the device cards show them without a reload)."""
    from django.urls import reverse

    return {
        "id": run.pk,
        "request_id": str(run.request_id),
        "device": run.device.name,
        "device_color": device_color(run.device),
        "created": run.created.isoformat(),
        "title": run.title,
        "source": run.source,
        "text": run.text,
        "error": run.error,
        "error_message": explain_error(run.error),
        "cancelled": run.error == CANCELLED,  # its text: what was answered until then
        "expected_answer": run.expected_answer,
        "breakdown": run.breakdown,
        # TTFT and TTLT as the sums of their parts, as shown (the answer card, the stacked chart).
        "time_sums": {key: total.as_dict() for key, total in time_sums(run.breakdown or {}).items()}
        if run.breakdown
        else None,
        "hit_tier": hit_tier(run.case, (run.breakdown or {}).get("tier")),  # the hit-ratio chart's tier ("" for a miss)
        "served_from": run.served_from,  # where its prompt came from, in every page's words
        "served_from_label": run.source_label,
        "approximate": run.approximate_label,  # "approximate: cross-class from <class>" when another kernel class's state was used
        "explanation": explain_run(
            text=run.text, error=run.error, expected_answer=run.expected_answer, breakdown=run.breakdown
        ),
        "url": reverse("run-detail", args=[run.pk]),
        "device_figures": run_figures(run.device),
    }


def dispatch_api_run(
    device: Device,
    request: RunRequest,
    *,
    expires: int,
    routed: router.Routed | None = None,
    announce: bool = True,
    listening: Callable[[], None] | None = None,
) -> dict:
    """Send a run of the OpenAI-compatible API (``dashboard.api``) to ``device``'s queue; returns
    the ``run.dispatched`` live event, broadcast here unless ``announce`` is False (the caller
    then sends it, off its answer's path).

    ``request`` streams (its tokens come back on its pub/sub channel; the caller subscribes
    before it is sent: ``listening()``, called between its record and its sending, returns once
    the subscription is confirmed, so that its round trip runs beside the record's write and the
    seal; should it raise, the run ends as lost, never sent). It is recorded as any run is, from
    the board's signed report. It expires with the API's timeout: a board that would start it
    later finds its client gone.
    """
    if not request.stream:
        raise ValueError("an API run streams its answer back: build its RunRequest with stream=True")
    here = routed if routed is not None and routed.device.pk == device.pk else router.named(device, request)
    record, request = here.record, here.request(request)  # it carries the tokens routing made of its prompt
    now = timezone.now()
    row = Dispatch.objects.create(
        request_id=request.request_id,
        kind="run",
        device=device,
        namespace=request.namespace,
        routing=record,
        request=request.dump(),
        expires_at=now + timedelta(seconds=expires),
        waits_until=now + timedelta(seconds=expires),
    )
    router.STATE.feed(str(row.request_id), device.name, record, row.created)
    sealed = sealed_for_board(device, Task.RUN_PROMPT, request.dump(), expires)
    if listening is not None:
        try:
            listening()
        except BaseException as exc:
            lose(row, f"its answer's stream could not be followed ({type(exc).__name__}), so it was never sent")
            raise
    send_sealed(device, Task.RUN_PROMPT, sealed, request.request_id, expires)
    event = {"request_id": request.request_id, "device": device.name, "title": request.meta.title}
    if announce:
        broadcast("run.dispatched", event)
    log.info("dispatched api run %s to %s", request.request_id, device.name)
    return event


# -- a run's client follows it: what it heard, where it moved, what it had ---------------------------
def heard(device: str, request_id: str, now: float | None = None) -> None:
    """The follower of run ``request_id`` heard its board ``device`` on the run's stream (a stage, a
    token): the board is alive and took the run, whatever its heartbeats' delay under load. The
    sweeper reads it (``actions.sweeper``). Best effort: a cache box that does not answer loses
    a mark, and the board's heartbeats still count."""
    now = time.time() if now is None else now
    ttl = settings.EDGECACHE_TASK_EXPIRES + 60
    value = repr(now).encode()
    try:
        store = kept_cachebox()
        store.set_flag(heard_key_name(device), ttl, value)
        store.set_flag(heard_key_name(device, request_id), ttl, value)
    except CacheBoxError as exc:
        log.warning("run %s: what its follower heard was not noted (%s)", request_id, exc)


def continue_run(request_id: str, device: str, tokens: list[int], text: str) -> bool:
    """Send run ``request_id``, moved to board ``device`` by the sweeper (``Dispatch.moving``), to
    that board, going on from the answer its client already has: ``tokens`` (the first board's,
    forced there) and ``text``. Its follower calls this once it listens to ``device``'s channel, so
    no event of the new board is missed; the sweeper calls it with nothing streamed when no
    follower did. False when the run is not (or no longer) waiting to be sent there."""
    from kombu.exceptions import OperationalError

    dispatch = (
        Dispatch.objects.select_related("device")
        .filter(request_id=request_id, outcome="", moving=True, device__name=device)
        .first()
    )
    if dispatch is None or not dispatch.request:
        return False
    if not Dispatch.objects.filter(pk=dispatch.pk, moving=True).update(moving=False):
        return False  # sent already (the follower and the sweeper both tried)
    request = RunRequest.parse(dispatch.request)
    moved = (dispatch.routing or {}).get("moved") or {}
    tokens = list(tokens)[: max(0, request.max_tokens - 1)]  # the new board chooses at least the last one itself
    if tokens:
        request = request.model_copy(
            update={"continues": Continuation(tokens=tokens, text=text, device=str(moved.get("from", ""))[:64])}
        )
    ttl = (
        max(1.0, (dispatch.expires_at - dispatch.created).total_seconds())
        if dispatch.expires_at
        else settings.EDGECACHE_TASK_EXPIRES
    )
    try:
        send_to_board(dispatch.device, Task.RUN_PROMPT, request.dump(), ttl)
    except OperationalError as exc:
        lose(
            Dispatch.objects.select_related("device", "device__namespace").get(pk=dispatch.pk),
            f"{moved.get('why', 'its board stopped answering')}; re-sending it failed ({exc})",
        )
        return False
    log.warning(
        "run %s sent to %s, going on from %d tokens of %s", request_id, device, len(tokens), moved.get("from", "?")
    )
    broadcast(
        "run.dispatched",
        {"request_id": request_id, "device": device, "title": request.meta.title, "resent_from": moved.get("from", "")},
    )
    return True


def keep_streamed(request_id: str, text: str) -> None:
    """What run ``request_id``'s client had when its follower stopped following it without an
    answer (the board fell silent, the run was given up on): a run that ends unanswered keeps
    it, as a cancelled one keeps what was answered."""
    if not text:
        return
    Dispatch.objects.filter(request_id=request_id, outcome="").update(streamed=text)
    with transaction.atomic():
        run = (
            InferenceRun.objects.select_for_update()
            .filter(request_id=request_id, error__startswith=LOST_PREFIX)
            .first()
        )
        if run is None or len(run.text) >= len(text):
            return
        run.text = text
        run.save(update_fields=["text"])
        transaction.on_commit(lambda: broadcast("run", run_json(run)))


LOST = "lost: {why}. Nothing was answered; send it again"


LOST_STREAMED = "lost: {why}. The answer stopped after what is shown; send it again for a whole one"


def lose(dispatch: Dispatch, why: str) -> InferenceRun | None:
    """End the run as failed, with why, keeping the answer its client had (``Dispatch.streamed``;
    a follower still listening adds it when it hears the error: ``actions.runs.keep_streamed``).
    Its board is not told to drop it: its late answer replaces this. None when it ended otherwise meanwhile."""
    streamed = Dispatch.objects.filter(pk=dispatch.pk).values_list("streamed", flat=True).first() or ""
    error = (LOST_STREAMED if streamed else LOST).format(why=why)
    return _end_unanswered(dispatch, "lost", error, text=streamed, cancel=False)[1]


REVOKED = "revoked: {who} took it back from the queue before its board answered. Nothing was answered; send it again"


def revoke(user, dispatch: Dispatch) -> bool:
    """Take a run under way back from its queue (the Queue page's Revoke): its board drops it if it
    ever takes it (a signed cancel flag; one already decoding stops at its next token), and it ends
    as a failed run saying who revoked it. False when it ended otherwise meanwhile."""

    ended, _ = _end_unanswered(dispatch, "revoked", REVOKED.format(who=getattr(user, "username", "") or "someone"))
    if ended:
        audit(
            user,
            AuditAction.RUN_REVOKE,
            str(dispatch.request_id),
            f"on {dispatch.device.name if dispatch.device else 'namespace ' + dispatch.namespace}",
        )
    return ended


def _end_unanswered(
    dispatch: Dispatch, outcome: str, error: str, *, text: str = "", cancel: bool = True
) -> tuple[bool, InferenceRun | None]:
    """End a dispatch nobody answered as ``outcome`` (lost, revoked): a failed run with ``error``
    (broadcast, so every page that lists runs shows it) keeping ``text``, its board told to drop
    it (``cancel``), its waiting client told at once. (False, None) when it ended otherwise meanwhile (one conditional update
    decides); the run is None for a dispatch to no board in particular."""

    if not Dispatch.objects.filter(pk=dispatch.pk, outcome="").update(outcome=outcome):
        return False, None
    request_id = str(dispatch.request_id)
    meta = (
        RunMeta.parse(dispatch.request.get("meta", {}))
        if isinstance(dispatch.request, dict) and dispatch.request.get("meta")
        else RunMeta()
    )
    prompt = RunRequest.parse(dispatch.request).prompt_text if dispatch.request else ""
    run = None
    if dispatch.device is not None:
        with transaction.atomic():
            run, created = InferenceRun.objects.get_or_create(
                request_id=request_id,
                defaults={
                    "device": dispatch.device,
                    "source": meta.source,
                    "title": meta.title,
                    "expected_answer": meta.expected_answer,
                    "prompt": prompt,
                    "error": error,
                    "text": text,
                },
            )
            if created:
                transaction.on_commit(lambda: broadcast("run", run_json(run)))
        if cancel:
            cancel_on(dispatch.device, request_id)
        publish_event(
            dispatch.device,
            request_id,
            StreamEvent(type="error", request_id=request_id, device=dispatch.device.name, error=error[:10_000]),
        )
    Dispatch.objects.filter(pk=dispatch.pk).update(request={})
    log.warning("run %s %s", request_id, error)
    return True, run


def publish_event(device: Device, request_id: str, event: StreamEvent) -> None:
    """A control-plane event on the run's channel of ``device`` (best effort: the record is the truth)."""

    sealed = seal(
        event.compact(),
        kind=Kind.STREAM,
        sender=CONTROL,
        to=request_id,
        signer=control_plane_signer(),
        ring=device_ring(device),
    )
    try:
        cachebox().publish(stream_channel(device.name, request_id), json.dumps(sealed, separators=(",", ":")).encode())
    except CacheBoxError as exc:
        log.warning("run %s: its client was not told (%s)", request_id, exc)


def cancel_on(device: Device, request_id: str) -> None:
    """Tell ``device``'s board to drop the run if it ever takes it (it came back, say)."""

    try:
        cachebox().set_flag(
            cancel_key_name(device.name, request_id),
            settings.EDGECACHE_TASK_EXPIRES + 60,
            cancel_flag(device.name, request_id),
        )
    except CacheBoxError as exc:
        log.warning("run %s: its first board was not told to drop it (%s)", request_id, exc)


def split_segments(text: str, separator: str | None) -> list[str]:
    """Cut ``text`` after every ``separator`` (kept), giving explicit range boundaries."""
    if not separator:
        return [text]
    separator = separator.encode().decode("unicode_escape")  # let "\n\n" be typed on a shell
    pieces = text.split(separator)
    segments = [piece + separator for piece in pieces[:-1]] + [pieces[-1]]
    return [segment for segment in segments if segment]

"""Cache-aware routing on the control plane: which board answers a prompt sent to "any board".

The choice is ``inference.routing.route`` (the same function ``bench fleet`` measures), fed
from what the control plane already keeps:

- **what each board holds**: its routing history. Every dispatched run keeps its prompt's
  prefix keys in ``Dispatch.routing``; a board's context is its last dispatched prompt, its
  RAM tier the ones before, within the budget its heartbeat reports (``ram_tier``);
- **what the cache box holds**: the entry mirror (``CacheEntry``), for the board's namespace and model;
- **its rates**: the prefill and decode times of its recent runs;
- **its queue**: runs dispatched to it and not reported yet (within the task expiry).

The prompt is tokenized with the control plane's vocabulary of the model (the tokens a board
computes for the same segments or chat messages). Runs to a named board keep the same
record, so the history is whole whichever way a run was sent.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from cachebox.keys import entry_key_name
from cachebox.link import LinkProfile
from cachebox.models import CacheEntry
from inference.routing import HISTORY, RATE_SAMPLES, FleetIndex, PromptKeys, prompt_keys, route

from .models import Device, Dispatch, InferenceRun

log = logging.getLogger("dashboard.routing")


@dataclass(frozen=True)
class Prompt:
    """A prompt as the router sees it: its segments or chat messages (none for a schema run)."""

    segments: tuple[str, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()
    max_tokens: int = 16


@dataclass(frozen=True)
class Routed:
    device: Device
    record: dict  # kept on the Dispatch (``routing``) and shown with the run


@functools.lru_cache(maxsize=2)
def _vocabulary(model: str):
    from inference.engine import Vocabulary
    from inference.model_file import resolve_model

    return Vocabulary.load(resolve_model(model or None))


def prompt_tokens(prompt: Prompt) -> tuple[list[int], tuple[int, ...]] | None:
    """The tokens a board computes for ``prompt`` and where it cuts them besides the grid (where its
    last segment begins, where a chat's messages begin); None: a schema run, or no vocabulary here."""
    if not prompt.segments and not prompt.messages:
        return None
    try:
        vocabulary = _vocabulary(settings.EDGECACHE_MODEL)
        if prompt.messages:
            from inference.chat import chat_prompt

            chat = chat_prompt(vocabulary, list(prompt.messages))
            return chat.tokens, chat.cuts
        tokens: list[int] = []
        starts: list[int] = []
        for index, segment in enumerate(prompt.segments):
            starts.append(len(tokens))
            tokens += vocabulary.tokenize(segment, add_bos=index == 0)
        return tokens, tuple(starts[-1:]) if len(starts) > 1 else ()
    except Exception as exc:  # routing then weighs queues only; the board reports any real error
        log.warning("prompt not tokenized for routing: %s", exc)
        return None


def keys_for(device: Device, layout: tuple[list[int], tuple[int, ...]] | None) -> PromptKeys:
    """The prefix keys ``device`` uses for a prompt's tokens and cuts (its namespace and model; none
    before its first heartbeat)."""
    fingerprint = (device.status or {}).get("fingerprint")
    if not layout or not layout[0] or not isinstance(fingerprint, str) or not fingerprint:
        return PromptKeys()
    tokens, cuts = layout
    try:
        return prompt_keys(device.cache_namespace, fingerprint, tokens, grid=settings.EDGECACHE_BOARD.chunk_tokens, extra=cuts)
    except ValueError:
        return PromptKeys()


def link_of(device: Device) -> LinkProfile | None:
    if not device.link_bandwidth_mbps:
        return None
    return LinkProfile(device.link_bandwidth_mbps, device.link_rtt_ms or 0.0)


def ram_budget(device: Device) -> int:
    ram = (device.status or {}).get("ram_tier")
    budget = ram.get("budget_bytes") if isinstance(ram, dict) else 0
    return budget if isinstance(budget, int) and budget > 0 else 0


def cachebox_tokens(device: Device, keys: PromptKeys) -> int:
    """Leading tokens of the prompt whose entries the cache box holds for ``device`` (the mirror)."""
    if not keys.keys:
        return 0
    fingerprint = device.status["fingerprint"]
    names = {entry_key_name(device.cache_namespace, fingerprint, bytes.fromhex(key)): key for key in keys.keys}
    present = {names[name] for name in CacheEntry.objects.filter(key__in=list(names)).values_list("key", flat=True)}
    return keys.held(present)


def fleet_index(devices: list[Device]) -> FleetIndex:
    """The routing history of ``devices``: recent dispatches (oldest first), their reports, rates."""
    index = FleetIndex(prefill_prior=settings.EDGECACHE_BOARD.prefill_ms_per_token)
    now = timezone.now()
    expired_before = now - timedelta(seconds=settings.EDGECACHE_TASK_EXPIRES)
    for device in devices:
        # Plain rows, not model instances: this runs for every routed request.
        dispatches = list(Dispatch.objects.filter(device=device, kind="run").order_by("-created").values_list("request_id", "created", "routing")[:HISTORY])[::-1]
        reported = {
            str(run_id): (error, created)
            for run_id, error, created in InferenceRun.objects.filter(request_id__in=[row[0] for row in dispatches]).values_list("request_id", "error", "created")
        }
        for dispatch_id, created, record in dispatches:
            request_id = str(dispatch_id)
            record = record or {}
            index.dispatched(device.name, request_id, PromptKeys.from_dict(record.get("prompt")), _number(record.get("work_ms")), at=created.timestamp())
            run = reported.get(request_id)
            if run is not None:
                index.reported(device.name, request_id, failed=bool(run[0]), at=run[1].timestamp())
            elif created < expired_before:
                index.reported(device.name, request_id, failed=True)  # it expired: it holds nothing of it, owes nothing
        for run in InferenceRun.objects.filter(device=device, error="").order_by("-created").values("request_id", "breakdown")[:RATE_SAMPLES][::-1]:
            b = run["breakdown"] if isinstance(run["breakdown"], dict) else {}
            index.reported(
                device.name, str(run["request_id"]), prompt_tokens=int(_number(b.get("prompt_tokens"))), matched_tokens=int(_number(b.get("matched_tokens"))),
                prefill_ms=_number(b.get("prefill_ms")), decode_ms=_number(b.get("decode_ms")), generated_tokens=int(_number(b.get("generated_tokens"))),
            )
    return index


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= 0 else 0.0


def plan(devices: list[Device], prompt: Prompt, *, preferred: str = "", policy: str = "cache-aware", all_online: bool = False) -> Routed | None:
    """The board of ``devices`` that should answer ``prompt`` (None when none is online), with the
    record the Dispatch keeps: the choice, its expected time and saving, and the prompt's keys."""
    if not devices:
        return None
    layout = prompt_tokens(prompt)
    tokens = layout[0] if layout else None
    index = fleet_index(devices)
    now = timezone.now().timestamp()
    keys = {device.name: keys_for(device, layout) for device in devices}
    views = [
        index.view(
            device.name, keys[device.name], online=all_online or device.online, link=link_of(device), ram_budget_bytes=ram_budget(device),
            cachebox_tokens=cachebox_tokens(device, keys[device.name]), now=now,
        )
        for device in devices
    ]
    chosen = route(len(tokens or ()), views, preferred=preferred)
    if chosen is None:
        return None
    device = next(device for device in devices if device.name == chosen.board)
    record = {
        **chosen.record(),
        "policy": policy,
        "work_ms": round(index.work_ms(device.name, keys[device.name], prompt.max_tokens, link_of(device)), 3),
        "prompt": keys[device.name].as_dict(),
    }
    return Routed(device, record)


def history(device: Device, prompt: Prompt) -> dict:
    """The record of a run sent to a named board: its prompt's keys and expected work (no choice made)."""
    routed = plan([device], prompt, policy="named", all_online=True)  # it waits in the board's queue if it is away
    return routed.record if routed is not None else {}


def shown(record: dict) -> dict:
    """The part of a routing record a run keeps and shows (without the prompt's keys)."""
    return {key: value for key, value in (record or {}).items() if key not in ("prompt", "work_ms")}


def api_prompt(request) -> Prompt:
    """An API run's prompt (a ``RunRequest``) as the router sees it."""
    if request.is_schema_run:
        return Prompt(max_tokens=request.max_tokens)
    return Prompt(segments=tuple(request.segments), messages=tuple((m.role, m.content) for m in request.messages), max_tokens=request.max_tokens)

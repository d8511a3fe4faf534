"""Which board answers an API request, within the key's namespace only.

- ``edgecache.device`` names one: it must be a device of the key's namespace (any other name
  is a 404, whether or not another tenant has it), serve the model and be online.
- Otherwise the online board of the namespace serving the model that is expected to answer
  first (``dashboard.router``: what each board holds of the prompt, its queue, its rates);
  ``prompt_cache_key`` is a hint: the board that last served it wins a tie.

A model is named by what boards report in their heartbeat: the model file's name
(``Device.status["model"]``) or its fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import datetime
from datetime import timezone as dt_timezone

from django.core.cache import cache

from dashboard.api.errors import ApiError, bad_request
from dashboard.api.requests import ApiRequest
from dashboard.models import ApiKey, Device
from dashboard.router import CANDIDATES, Routed, plan
from dashboard.store.django_cache import CACHE_SERVER_ERRORS
from inference.contract.messages import RunRequest
from inference.engine.model_file import ModelNotFound, resolve_model

log = logging.getLogger("dashboard.api")

CACHE_KEY_TTL_S = 24 * 3600  # how long a prompt_cache_key remembers its board
START_A_BOARD = "start one with `edgecache-board --name NAME` on the board (a device registered on the Devices page, in this key's namespace; REDIS_URL names the cache box)"


def serves(device: Device, model: str) -> bool:
    status = device.status or {}
    return bool(model) and model in (status.get("model"), status.get("fingerprint"))


def namespace_devices(namespace: str) -> list[Device]:
    """The key's namespace's devices that are not revoked (``dashboard.router.Candidates``: read at most once a second)."""
    return CANDIDATES.of(namespace)


def _moment(roster) -> datetime:
    """When the roster's liveness is judged (``Roster.judged_at``), as a date."""
    return datetime.fromtimestamp(roster.judged_at(time.time()), tz=dt_timezone.utc)


def online_models(namespace: str) -> list[dict]:
    """The models the namespace's online boards serve: id, fingerprint, boards, first seen."""
    models: dict[str, dict] = {}
    roster = CANDIDATES.roster(namespace)
    when = _moment(roster)
    for device in roster.devices:
        status = device.status or {}
        model = status.get("model")
        if not device.online_at(when) or not isinstance(model, str) or not model:
            continue
        entry = models.setdefault(
            model, {"id": model, "fingerprint": status.get("fingerprint", ""), "devices": [], "created": device.created}
        )
        entry["devices"].append(device.name)
        entry["created"] = min(entry["created"], device.created)
    return sorted(models.values(), key=lambda entry: entry["id"])


def example_model(namespace: str) -> str:
    """A model name a request of ``namespace`` may send: one its online boards serve, else one its
    boards reported, else the configured model's file name (what a board of it will report)."""
    online = online_models(namespace)
    if online:
        return online[0]["id"]
    for device in namespace_devices(namespace):
        model = (device.status or {}).get("model")
        if isinstance(model, str) and model:
            return model
    from django.conf import settings

    try:
        return resolve_model(settings.EDGECACHE_MODEL or None).path.name
    except (ModelNotFound, OSError):
        return "MODEL-NAME (GET /v1/models lists them)"


def online_boards(namespace: str) -> int:
    """How many boards of ``namespace`` are online, as this process read them less than a second
    ago (the size of its bounded queue, ``dashboard.admission``), without routing."""
    roster = CANDIDATES.roster(namespace)
    return roster.online_count(roster.judged_at(time.time()))


def choose_route(key: ApiKey, request: ApiRequest, run: RunRequest) -> tuple[Device, Routed | None, int]:
    """The board that answers ``request`` (whose prompt is ``run``), the router's record when it
    chose it, and how many boards of the key's namespace are online (its bounded queue's size,
    ``dashboard.admission``). The devices are those this process read less than a second ago; a
    request they cannot serve (no board online, an unknown model or device) is weighed again on
    the devices as the database has them now before it is refused: a board that came online in
    that second (its heartbeat recorded by a control worker, seen by another web process) serves it."""
    try:
        return _choose(CANDIDATES.roster(key.namespace_id), key, request, run)
    except ApiError:
        return _choose(CANDIDATES.roster(key.namespace_id, fresh=True), key, request, run)


def _choose(roster, key: ApiKey, request: ApiRequest, run: RunRequest) -> tuple[Device, Routed | None, int]:
    devices = roster.devices
    now = roster.judged_at(time.time())
    when = datetime.fromtimestamp(now, tz=dt_timezone.utc)
    online_boards = roster.online_count(now)
    if request.device:
        return _named(devices, request.device, request.model, key.namespace_id, when), None, online_boards
    known = roster.serving(request.model)
    if not known:
        served = sorted(
            {
                (device.status or {}).get("model")
                for device in devices
                if device.online_at(when) and (device.status or {}).get("model")
            }
        )
        listed = (
            f"online boards of namespace {key.namespace_id!r} serve {', '.join(served)}"
            if served
            else f"no board of namespace {key.namespace_id!r} is online"
        )
        raise bad_request(
            f"The model {request.model!r} does not exist here ({listed}); GET /v1/models lists them.",
            param="model",
            code="model_not_found",
        )
    if not known.online_count(now):
        names = ", ".join(device.name for device in known.devices)
        raise ApiError(
            503,
            f"No board serving {request.model!r} is online (its devices: {names}); {START_A_BOARD}.",
            type="server_error",
            code="no_board_online",
        )
    remembered = _remembered(key.namespace_id, request.prompt_cache_key) if request.prompt_cache_key else None
    # Online a moment ago is online for this choice (a heartbeat late by a few ms must not leave none).
    routed = plan(known, run, preferred=remembered or "", online_at=now)
    return routed.device, routed, online_boards


def _named(devices: list[Device], name: str, model: str, namespace: str, when: datetime) -> Device:
    device = next((device for device in devices if device.name == name), None)
    if device is None:
        # The same answer whether another namespace has such a device or none does: a key learns nothing outside its own.
        raise ApiError(
            404,
            f"No device named {name!r} in this key's namespace {namespace!r}; GET /v1/models lists the boards it reaches.",
            param="edgecache.device",
            code="device_not_found",
        )
    if not device.online_at(when):
        raise ApiError(
            503,
            f"Device {name!r} is not online; {START_A_BOARD.replace('NAME', name)}, or leave 'edgecache.device' out to use any online board.",
            type="server_error",
            code="no_board_online",
        )
    if not serves(device, model):
        actual = (device.status or {}).get("model") or "no model yet"
        raise bad_request(f"Device {name!r} serves {actual!r}, not {model!r}.", param="model", code="model_not_found")
    return device


def _cache_name(namespace: str, prompt_cache_key: str) -> str:
    return f"api:prompt-cache-key:{namespace}:{hashlib.sha256(prompt_cache_key.encode()).hexdigest()[:32]}"


def _remembered(namespace: str, prompt_cache_key: str) -> str | None:
    try:
        return cache.get(_cache_name(namespace, prompt_cache_key))
    except CACHE_SERVER_ERRORS as exc:  # routing falls back to the least recently used board
        log.warning("prompt_cache_key not looked up: %s", exc)
        return None


def remember(namespace: str, prompt_cache_key: str, device: Device) -> None:
    """The board that served ``prompt_cache_key`` last (a hint for the next request with it)."""
    if not prompt_cache_key:
        return
    try:
        cache.set(_cache_name(namespace, prompt_cache_key), device.name, timeout=CACHE_KEY_TTL_S)
    except CACHE_SERVER_ERRORS as exc:
        log.warning("prompt_cache_key not remembered: %s", exc)

"""Which board answers an API request, within the key's namespace only.

- ``edgecache.device`` names one: it must be a device of the key's namespace (any other name
  is a 404, whether or not another tenant has it), serve the model and be online.
- Otherwise the online board of the namespace serving the model that is expected to answer
  first (``dashboard.routing``: what each board holds of the prompt, its queue, its rates);
  ``prompt_cache_key`` is a hint: the board that last served it wins a tie.

A model is named by what boards report in their heartbeat: the model file's name
(``Device.status["model"]``) or its fingerprint.
"""

from __future__ import annotations

import hashlib
import logging

from django.core.cache import cache

from cachebox.django_cache import CACHE_SERVER_ERRORS

from ..models import ApiKey, Device
from ..routing import Prompt, Routed, plan
from .errors import ApiError, bad_request
from .requests import ApiRequest

log = logging.getLogger("dashboard.api")

CACHE_KEY_TTL_S = 24 * 3600  # how long a prompt_cache_key remembers its board
START_A_BOARD = "start one with `python manage.py edge --name NAME` (a device registered on the Devices page, in this key's namespace)"


def serves(device: Device, model: str) -> bool:
    status = device.status or {}
    return bool(model) and model in (status.get("model"), status.get("fingerprint"))


def namespace_devices(namespace: str) -> list[Device]:
    """The key's namespace's devices that are not revoked."""
    return list(Device.objects.filter(namespace_id=namespace, revoked_at__isnull=True).select_related("namespace"))


def online_models(namespace: str) -> list[dict]:
    """The models the namespace's online boards serve: id, fingerprint, boards, first seen."""
    models: dict[str, dict] = {}
    for device in namespace_devices(namespace):
        status = device.status or {}
        model = status.get("model")
        if not device.online or not isinstance(model, str) or not model:
            continue
        entry = models.setdefault(model, {"id": model, "fingerprint": status.get("fingerprint", ""), "devices": [], "created": device.created})
        entry["devices"].append(device.name)
        entry["created"] = min(entry["created"], device.created)
    return sorted(models.values(), key=lambda entry: entry["id"])


def choose_device(key: ApiKey, request: ApiRequest) -> Device:
    """The board that answers ``request`` (ApiError 400/404/503 saying why there is none)."""
    return choose_route(key, request)[0]


def choose_route(key: ApiKey, request: ApiRequest) -> tuple[Device, Routed | None]:
    """The board that answers ``request`` and, when the router chose it, its routing record."""
    devices = namespace_devices(key.namespace_id)
    if request.device:
        return _named(devices, request.device, request.model, key.namespace_id), None
    known = [device for device in devices if serves(device, request.model)]
    if not known:
        served = sorted({(device.status or {}).get("model") for device in devices if device.online and (device.status or {}).get("model")})
        listed = f"online boards of namespace {key.namespace_id!r} serve {', '.join(served)}" if served else f"no board of namespace {key.namespace_id!r} is online"
        raise bad_request(f"The model {request.model!r} does not exist here ({listed}); GET /v1/models lists them.", param="model", code="model_not_found")
    online = [device for device in known if device.online]
    if not online:
        names = ", ".join(device.name for device in known)
        raise ApiError(503, f"No board serving {request.model!r} is online (its devices: {names}); {START_A_BOARD}.", type="server_error", code="no_board_online")
    remembered = _remembered(key.namespace_id, request.prompt_cache_key) if request.prompt_cache_key else None
    routed = plan(online, _prompt(request), preferred=remembered or "")
    return routed.device, routed


def _prompt(request: ApiRequest) -> Prompt:
    if request.pml or request.schema:
        return Prompt(max_tokens=request.max_tokens)
    messages = tuple((str(m.get("role", "")), str(m.get("content", ""))) for m in request.messages)
    return Prompt(segments=(request.prompt,) if request.prompt else (), messages=messages, max_tokens=request.max_tokens)


def _named(devices: list[Device], name: str, model: str, namespace: str) -> Device:
    device = next((device for device in devices if device.name == name), None)
    if device is None:
        # The same answer whether another namespace has such a device or none does: a key learns nothing outside its own.
        raise ApiError(404, f"No device named {name!r} in this key's namespace {namespace!r}; GET /v1/models lists the boards it reaches.", param="edgecache.device", code="device_not_found")
    if not device.online:
        raise ApiError(503, f"Device {name!r} is not online; {START_A_BOARD.replace('NAME', name)}, or leave 'edgecache.device' out to use any online board.", type="server_error", code="no_board_online")
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

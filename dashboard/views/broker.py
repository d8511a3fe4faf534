"""The message broker (the cache box's Redis) down: a 503 that says what was sent, never a 500."""

from __future__ import annotations

import logging

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from kombu.exceptions import OperationalError as BrokerUnavailable

from cachebox.store import CacheBox

from ..models import Device

log = logging.getLogger("dashboard.views")


BROKER_RETRY_AFTER = 30  # seconds a client is told to wait after the broker was unreachable


# -- the message broker (the cache box's Redis) down: 503, never a 500 ---------------------------
class _BrokerDown(Exception):
    def __init__(self, error: Exception, sent: list[dict], not_sent: list[str]):
        super().__init__(str(error))
        self.error, self.sent, self.not_sent = error, sent, not_sent


def _each_until_broker_fails(devices: list[Device], send) -> list[dict]:
    """``send(device)`` for each device in turn; if the broker fails, _BrokerDown says which
    devices got their message before it did (so the answer can say exactly what was sent)."""
    sent: list[dict] = []
    for index, device in enumerate(devices):
        try:
            sent.extend(send(device))
        except BrokerUnavailable as exc:
            raise _BrokerDown(exc, sent, [d.name for d in devices[index:]]) from exc
    return sent


def _broker_unavailable(request, down: _BrokerDown, wants_json: bool, page) -> HttpResponse:
    """503 with what happened and what to do; JSON for the page's script, else ``page(message)``."""
    where = CacheBox(
        settings.REDIS_URL
    ).safe_url  # the broker's server, which may not be the cache box's (no password shown)
    if down.sent:
        outcome = (
            f"sent to {', '.join(item['device'] for item in down.sent)} only; not sent to {', '.join(down.not_sent)}"
        )
    else:
        outcome = "nothing was sent"
    message = (
        f"The message broker (the Redis/Valkey server at {where}) is not reachable: start it (`make run` starts the embedded one) "
        f"or check REDIS_URL; {outcome}. Try again in {BROKER_RETRY_AFTER} seconds."
    )
    log.warning(
        "broker unreachable at %s (%s, %d sent, %d not): %s",
        where,
        request.path,
        len(down.sent),
        len(down.not_sent),
        down.error,
    )
    if wants_json:
        body = {
            "errors": {"__all__": [{"message": message, "code": "broker_unavailable"}]},
            "dispatched": down.sent,
            "retry_after": BROKER_RETRY_AFTER,
        }
        response = JsonResponse(body, status=503)
    else:
        response = page(message)
    response["Retry-After"] = str(BROKER_RETRY_AFTER)
    return response

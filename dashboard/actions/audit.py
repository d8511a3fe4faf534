"""The audit trail: who did what to devices, namespaces, schemas and the cache."""

from __future__ import annotations

import logging
from enum import StrEnum

from ..models import AuditEvent

log = logging.getLogger("dashboard.actions")


class AuditAction(StrEnum):
    DEVICE_REGISTER = "device.register"
    DEVICE_UPDATE = "device.update"
    DEVICE_ROTATE_TOKEN = "device.rotate_token"
    DEVICE_REVOKE = "device.revoke"
    DEVICE_ENROLL = "device.enroll"
    DEVICE_QUARANTINE = "device.quarantine"  # an audit found an entry of it not what it claims
    DEVICE_QUARANTINE_CLEAR = "device.quarantine_clear"
    NAMESPACE_CREATE = "namespace.create"
    NAMESPACE_UPDATE = "namespace.update"
    NAMESPACE_ROTATE_KEY = "namespace.rotate_key"
    CACHE_EVICT = "cache.evict"
    CACHE_PIN = "cache.pin"
    CACHE_UNPIN = "cache.unpin"
    CACHE_FLUSH = "cache.flush"
    SCHEMA_SAVE = "schema.save"
    SCHEMA_ENCODE = "schema.encode"
    SCHEMA_DELETE = "schema.delete"
    APIKEY_CREATE = "apikey.create"
    APIKEY_REVOKE = "apikey.revoke"
    RUN_REVOKE = "run.revoke"


def audit(user, action: AuditAction, target: str, detail: str = "") -> None:
    """One audit row (and log line); call it inside the verb's transaction."""

    action = AuditAction(action)  # a free string that is not an action fails here, not in a report
    AuditEvent.objects.create(
        user=user if user and user.is_authenticated else None, action=action.value, target=target[:200], detail=detail
    )
    log.info("audit user=%s action=%s target=%s %s", getattr(user, "username", None), action.value, target, detail)

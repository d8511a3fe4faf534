"""Verbs on devices and namespaces (tenants): registration, tokens, signing keys, board reports."""

from __future__ import annotations

import hmac
import logging

from django.db import transaction
from django.utils import timezone

from cachebox.errors import CacheBoxError
from cachebox.events import security_event
from cachebox.signing import wrap_key
from inference import devices as registry
from inference.messages import BoardMessage, Heartbeat

from ..live import broadcast
from ..models import Device, Namespace
from ..signing import sealed_ring
from .audit import AuditAction, audit
from .cache import cachebox

log = logging.getLogger("dashboard.actions")


def _record_for(device: Device) -> registry.DeviceRecord:
    return registry.DeviceRecord(
        name=device.name,
        token_sha256=device.token_sha256,
        threads=device.cpu_threads,
        link_bandwidth_mbps=device.link_bandwidth_mbps,
        link_rtt_ms=device.link_rtt_ms,
        revoked=device.revoked_at is not None,
        namespace=device.namespace_id,
        share=device.namespace.share_across_devices,
        keyring=sealed_ring(device),
    )


def publish_device(device: Device) -> bool:
    """Tell boards (through the cache box) the device's current token hash and settings.

    False when the cache box cannot be reached: the database stays the truth and
    ``publish_all_devices`` (run at every start) publishes it later.
    """
    try:
        registry.publish(cachebox(), _record_for(device))
        return True
    except CacheBoxError as exc:
        log.warning("device %s not published to the cache box: %s", device.name, exc)
        return False


def publish_all_devices() -> int:
    """Re-publish every device (after the cache box restarted empty)."""
    store = cachebox()
    count = 0
    for device in Device.objects.select_related("namespace"):
        registry.publish(store, _record_for(device))
        count += 1
    return count


def _changed(devices) -> None:
    """Publish changed devices to their boards (the registry in the cache box) and, once the
    change commits, tell the open pages. Call it after the verb's transaction block: a
    device record must not reach boards before the database holds it."""
    for device in devices:
        publish_device(device)
        transaction.on_commit(lambda device=device: broadcast("device", device_json(device)))


# -- namespaces (tenants) and their signing keys ---------------------------------------------------
def save_namespace(user, namespace: Namespace) -> None:
    """Create or change a namespace; its boards learn the sharing setting at their next heartbeat."""
    created = namespace.pk is None or not Namespace.objects.filter(pk=namespace.pk).exists()
    with transaction.atomic():
        namespace.save()
        audit(user, AuditAction.NAMESPACE_CREATE if created else AuditAction.NAMESPACE_UPDATE, namespace.name, f"share_across_devices={namespace.share_across_devices}")
    _changed(namespace.devices.all())


def rotate_signing_key(user, namespace: Namespace) -> int:
    """A new signing key for the namespace; returns its generation.

    Boards receive it sealed at their next heartbeat (a few seconds) and sign with it from
    then on; entries signed with the previous key stay valid, older ones are refused.
    """
    with transaction.atomic():
        namespace = Namespace.objects.select_for_update().get(pk=namespace.pk)
        namespace.key_generation += 1
        namespace.key_rotated_at = timezone.now()
        namespace.save(update_fields=["key_generation", "key_rotated_at"])
        audit(user, AuditAction.NAMESPACE_ROTATE_KEY, namespace.name, f"generation {namespace.key_generation}")
    _changed(namespace.devices.all())
    return namespace.key_generation


# -- devices -----------------------------------------------------------------------------------------
def _set_token(device: Device) -> str:
    token = registry.new_token()
    device.token_sha256 = registry.hash_token(token)
    device.wrap_key = wrap_key(token).hex()
    device.token_hint = token[:6]
    device.token_created = timezone.now()
    device.revoked_at = None
    return token


def register_device(user, **fields) -> tuple[Device, str]:
    """Create a device and its token; the token is returned once and only its hash is kept."""
    device = Device(**fields)
    token = _set_token(device)
    with transaction.atomic():
        device.save()
        audit(user, AuditAction.DEVICE_REGISTER, device.name)
    _changed([device])
    return device, token


def update_device(user, device: Device) -> None:
    with transaction.atomic():
        device.save()
        audit(user, AuditAction.DEVICE_UPDATE, device.name)
    _changed([device])


def rotate_token(user, device: Device) -> str:
    """A new token for the device; the old one stops working at once."""
    token = _set_token(device)
    with transaction.atomic():
        device.save()
        audit(user, AuditAction.DEVICE_ROTATE_TOKEN, device.name)
    _changed([device])
    return token


def revoke_device(user, device: Device) -> None:
    """Refuse the device's token from now on (its board stops serving at its next task)."""
    device.revoked_at = timezone.now()
    with transaction.atomic():
        device.save(update_fields=["revoked_at"])
        audit(user, AuditAction.DEVICE_REVOKE, device.name)
    _changed([device])


def authenticate_board(name: str, token: str) -> Device | None:
    """The device whose valid token this is, or None (logged) for an unknown, wrong or revoked one."""
    device = Device.objects.filter(name=name).first()
    if device is None or device.revoked_at is not None or not hmac.compare_digest(device.token_sha256, registry.hash_token(token or "")):
        reason = "unknown device" if device is None else ("revoked" if device.revoked_at else "wrong token")
        security_event("board_message_refused", device=name, reason=reason)
        return None
    return device


def receive_board_message(cls: type[BoardMessage], payload: BoardMessage | dict) -> tuple[BoardMessage | None, Device | None]:
    """A board's message checked at the boundary: (message, its device), or Nones (logged) when
    it does not follow the contract or its board does not authenticate."""
    message = payload if isinstance(payload, cls) else cls.receive(payload, receiver="control")
    if message is None:
        return None, None
    device = authenticate_board(message.device, message.token)
    return (message, device) if device is not None else (None, None)


def record_heartbeat(payload: Heartbeat | dict) -> Device | None:
    """A board lives: store its status (catalogs, model) and tell the open pages."""
    beat, device = receive_board_message(Heartbeat, payload)
    if device is None:
        return None
    device.last_seen = timezone.now()
    device.status = beat.status.dump()
    with transaction.atomic():
        device.save(update_fields=["last_seen", "status"])
        transaction.on_commit(lambda: broadcast("device", device_json(device)))
    return device


def device_json(device: Device) -> dict:
    return {
        "name": device.name,
        "online": device.online,
        "revoked": device.revoked_at is not None,
        "last_seen": device.last_seen.isoformat() if device.last_seen else None,
        "link": device.link_label,
    }

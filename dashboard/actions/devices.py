"""Verbs on devices and namespaces (tenants): registration, tokens, signing keys, board reports."""

from __future__ import annotations

import hmac
import logging
import time

from django.db import transaction
from django.utils import timezone

from cachebox.errors import CacheBoxError
from cachebox.events import security_event
from inference import devices as registry
from inference.identity import enroll_key, enroll_proof, verify_signature
from inference.messages import BoardMessage, EnrollRequest, Heartbeat

from ..live import broadcast
from ..models import Device, Namespace
from ..signing import sealed_ring
from ..stats import memory_label
from .audit import AuditAction, audit
from .cache import cachebox

log = logging.getLogger("dashboard.actions")

ENROLL_WINDOW_S = 600  # an enrollment request older than this (or from a clock this far off) is refused


def _record_for(device: Device, enrollment: dict | None = None) -> registry.DeviceRecord:
    return registry.DeviceRecord(
        name=device.name,
        token_sha256=device.token_sha256 if device.enroll_key else "",  # only while the token may still enroll
        signing_key=device.signing_public_key,
        box_key=device.box_public_key,
        enrollment=enrollment or {},
        threads=device.cpu_threads,
        memory_mb=device.memory_mb,
        link_bandwidth_mbps=device.link_bandwidth_mbps,
        link_rtt_ms=device.link_rtt_ms,
        revoked=device.revoked_at is not None,
        namespace=device.namespace_id,
        share=device.namespace.share_across_devices,
        keyring=sealed_ring(device),
    )


def publish_device(device: Device, enrollment: dict | None = None) -> bool:
    """Tell boards (through the cache box) the device's current token hash and settings.

    False when the cache box cannot be reached: the database stays the truth and
    ``publish_all_devices`` (run at every start) publishes it later.
    """
    try:
        registry.publish(cachebox(), _record_for(device, enrollment))
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
    """A new one-time enrollment token; the board enrolled before (if any) is refused from now on."""
    token = registry.new_token()
    device.token_sha256 = registry.hash_token(token)
    device.enroll_key = enroll_key(token).hex()
    device.signing_public_key = device.box_public_key = ""
    device.enrolled_at = None
    device.last_message_ts = 0.0
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


# What staff may change on a device; credentials and enrollment change only through their verbs.
EDITABLE_FIELDS = ("kind", "cpu_threads", "memory_mb", "link_bandwidth_mbps", "link_rtt_ms", "namespace")


def update_device(user, device: Device) -> None:
    """Save a device's settings (never its credentials or enrollment, whatever the instance holds)."""
    with transaction.atomic():
        device.save(update_fields=list(EDITABLE_FIELDS))
        audit(user, AuditAction.DEVICE_UPDATE, device.name)
    device.refresh_from_db()
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


def enroll_device(payload: dict) -> Device | None:
    """A board sends its public keys with a proof that it holds the device's token: the device is
    enrolled to those keys (the token is spent) and its ring is sealed to them. Refusals are
    logged, and published on the record so that the board that asked can say why."""
    request = EnrollRequest.receive(payload, receiver="control")
    if request is None:
        return None
    with transaction.atomic():
        device = Device.objects.select_for_update().filter(name=request.device).first()
        reason = ""
        if device is None:
            reason = "unknown device"
        elif device.revoked_at is not None:
            reason = "revoked"
        elif not device.enroll_key:
            reason = "the token was already used to enroll a board: rotate the token to enroll another one"
        elif abs(time.time() - request.ts) > ENROLL_WINDOW_S:
            reason = "the enrollment request is stale (check the board's clock)"
        else:
            expected = enroll_proof(bytes.fromhex(device.enroll_key), request.device, request.signing_public_key, request.box_public_key, request.ts)
            if not hmac.compare_digest(expected, request.proof):
                reason = "wrong token"
        if reason:
            security_event("enrollment_refused", device=request.device, reason=reason)
            if device is not None and device.signing_public_key != request.signing_public_key:
                publish_device(device, {"signing_key": request.signing_public_key, "reason": reason})
            return None
        device.signing_public_key = request.signing_public_key
        device.box_public_key = request.box_public_key
        device.enroll_key = ""  # spent: a token enrolls one board once
        device.enrolled_at = timezone.now()
        device.save(update_fields=["signing_public_key", "box_public_key", "enroll_key", "enrolled_at"])
        audit(None, AuditAction.DEVICE_ENROLL, device.name, f"signing key {device.signing_public_key[:16]}…")
    _changed([device])
    return device


def authenticate_board(name: str, payload: dict) -> Device | None:
    """The enrolled, unrevoked device whose board signed ``payload``, or None (logged)."""
    device = Device.objects.filter(name=name).select_related("namespace").first()
    reason = ""
    if device is None:
        reason = "unknown device"
    elif device.revoked_at is not None:
        reason = "revoked"
    elif not device.signing_public_key:
        reason = "not enrolled"
    elif not verify_signature(payload, device.signing_public_key):
        reason = "bad signature"
    if reason:
        security_event("board_message_refused", device=name, reason=reason)
        return None
    return device


def receive_board_message(cls: type[BoardMessage], payload: BoardMessage | dict) -> tuple[BoardMessage | None, Device | None]:
    """A board's message checked at the boundary: (message, its device), or Nones (logged) when
    it does not follow the contract or is not signed by its enrolled, unrevoked board."""
    message = cls.receive(payload, receiver="control")
    if message is None:
        return None, None
    device = authenticate_board(message.device, payload)
    return (message, device) if device is not None else (None, None)


def record_heartbeat(payload: dict) -> Device | None:
    """A board lives: store its status (catalogs, model) and tell the open pages.

    A heartbeat older than the last one accepted is a replay (or out of order): refused."""
    beat, device = receive_board_message(Heartbeat, payload)
    if device is None:
        return None
    with transaction.atomic():
        fresh = Device.objects.filter(pk=device.pk, last_message_ts__lt=beat.ts).update(last_message_ts=beat.ts)
        if not fresh:
            security_event("board_message_refused", device=device.name, reason="replayed or out-of-order heartbeat")
            return None
        device.last_seen = timezone.now()
        device.status = beat.status.dump()
        device.save(update_fields=["last_seen", "status"])
        transaction.on_commit(lambda: broadcast("device", device_json(device)))
    _republish_if_missing(device)
    return device


def _republish_if_missing(device: Device) -> None:
    """A live board whose record the registry lost (its cache box restarted empty) gets it back."""
    try:
        missing = registry.lookup(cachebox(), device.name) is None
    except CacheBoxError:
        return
    except registry.DeviceRefused:  # unreadable: written again below
        missing = True
    if missing:
        log.warning("device %s: its registry record was gone (cache box restarted?); published again", device.name)
        publish_device(device)


def device_json(device: Device) -> dict:
    return {
        "name": device.name,
        "online": device.online,
        "revoked": device.revoked_at is not None,
        "last_seen": device.last_seen.isoformat() if device.last_seen else None,
        "link": device.link_label,
        "memory": memory_label(device.status, device.memory_mb),
    }

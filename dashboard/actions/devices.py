"""Verbs on devices and namespaces (tenants): registration, tokens, signing keys, board reports."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cachebox.errors import CacheBoxError
from cachebox.events import security_event
from cachebox.signing import pin_proof
from inference import devices as registry
from inference.envelope import EnvelopeRefused, Kind, peek
from inference.identity import check_enrollment_signature, enrollment_public_key, enrollment_redis_password, password_sha256
from inference.messages import BoardMessage, EnrollRequest, Heartbeat

from ..live import broadcast
from ..models import Device, Namespace
from ..signing import control_plane_public_key, control_plane_signer, open_from, sealed_ring
from ..stats import memory_label
from .audit import AuditAction, audit
from .cache import cachebox

log = logging.getLogger("dashboard.actions")

ENROLL_WINDOW_S = 600  # an enrollment request older than this (or from a clock this far off) is refused


def token_usable(device: Device) -> bool:
    """Whether the device's token may still enroll a board: not spent, not expired."""
    return bool(device.enroll_key) and (device.token_expires is None or device.token_expires > timezone.now())


def _record_for(device: Device, enrollment: dict | None = None) -> registry.DeviceRecord:
    usable = token_usable(device)
    return registry.DeviceRecord(
        name=device.name,
        token_sha256=device.token_sha256 if usable else "",  # only while the token may still enroll
        pin=device.pin_proof if usable else "",
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
    """Tell boards (through the cache box) the device's current token hash and settings, signed
    by the control plane.

    False when the cache box cannot be reached: the database stays the truth and
    ``publish_all_devices`` (run at every start) publishes it later.
    """
    try:
        registry.publish(cachebox(), _record_for(device, enrollment), control_plane_signer())
        return True
    except CacheBoxError as exc:
        log.warning("device %s not published to the cache box: %s", device.name, exc)
        return False


def publish_all_devices() -> int:
    """Re-publish every device and its Redis users (after the cache box restarted empty)."""
    from .identities import apply_all_identities

    apply_all_identities()
    store = cachebox()
    signer = control_plane_signer()
    count = 0
    for device in Device.objects.select_related("namespace"):
        registry.publish(store, _record_for(device), signer)
        count += 1
    return count


def _changed(devices) -> None:
    """Publish changed devices to their boards (the registry in the cache box), make their Redis
    users match (``identities``) and, once the change commits, tell the open pages. Call it after
    the verb's transaction block: a device record must not reach boards before the database holds it."""
    from .identities import apply_identity

    for device in devices:
        apply_identity(device)
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
    """A new one-time enrollment token (it expires after ``EDGECACHE_TOKEN_TTL_HOURS``); the board
    enrolled before (if any) is refused from now on. Kept: the token's hash, the public key that
    checks an enrollment signed with it, and its proof of the control plane's key."""
    token = registry.new_token()
    device.token_sha256 = registry.hash_token(token)
    device.enroll_key = enrollment_public_key(token)
    device.pin_proof = pin_proof(token, control_plane_public_key())
    device.enroll_redis_sha256 = password_sha256(enrollment_redis_password(token))
    device.token_expires = timezone.now() + timedelta(hours=settings.EDGECACHE_TOKEN_TTL_HOURS)
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
    """A board sends its public keys and its Redis password's hash, signed with the key its token
    gives: the device is enrolled to those keys (the token is spent), its own Redis user is made,
    and its ring is sealed to them. Refusals are logged, and published on the record so that the
    board that asked can say why."""
    request = EnrollRequest.receive(payload, receiver="control")
    if request is None:
        return None
    with transaction.atomic():
        device = Device.objects.select_for_update().filter(name=request.device).select_related("namespace").first()
        reason = ""
        if device is None:
            reason = "unknown device"
        elif device.revoked_at is not None:
            reason = "revoked"
        elif not device.enroll_key:
            reason = "the token was already used to enroll a board: rotate the token to enroll another one"
        elif not token_usable(device):
            reason = "the token expired: rotate it on the device's page and start the board with the new one"
        elif abs(time.time() - request.ts) > ENROLL_WINDOW_S:
            reason = "the enrollment request is stale (check the board's clock)"
        elif not check_enrollment_signature(request.dump(), device.enroll_key):
            reason = "wrong token"
        if reason:
            security_event("enrollment_refused", device=request.device, reason=reason)
            if device is not None and device.signing_public_key != request.signing_public_key:
                publish_device(device, {"signing_key": request.signing_public_key, "reason": reason})
            return None
        device.signing_public_key = request.signing_public_key
        device.box_public_key = request.box_public_key
        device.redis_password_sha256 = request.redis_password_sha256
        device.enroll_key = device.pin_proof = device.enroll_redis_sha256 = ""  # spent: a token enrolls one board once
        device.enrolled_at = timezone.now()
        device.save(update_fields=["signing_public_key", "box_public_key", "redis_password_sha256", "enroll_key", "pin_proof", "enroll_redis_sha256", "enrolled_at"])
        audit(None, AuditAction.DEVICE_ENROLL, device.name, f"signing key {device.signing_public_key[:16]}…")
    _changed([device])
    return device


def authenticate_board(name: str) -> Device | None:
    """The enrolled, unrevoked device ``name``, or None (logged)."""
    device = Device.objects.filter(name=name).select_related("namespace").first() if isinstance(name, str) else None
    reason = ""
    if device is None:
        reason = "unknown device"
    elif device.revoked_at is not None:
        reason = "revoked"
    elif not device.signing_public_key:
        reason = "not enrolled"
    if reason:
        security_event("board_message_refused", device=str(name)[:64], reason=reason)
        return None
    return device


_KINDS = {"RunReport": Kind.REPORT, "EncodeReport": Kind.ENCODED, "EncodeProgress": Kind.PROGRESS, "Heartbeat": Kind.HEARTBEAT}


def receive_board_message(cls: type[BoardMessage], payload: dict) -> tuple[BoardMessage | None, Device | None, float]:
    """A board's message checked at the boundary: (message, its device, its send time), or Nones
    (logged) when it is not signed (and sealed) by its enrolled, unrevoked board, names another
    sender than its envelope, or does not follow the contract."""
    try:
        sender = peek(payload)["from"]
    except EnvelopeRefused as exc:
        security_event("board_message_refused", message=cls.__name__, reason=str(exc)[:300])
        return None, None, 0.0
    device = authenticate_board(sender)
    if device is None:
        return None, None, 0.0
    try:
        body, head = open_from(device, payload, _KINDS[cls.__name__])
    except (EnvelopeRefused, CacheBoxError, ValueError) as exc:  # UnknownKey too: nothing this control plane sealed
        security_event("board_message_refused", device=device.name, message=cls.__name__, reason=str(exc)[:300])
        return None, None, 0.0
    message = cls.receive(body, receiver="control")
    if message is None:
        return None, None, 0.0
    if message.device != device.name:
        security_event("board_message_refused", device=device.name, message=cls.__name__, reason=f"names device {message.device!r}, not its signer")
        return None, None, 0.0
    return message, device, float(head["ts"])


def record_heartbeat(payload: dict) -> Device | None:
    """A board lives: store its status (catalogs, model) and tell the open pages.

    A heartbeat older than the last one accepted is a replay (or out of order): refused."""
    beat, device, sent = receive_board_message(Heartbeat, payload)
    if device is None:
        return None
    with transaction.atomic():
        fresh = Device.objects.filter(pk=device.pk, last_message_ts__lt=sent).update(last_message_ts=sent)
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

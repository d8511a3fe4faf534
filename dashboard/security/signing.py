"""Keys on the control plane: namespace rings derived from the master secret, sealed per device;
the control plane's own signing key; sealing what goes to boards and opening what comes back."""

from __future__ import annotations

import functools
import json
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.db import DatabaseError

from cachebox import signing
from cachebox.signing import Keychain, KeyRing, Producer, ProducerTable
from inference.contract import envelope
from inference.contract.envelope import CONTROL, Kind


def control_plane_signer() -> Ed25519PrivateKey:
    """The control plane's Ed25519 key (derived from the master secret: every process has the same)."""
    return _signer(settings.EDGECACHE_SIGNING_SECRET)


@functools.lru_cache(maxsize=4)
def _signer(master: bytes) -> Ed25519PrivateKey:
    return signing.control_plane_key(master)


def control_plane_public_key() -> str:
    return signing.public_hex(control_plane_signer())


@functools.lru_cache(maxsize=1024)
def _ring(master: bytes, namespace: str, generation: int, extra: tuple[str, ...]) -> KeyRing:
    return signing.derive_keyring(master, namespace, generation, extra)


def keyring_for(namespace: str) -> KeyRing:
    """The ring of ``namespace`` at its current generation (1 for namespaces the database does not know).

    Used by commands running next to the control plane (``infer``, ``bench``), which hold
    the signing secret themselves; boards receive sealed rings instead (``sealed_ring``).
    """
    # lazy: models before apps are ready (dashboard.celery -> outbox -> this module)
    from dashboard.models import Namespace

    tenant = signing.tenant_of(namespace)
    private = tenant != namespace
    generation = 1
    try:
        row = Namespace.objects.filter(name=tenant).values_list("key_generation", flat=True).first()
        generation = row or 1
    except DatabaseError:  # not migrated yet: the first generation
        pass
    extra = (namespace,) if private else ()
    ring = _ring(settings.EDGECACHE_SIGNING_SECRET, tenant, generation, extra)
    return ring.with_producers(control_plane_producer(), producer_table(tenant))


def control_plane_producer() -> Producer:
    """Who commands next to the control plane sign their entries as (``CONTROL_PLANE_PRODUCER``)."""
    return Producer.control_plane(settings.EDGECACHE_SIGNING_SECRET)


def producer_table(tenant: str) -> ProducerTable:
    """``tenant``'s producers as the database knows them: every enrolled board's public key, except
    revoked and quarantined boards, whose entries readers refuse (listed with the reason)."""
    # lazy: models before apps are ready (dashboard.celery -> outbox -> this module)
    from dashboard.models import Device

    producers: dict[str, str] = {}
    quarantined: dict[str, str] = {}
    try:
        rows = list(
            Device.objects.filter(namespace_id=tenant).values_list(
                "name", "signing_public_key", "revoked_at", "quarantined_at", "quarantine_reason"
            )
        )
    except DatabaseError:  # not migrated yet: the control plane alone
        rows = []
    for name, key, revoked_at, quarantined_at, reason in rows:
        if revoked_at is not None:
            quarantined[name] = "revoked"
        elif quarantined_at is not None:
            quarantined[name] = reason or "quarantined"
        elif key:
            producers[name] = key
    return ProducerTable(tenant, producers, quarantined, control_plane_public_key(), time.time_ns())


def signed_producer_table(tenant: str) -> str:
    """``producer_table(tenant)`` signed by the control plane, as boards read it (``ec:producers:TENANT``)."""
    return json.dumps(producer_table(tenant).signed(control_plane_signer()), separators=(",", ":"))


def device_ring(device) -> KeyRing:
    """The ring a device's board holds: its namespace's keys (and its private namespace's)."""
    namespace = device.namespace
    extra = () if namespace.share_across_devices else (signing.private_namespace(namespace.name, device.name),)
    return _ring(settings.EDGECACHE_SIGNING_SECRET, namespace.name, namespace.key_generation, extra)


def sealed_ring(device) -> str:
    """The device's ring, signed by the control plane and sealed to its board's X25519 key (""
    for a revoked or not yet enrolled device)."""
    if device.revoked_at is not None or not device.box_public_key:
        return ""
    return signing.seal(device_ring(device), bytes.fromhex(device.box_public_key), device.name, control_plane_signer())


def control_plane_keys() -> Keychain:
    """Signing keys for commands that run a board next to the control plane (``infer``, ``bench``)."""
    return Keychain(keyring_for)


# -- what goes to boards, what comes back -----------------------------------------------------------
def seal_for(device, kind: Kind, message: dict, *, ttl: float | None = None) -> dict:
    """A request for ``device``'s board: sealed under its namespace's key, signed by the control plane."""
    return envelope.seal(
        message,
        kind=kind,
        sender=CONTROL,
        to=device.name,
        signer=control_plane_signer(),
        ring=device_ring(device),
        ttl=ttl,
        message_id=str(message.get("request_id", "")),
    )


def cancel_flag(device_name: str, request_id: str) -> bytes:
    """The value of a run's cancel flag: the control plane's signed word, for this run on this board."""
    signed = envelope.seal(
        {"request_id": request_id}, kind=Kind.CANCEL, sender=CONTROL, to=device_name, signer=control_plane_signer()
    )
    return json.dumps(signed, separators=(",", ":")).encode()


def open_from(device, payload, kind: Kind) -> tuple[dict, dict]:
    """``(message, envelope)`` a device's board signed (and sealed) for the control plane;
    EnvelopeRefused otherwise."""
    return envelope.open_envelope(
        payload,
        kind=kind,
        to=CONTROL,
        signer_public_key=device.signing_public_key,
        ring_for=lambda _ns: device_ring(device),
    )


def stream_ring_for(device):
    """What opens the stream events of ``device``'s board (its namespace's ring)."""
    ring = device_ring(device)
    return lambda _namespace: ring

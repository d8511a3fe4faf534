"""Keys on the control plane: namespace rings derived from the master secret, sealed per device;
the control plane's own signing key; sealing what goes to boards and opening what comes back."""

from __future__ import annotations

import functools
import json

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.db import DatabaseError

from cachebox import signing
from cachebox.signing import Keychain, KeyRing
from inference import envelope
from inference.envelope import CONTROL, Kind


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
    from .models import Namespace

    tenant = signing.tenant_of(namespace)
    private = tenant != namespace
    generation = 1
    try:
        row = Namespace.objects.filter(name=tenant).values_list("key_generation", flat=True).first()
        generation = row or 1
    except DatabaseError:  # not migrated yet: the first generation
        pass
    extra = (namespace,) if private else ()
    return _ring(settings.EDGECACHE_SIGNING_SECRET, tenant, generation, extra)


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
        message, kind=kind, sender=CONTROL, to=device.name, signer=control_plane_signer(), ring=device_ring(device), ttl=ttl, message_id=str(message.get("request_id", ""))
    )


def cancel_flag(device_name: str, request_id: str) -> bytes:
    """The value of a run's cancel flag: the control plane's signed word, for this run on this board."""
    signed = envelope.seal({"request_id": request_id}, kind=Kind.CANCEL, sender=CONTROL, to=device_name, signer=control_plane_signer())
    return json.dumps(signed, separators=(",", ":")).encode()


def open_from(device, payload, kind: Kind) -> tuple[dict, dict]:
    """``(message, envelope)`` a device's board signed (and sealed) for the control plane;
    EnvelopeRefused otherwise."""
    return envelope.open_envelope(payload, kind=kind, to=CONTROL, signer_public_key=device.signing_public_key, ring_for=lambda _ns: device_ring(device))


def stream_ring_for(device):
    """What opens the stream events of ``device``'s board (its namespace's ring)."""
    ring = device_ring(device)
    return lambda _namespace: ring

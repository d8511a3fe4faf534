"""Signing keys on the control plane: rings derived per namespace, sealed per device."""

from __future__ import annotations

from django.conf import settings
from django.db import DatabaseError

from cachebox import signing
from cachebox.signing import Keychain, KeyRing


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
    return signing.derive_keyring(settings.EDGECACHE_SIGNING_SECRET, tenant, generation, extra)


def device_ring(device) -> KeyRing:
    """The ring a device's board holds: its namespace's keys (and its private namespace's)."""
    namespace = device.namespace
    extra = () if namespace.share_across_devices else (signing.private_namespace(namespace.name, device.name),)
    return signing.derive_keyring(settings.EDGECACHE_SIGNING_SECRET, namespace.name, namespace.key_generation, extra)


def sealed_ring(device) -> str:
    """The device's ring sealed to its board's X25519 key ("" for a revoked or not yet enrolled device)."""
    if device.revoked_at is not None or not device.box_public_key:
        return ""
    return signing.seal(device_ring(device), bytes.fromhex(device.box_public_key), device.name)


def control_plane_keys() -> Keychain:
    """Signing keys for commands that run a board next to the control plane (``infer``, ``bench``)."""
    return Keychain(keyring_for)

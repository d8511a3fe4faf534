"""API keys: created by staff, one namespace each, shown once, stored as SHA-256, revocable.

A key is ``ec-`` and 32 random bytes (base64url): too long to guess, so one SHA-256 (no salt,
no slow hash) is enough to store it and lets a request's key be found with one indexed lookup.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from ..actions.audit import AuditAction, audit
from ..models import ApiKey, Namespace


def new_key() -> str:
    return ApiKey.PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _audit(user, action: AuditAction, target: str, detail: str = "") -> None:
    audit(user, action, target, detail)


def create_key(user, namespace: Namespace | str, *, name: str = "", rate_per_minute: int | None = None) -> tuple[ApiKey, str]:
    """A new key of ``namespace``; returns (its row, the key). The key is not kept: show it once."""
    if isinstance(namespace, str):
        found = Namespace.objects.filter(name=namespace).first()
        if found is None:
            raise ValueError(f"no namespace {namespace!r}: create it in Admin > Namespaces first")
        namespace = found
    key = new_key()
    row = ApiKey(name=name[:100], namespace=namespace, rate_per_minute=rate_per_minute, created_by=user if user is not None and user.is_authenticated else None)
    fill_key(row, key)
    with transaction.atomic():
        row.save()
        _audit(user, AuditAction.APIKEY_CREATE, str(row), f"namespace={namespace.name}")
    return row, key


def fill_key(row: ApiKey, key: str) -> None:
    """Set what is kept of ``key`` on ``row``: its hash and its first characters."""
    row.key_sha256 = hash_key(key)
    row.key_prefix = key[: len(ApiKey.PREFIX) + 6]


def revoke_key(user, row: ApiKey) -> None:
    """Refuse the key from its next request on."""
    with transaction.atomic():
        ApiKey.objects.filter(pk=row.pk).update(revoked_at=timezone.now())
        _audit(user, AuditAction.APIKEY_REVOKE, str(row))
    row.refresh_from_db()


def bearer(header: str) -> str:
    """The key in an ``Authorization: Bearer KEY`` header ("" when there is none)."""
    scheme, _, value = (header or "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


LAST_USED_EVERY = timedelta(minutes=1)  # how stale a key's "last used" may be


def authenticate(header: str) -> ApiKey | None:
    """The active key named by the ``Authorization`` header, or None."""
    key = bearer(header)
    if not key.startswith(ApiKey.PREFIX) or len(key) > 200:
        return None
    row = ApiKey.objects.select_related("namespace").filter(key_sha256=hash_key(key), revoked_at__isnull=True).first()
    now = timezone.now()
    if row is not None and (row.last_used is None or now - row.last_used >= LAST_USED_EVERY):
        # To the minute: a write per request would queue every call behind the database's write lock.
        ApiKey.objects.filter(pk=row.pk).update(last_used=now)
    return row

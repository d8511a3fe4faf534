"""API keys of the OpenAI-compatible API: who may manage which, create (the key shown once), revoke.

A key is ``ec-`` and 32 random bytes (base64url): too long to guess, so one SHA-256 (no salt, no
slow hash) is enough to store it and lets a request's key be found with one indexed lookup
(``dashboard.api.keys.authenticate``).

Staff manage every namespace's keys. A member (not staff) of a namespace sees its keys, and
creates and revokes them where the namespace allows its members to
(``Namespace.members_manage_api_keys``, off by default, set in Admin > Namespaces). Each create and
revoke is audited, whoever does it (the API keys page, ``manage.py apikey``, the admin).
"""

from __future__ import annotations

import hashlib
import logging
import secrets

from django.core.cache import cache
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from dashboard.store.django_cache import CACHE_SERVER_ERRORS

from ..models import ApiKey, Namespace
from .audit import AuditAction, audit

log = logging.getLogger("dashboard.api")

EPOCH = "api-keys:epoch"  # Django cache key: moved by every change of any API key (``key_changed``)
# A web process remembers an active key at most this long, whatever the epoch says: a change whose
# epoch move was lost (the cache box did not answer then) is seen within this time.
REMEMBERED_FOR_S = 30.0


class KeyRefused(Exception):
    """This user may not manage this namespace's keys (or the key is not one they may see)."""


def new_key() -> str:
    return ApiKey.PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def fill_key(row: ApiKey, key: str) -> None:
    """Set what is kept of ``key`` on ``row``: its hash and its first characters."""
    row.key_sha256 = hash_key(key)
    row.key_prefix = key[: len(ApiKey.PREFIX) + 6]


# -- who may do what ------------------------------------------------------------------------------
def key_namespaces(user) -> QuerySet[Namespace]:
    """The namespaces whose keys ``user`` may see: every one for staff, their own for a member."""
    if user.is_staff:
        return Namespace.objects.all()
    return Namespace.objects.filter(memberships__user=user).distinct()


def managed_namespaces(user) -> QuerySet[Namespace]:
    """The namespaces whose keys ``user`` may create and revoke."""
    if user.is_staff:
        return Namespace.objects.all()
    return key_namespaces(user).filter(members_manage_api_keys=True)


def may_manage(user, namespace: Namespace | str) -> bool:
    name = namespace.name if isinstance(namespace, Namespace) else namespace
    return user is not None and user.is_authenticated and managed_namespaces(user).filter(name=name).exists()


def visible_keys(user) -> QuerySet[ApiKey]:
    """The keys ``user`` may see (their hash never leaves the database; the list shows prefixes)."""
    return ApiKey.objects.filter(namespace__in=key_namespaces(user)).select_related("namespace", "created_by")


def _checked(user, namespace: Namespace) -> None:
    """``user`` None: the control plane itself (``manage.py apikey``, benchmarks), which may."""
    if user is not None and not may_manage(user, namespace):
        raise KeyRefused(
            f"only staff make or revoke API keys of namespace {namespace.name!r}"
            + ("" if user.is_staff else " (staff can let its members: Admin > Namespaces > members manage API keys)")
        )


# -- the verbs ------------------------------------------------------------------------------------
def create_key(
    user, namespace: Namespace | str, *, name: str = "", rate_per_minute: int | None = None
) -> tuple[ApiKey, str]:
    """A new key of ``namespace``; returns (its row, the key). The key is not kept: show it once."""
    if isinstance(namespace, str):
        found = Namespace.objects.filter(name=namespace).first()
        if found is None:
            raise ValueError(f"no namespace {namespace!r}: create it in Admin > Namespaces first")
        namespace = found
    _checked(user, namespace)
    key = new_key()
    creator = user if user is not None and user.is_authenticated else None
    row = ApiKey(name=name[:100], namespace=namespace, rate_per_minute=rate_per_minute, created_by=creator)
    fill_key(row, key)
    with transaction.atomic():
        row.save()
        audit(user, AuditAction.APIKEY_CREATE, str(row), f"namespace={namespace.name}")
    return row, key


def key_changed() -> None:
    """An API key changed (revoked, edited, deleted): the key epoch moves, so the web processes
    that remember keys read them again (``dashboard.api.keys``); the receiver of ApiKey's save and
    delete signals too. Never raises: a cache box that does not answer is logged (a remembered key
    is read again after ``REMEMBERED_FOR_S`` all the same)."""
    try:
        cache.add(EPOCH, 0, timeout=None)
        cache.incr(EPOCH)
    except (*CACHE_SERVER_ERRORS, ValueError) as exc:
        log.warning(
            "the API keys' epoch was not moved (%s): web processes may take the changed key as it was for up to %g s",
            exc,
            REMEMBERED_FOR_S,
        )


def revoke_key(user, row: ApiKey) -> bool:
    """Refuse the key from its next request on; False when it was revoked already (nothing done)."""
    _checked(user, row.namespace)
    with transaction.atomic():
        changed = ApiKey.objects.filter(pk=row.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        if changed:
            audit(user, AuditAction.APIKEY_REVOKE, str(row), f"namespace={row.namespace_id}")
            transaction.on_commit(key_changed)  # web processes that remember it read it again
    row.refresh_from_db()
    return bool(changed)

"""API keys at the door of /v1/: the key in a request's ``Authorization`` header, checked.

Keys are made and revoked by the verbs of ``dashboard.actions.api_keys`` (the API keys page,
``manage.py apikey``, the admin); only a key's SHA-256 is kept, so one indexed lookup finds it.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from ..actions.api_keys import hash_key
from ..models import ApiKey


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

"""Sessions whose keys the database never holds: a copy of it replays no login.

Django's database sessions keep each session under its key, the very value of the browser's
``sessionid`` cookie: anyone with a copy of the table could open every live session. Here the table
holds a keyed digest of the session key instead (BLAKE2b under a key derived from ``SECRET_KEY``,
which lives in the secrets folder, apart from the database). The browser's cookie is unchanged, a
session is still found with one indexed lookup, and logging out still deletes it server-side.
"""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.contrib.sessions.backends.db import SessionStore as DatabaseSessionStore
from django.utils.crypto import salted_hmac


def stored_key(session_key: str) -> str:
    """What the table keeps for ``session_key``: 40 hex characters (the column's length)."""
    secret = salted_hmac("edgecache.sessions.stored-key", "", secret=settings.SECRET_KEY, algorithm="sha256").digest()
    return hashlib.blake2b(session_key.encode(), key=secret, digest_size=20).hexdigest()


class SessionStore(DatabaseSessionStore):
    """Django's database session store, keyed by ``stored_key`` of the cookie's value."""

    def _get_session_from_db(self):
        return self._stored(lambda: super(SessionStore, self)._get_session_from_db())

    async def _aget_session_from_db(self):
        original = self._session_key
        if original is None:
            return None
        self._session_key = stored_key(original)
        try:
            found = await super()._aget_session_from_db()
        finally:
            if self._session_key is not None:
                self._session_key = original
        return found

    def _stored(self, call):
        """Run ``call`` with the stored key in place of the cookie's, then put the cookie's back
        (unless the lookup dropped it: an unknown or expired session)."""
        original = self._session_key
        if original is None:
            return None
        self._session_key = stored_key(original)
        try:
            return call()
        finally:
            if self._session_key is not None:
                self._session_key = original

    def exists(self, session_key):
        return super().exists(stored_key(session_key))

    async def aexists(self, session_key):
        return await super().aexists(stored_key(session_key))

    def create_model_instance(self, data):
        instance = super().create_model_instance(data)
        instance.session_key = stored_key(instance.session_key)
        return instance

    async def acreate_model_instance(self, data):
        instance = await super().acreate_model_instance(data)
        instance.session_key = stored_key(instance.session_key)
        return instance

    def delete(self, session_key=None):
        if session_key is None:
            if self.session_key is None:
                return
            session_key = self.session_key
        super().delete(stored_key(session_key))

    async def adelete(self, session_key=None):
        if session_key is None:
            if self.session_key is None:
                return
            session_key = self.session_key
        await super().adelete(stored_key(session_key))

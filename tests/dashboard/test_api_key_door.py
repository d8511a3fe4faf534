"""The API's door on a shared cache (the cache box's Valkey): a web process remembers the keys it
found active, so a known key costs one round trip (its rate count, with the key epoch beside it)
and no database query; every change of a key moves the epoch, so a revoked key is refused at its
next request whichever process revoked it. Django's test database and the session's real Valkey."""

from __future__ import annotations

import uuid

import pytest
from django.core.cache import caches
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dashboard.actions import api_keys
from dashboard.actions.api_keys import create_key, revoke_key
from dashboard.api import keys
from dashboard.models import ApiKey

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.cachebox]


@pytest.fixture
def shared_cache(settings, valkey_url, monkeypatch):
    """Django's cache on the session's Valkey under a prefix of this test's own, and a process
    that remembers no key yet."""
    settings.CACHES = {
        "default": {
            "BACKEND": "dashboard.store.django_cache.CacheBoxRedisCache",
            "LOCATION": valkey_url,
            "KEY_PREFIX": f"edgecache-test-{uuid.uuid4().hex[:12]}",
        }
    }
    monkeypatch.setattr(keys, "_REMEMBERED", keys._Remembered())
    cache = caches["default"]
    yield cache
    cache.clear()  # only this prefix


def _queries(header: str) -> tuple[keys.Checked, int]:
    with CaptureQueriesContext(connection) as queries:
        checked = keys.check(header)
    return checked, len(queries)


def test_a_known_key_costs_no_query_and_is_counted_against_its_rate(shared_cache):
    row, key = create_key(None, "default", name="app", rate_per_minute=3)
    header = f"Bearer {key}"
    first, first_queries = _queries(header)
    assert first.key.pk == row.pk and first.verdict.allowed and first.verdict.count == 1
    assert first_queries >= 1  # read from the database once
    counts = []
    for _ in range(3):
        checked, queries = _queries(header)
        assert checked.key.pk == row.pk and queries == 0
        counts.append((checked.verdict.count, checked.verdict.allowed))
    assert counts == [(2, True), (3, True), (4, False)]  # the rate still counts every request


def test_a_key_revoked_anywhere_is_refused_at_its_next_request(shared_cache):
    row, key = create_key(None, "default", name="app")
    header = f"Bearer {key}"
    assert keys.check(header).key is not None and _queries(header)[1] == 0  # remembered
    revoke_key(None, row)  # on this process, or on any other: the epoch in the cache box moves
    assert keys.check(header) == keys.Checked(None, None)

    other, other_key = create_key(None, "default", name="other")
    assert keys.check(f"Bearer {other_key}").key is not None
    # Another web process revoked it: the database and the shared epoch changed, this process's memory did not.
    ApiKey.objects.filter(pk=other.pk).update(revoked_at=other.created)
    api_keys.key_changed()
    assert keys.check(f"Bearer {other_key}").key is None


def test_an_edited_rate_applies_at_the_next_request(shared_cache):
    row, key = create_key(None, "default", name="app", rate_per_minute=100)
    header = f"Bearer {key}"
    assert keys.check(header).verdict.allowed
    row.rate_per_minute = 1  # Admin > API keys: a save, heard by the signal once committed
    row.save()
    checked = keys.check(header)
    assert checked.key.rate_per_minute == 1 and checked.verdict.count == 2 and not checked.verdict.allowed


def test_a_change_whose_epoch_move_was_lost_is_seen_within_the_memorys_bound(shared_cache, monkeypatch):
    row, key = create_key(None, "default", name="app")
    header = f"Bearer {key}"
    assert keys.check(header).key is not None
    ApiKey.objects.filter(pk=row.pk).update(revoked_at=row.created)  # revoked while the cache box did not answer
    assert keys.check(header).key is not None  # remembered: the epoch did not move
    monkeypatch.setattr(keys, "REMEMBERED_FOR_S", 0.0)
    assert keys.check(header).key is None


def test_without_the_cache_box_every_request_reads_the_database(shared_cache, settings):
    _, key = create_key(None, "default", name="app")
    header = f"Bearer {key}"
    assert keys.check(header).key is not None
    settings.CACHES = {
        "default": {
            "BACKEND": "dashboard.store.django_cache.CacheBoxRedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",
            "KEY_PREFIX": "unreachable",
            "OPTIONS": {"socket_connect_timeout": 0.2},
        }
    }
    checked, queries = _queries(header)
    assert checked.key is not None and queries >= 1  # the epoch cannot be read: the database decides
    assert checked.verdict.count == 2  # both counted in this process (the rate limit's fallback)


def test_a_per_process_cache_remembers_nothing(settings):
    _, key = create_key(None, "default", name="app")
    header = f"Bearer {key}"
    assert keys.check(header).key is not None
    assert _queries(header)[1] >= 1  # another process's revocation would go unseen: never remembered

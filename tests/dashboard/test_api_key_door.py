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


def test_requests_that_come_together_with_a_key_not_remembered_read_it_once(shared_cache, monkeypatch):
    """A client's connections opening at once: each request read the key and wrote its "last used",
    and SQLite's lock held them up to 70 ms (bench api's first requests with 8 clients). One reads
    it; the others wait for that read and find the key remembered."""
    import threading
    import time

    from django.db import connections

    row, key = create_key(None, "default", name="app", rate_per_minute=100)
    header = f"Bearer {key}"
    read, reads = keys._read, []

    def slow_read(digest):
        reads.append(digest)
        time.sleep(0.05)  # the others arrive while it reads
        return read(digest)

    monkeypatch.setattr(keys, "_read", slow_read)
    together = threading.Barrier(6)
    verdicts = []

    def request():
        together.wait()
        try:
            verdicts.append(keys.check(header))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=request) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(reads) == 1  # one read of the key
    assert [checked.key.pk for checked in verdicts] == [row.pk] * 6
    assert max(checked.verdict.count for checked in verdicts) == 6  # each still counted against its rate


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


# -- a known key's round trip beside the request's own work -------------------------------------------
def test_a_known_keys_count_goes_out_at_once_and_its_verdict_is_read_after_the_callers_work(shared_cache, monkeypatch):
    """``check_unanswered``: a remembered key comes back at once, with no query, while its rate's
    count is already on the server; its verdict, read later, is the one ``check`` gives. A key
    refused in this minute is checked at once instead, so a refused client costs no routing."""
    from dashboard.security import ratelimit

    monkeypatch.setattr(ratelimit, "clock", lambda: 1_000_020.0)  # one window for the whole test
    row, key = create_key(None, "default", name="app", rate_per_minute=2)
    header = f"Bearer {key}"
    assert keys.check(header).verdict.count == 1  # read from the database, now remembered
    read_before_return: list[bool] = []
    counting = ratelimit.hit_unanswered

    def watched(*args, **kwargs):
        verdict = counting(*args, **kwargs)
        read = []

        def reading():
            read.append(True)
            return verdict()

        read_before_return.append(read)
        return reading

    monkeypatch.setattr(ratelimit, "hit_unanswered", watched)
    with CaptureQueriesContext(connection) as queries:
        remembered, verdict = keys.check_unanswered(header)
    assert remembered.pk == row.pk and len(queries) == 0 and read_before_return[-1] == []  # sent, not read
    counter = f"ratelimit:api:{row.pk}:{int(1_000_020.0 // ratelimit.WINDOW_SECONDS)}"
    assert shared_cache.get(counter) == 2  # on the server before its answer was read
    checked = verdict()
    assert checked.key.pk == row.pk and (checked.verdict.count, checked.verdict.allowed) == (2, True)

    assert not keys.check_unanswered(header)[1]().verdict.allowed  # the third in the minute: refused
    remembered, verdict = keys.check_unanswered(header)
    assert read_before_return[-1] == [True]  # refused lately: decided before it returned
    assert remembered is None and (verdict().verdict.count, verdict().verdict.allowed) == (4, False)


def test_a_remembered_key_revoked_meanwhile_is_refused_when_its_verdict_is_read(shared_cache):
    row, key = create_key(None, "default", name="app")
    header = f"Bearer {key}"
    assert keys.check(header).key is not None
    ApiKey.objects.filter(pk=row.pk).update(revoked_at=row.created)  # another process revoked it
    api_keys.key_changed()
    remembered, verdict = keys.check_unanswered(header)
    assert remembered is not None and remembered.pk == row.pk  # still remembered: the caller may only prepare
    assert verdict() == keys.Checked(None, None)


# -- the API's door, as a request meets it ------------------------------------------------------------
@pytest.fixture
def door(shared_cache, settings, valkey_url):
    """The API's views on the session's Valkey (the bounded queues and the runs' streams too)."""
    from cachebox.store import CacheBox

    settings.EDGECACHE_CACHEBOX_URL = valkey_url
    store = CacheBox(valkey_url)
    yield store
    names = list(store.redis.scan_iter(match="ec:q:*"))
    if names:
        store.redis.delete(*names)


def _chat(header: str, model: str = "no-such-model.gguf"):
    import json

    from asgiref.sync import async_to_sync
    from django.test import AsyncRequestFactory

    from dashboard.api import views

    request = AsyncRequestFactory().post(
        "/v1/chat/completions",
        data=json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}),
        content_type="application/json",
        headers={"Authorization": header},
    )
    response = async_to_sync(views.chat_completions)(request)
    return response.status_code, __import__("json").loads(response.content)["error"]["code"]


def test_a_revoked_key_hears_401_before_what_its_request_lacks_and_holds_no_place_in_the_queues(door):
    """A remembered key's verdict is read after its request was parsed, counted and routed: a key
    revoked meanwhile still hears 401 (not the 400 its unknown model earns, which would tell it the
    namespace's models), and the place its run was given in the bounded queues is taken back."""
    import time

    from cachebox.keys import queue_key_names

    row, key = create_key(None, "default", name="app")
    header = f"Bearer {key}"
    names = queue_key_names("default", str(row.pk))
    assert _chat(header) == (400, "model_not_found")  # a valid key: its request's own fault
    ApiKey.objects.filter(pk=row.pk).update(revoked_at=row.created)  # revoked by another web process
    api_keys.key_changed()
    assert keys._REMEMBERED.get(api_keys.hash_key(key)) is not None  # this process still remembers it
    # Other tests of this worker may have runs still counting in namespace "default": only the change counts.
    before = [door.under_way(name, time.time()) for name in names]
    assert _chat(header) == (401, "invalid_api_key")
    assert [door.under_way(name, time.time()) for name in names] == before and before[1] == 0


def test_a_key_refused_for_its_rate_is_not_routed_again_in_that_minute(door, monkeypatch):
    from dashboard.api import board_choice
    from dashboard.security import ratelimit

    monkeypatch.setattr(ratelimit, "clock", lambda: 2_000_020.0)
    routed = []
    choose = board_choice.choose_route
    monkeypatch.setattr(board_choice, "choose_route", lambda *args: routed.append(1) or choose(*args))
    _, key = create_key(None, "default", name="app", rate_per_minute=1)
    header = f"Bearer {key}"
    assert _chat(header) == (400, "model_not_found") and len(routed) == 1  # the first in the minute
    assert _chat(header) == (429, "rate_limit_exceeded") and len(routed) == 2  # counted beside its routing
    assert _chat(header) == (429, "rate_limit_exceeded") and len(routed) == 2  # refused before any routing

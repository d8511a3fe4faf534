"""The cache-box store and catalog sync against real servers (embedded Valkey and system Redis)."""

import os
import time

import pytest
import redis

from cachebox import embedded, sync
from cachebox.errors import CacheBoxRefused, CacheBoxUnavailable
from cachebox.keys import catalog_key_names, device_key_name, entry_key_name, module_key_name
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry, CatalogReplica, CatalogSyncThread

pytestmark = pytest.mark.cachebox


def test_entries_are_binary_safe_and_flushed_by_namespace(any_store_url, namespace):
    store = CacheBox(any_store_url)
    blob = bytes(range(256)) * 4096  # 1 MB with every byte value
    names = [entry_key_name(namespace, "00ff00ff00ff00ff", os.urandom(16)) for _ in range(3)]
    assert store.put_entries([(name, blob) for name in names]) == 3 * len(blob)
    assert store.read_entries(names) == [blob] * 3
    assert store.read_prefixes(names[:1], 10) == [blob[:10]]
    assert store.read_prefixes([names[0] + "x"], 10) == [b""]
    assert sorted(store.scan_entries(namespace)) == sorted(names)
    assert store.flush(namespace) == 3
    assert store.read_entries(names) == [None] * 3


def test_an_unreachable_cache_box_fails_fast_and_then_skips_the_network():
    store = CacheBox("redis://127.0.0.1:9/0", connect_timeout=0.3, timeout=0.5, retry_after=30)
    started = time.monotonic()
    with pytest.raises(CacheBoxUnavailable, match="unreachable"):
        store.read_entries(["ec:e:x:y:{00}"])
    first = time.monotonic() - started
    started = time.monotonic()
    with pytest.raises(CacheBoxUnavailable, match="moments ago"):
        store.read_entries(["ec:e:x:y:{00}"])
    assert first < 1.0 and time.monotonic() - started < 0.05
    assert store.ping() is False


def test_catalog_sync_carries_keys_between_boards(any_store_url, namespace):
    board_a = CatalogReplica(CacheBox(any_store_url), namespace)
    board_b = CatalogReplica(CacheBox(any_store_url), namespace)
    board_a.sync()
    board_b.sync()
    keys = [os.urandom(16) for _ in range(5)]
    board_a.announce(keys)
    assert all(key in board_a.catalog for key in keys)
    assert not any(key in board_b.catalog for key in keys)
    assert board_b.sync() == 5
    assert all(key in board_b.catalog for key in keys)
    assert board_b.sync() == 0  # only new records are read


def test_background_thread_pulls_without_being_asked(valkey_url, namespace):
    registry = CatalogRegistry(CacheBox(valkey_url), 10_000, 0.01)
    replica = registry.get(namespace)
    thread = CatalogSyncThread(registry, interval=0.05)
    thread.start()
    try:
        key = os.urandom(16)
        CatalogReplica(CacheBox(valkey_url), namespace).announce([key])
        deadline = time.monotonic() + 5
        while key not in replica.catalog and time.monotonic() < deadline:
            time.sleep(0.02)
        assert key in replica.catalog
        assert replica.last_sync is not None
    finally:
        thread.stop()


def test_a_flushed_cache_box_makes_boards_drop_their_filters(valkey_url, namespace):
    store = CacheBox(valkey_url)
    replica = CatalogReplica(store, namespace)
    replica.sync()
    key = os.urandom(16)
    replica.announce([key])
    store.flush(namespace)  # also drops the catalog: a new epoch
    replica.sync()
    assert key not in replica.catalog


def test_a_new_board_loads_the_compacted_snapshot(valkey_url, namespace, monkeypatch):
    monkeypatch.setattr(sync, "COMPACT_AFTER_RECORDS", 10)
    store = CacheBox(valkey_url)
    writer = CatalogReplica(store, namespace)
    writer.sync()
    keys = [os.urandom(16) for _ in range(25)]
    writer.announce(keys)
    writer.sync()  # folds the log into the snapshot and trims it
    assert store.catalog_log_length(namespace) < 25
    assert store.catalog_snapshot(namespace)[0] is not None
    newcomer = CatalogReplica(store, namespace)
    newcomer.sync()
    assert all(key in newcomer.catalog for key in keys)


def test_a_lagging_board_recovers_keys_that_were_trimmed_from_the_log(valkey_url, namespace, monkeypatch):
    monkeypatch.setattr(sync, "COMPACT_AFTER_RECORDS", 10)
    store = CacheBox(valkey_url)
    lagging = CatalogReplica(store, namespace)
    writer = CatalogReplica(store, namespace)
    lagging.sync()
    writer.sync()
    first = [os.urandom(16)]
    writer.announce(first)
    lagging.sync()
    later = [os.urandom(16) for _ in range(30)]
    writer.announce(later)
    writer.sync()  # compacts and trims what `lagging` never read
    lagging.sync()
    assert all(key in lagging.catalog for key in first + later)


def test_catalog_keys_live_under_one_namespace_tag(valkey_url, namespace):
    replica = CatalogReplica(CacheBox(valkey_url), namespace)
    replica.sync()
    replica.announce([os.urandom(16)])
    names = catalog_key_names(namespace)
    client = CacheBox(valkey_url).redis
    assert client.exists(names["epoch"]) and client.exists(names["log"])


def test_embedded_server_is_shared_and_stoppable(tmp_path):
    url = embedded.ensure_running(tmp_path, maxmemory="64mb")
    try:
        assert embedded.ensure_running(tmp_path) == url  # the second caller reuses it
        store = CacheBox(url)
        store.redis.set("probe", b"1")
        assert CacheBox(url).redis.get("probe") == b"1"
        assert store.redis.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    finally:
        assert embedded.stop(tmp_path) is True
    assert embedded.is_running(tmp_path) is False
    assert embedded.stop(tmp_path) is False


def test_entries_expire_unless_pinned_and_use_restarts_their_ttl(any_store_url, namespace):
    store = CacheBox(any_store_url)
    pinned, plain = (entry_key_name(namespace, "00ff00ff00ff00ff", os.urandom(16)) for _ in range(2))
    store.put_entries([(pinned, b"a"), (plain, b"b")], ttl=100)
    assert 0 < store.redis.ttl(plain) <= 100
    assert store.pin([pinned]) == 1 and store.redis.ttl(pinned) == -1
    store.touch([pinned, plain], 5000)
    assert store.redis.ttl(pinned) == -1  # touching never unpins
    assert 100 < store.redis.ttl(plain) <= 5000
    assert store.unpin([pinned], 300) == 1 and 0 < store.redis.ttl(pinned) <= 300


def test_a_server_error_is_typed_and_does_not_cut_the_box_off(valkey_url, namespace):
    store = CacheBox(valkey_url, retry_after=30)
    wrong, good = (entry_key_name(namespace, "00ff00ff00ff00ff", os.urandom(16)) for _ in range(2))
    redis.Redis.from_url(valkey_url).rpush(wrong, b"a list, not an entry")
    store.put_entries([(good, b"entry")])
    with pytest.raises(CacheBoxRefused, match="WRONGTYPE") as caught:
        store.read_entries([wrong])  # GET on a list
    assert isinstance(caught.value, CacheBoxUnavailable)  # what every caller already catches
    started = time.monotonic()
    assert store.read_entries([good]) == [b"entry"]  # no back-off: the server is up
    assert time.monotonic() - started < 1.0
    store.delete([wrong])


def test_a_full_cache_box_refuses_with_a_named_error(tmp_path):
    url = embedded.ensure_running(tmp_path, maxmemory="1mb")  # a few entries fill it
    try:
        store = CacheBox(url, retry_after=30)
        names = [f"ec:e:full:00ff00ff00ff00ff:{{{index:02x}}}" for index in range(20)]
        with pytest.raises(CacheBoxRefused, match="maxmemory"):
            store.put_entries([(name, b"x" * 200_000) for name in names])  # no TTL: nothing to evict
        assert store.exists(names[-1:]) == [False]  # refused, and at once: no back-off
    finally:
        embedded.stop(tmp_path)


def test_exists_ttls_and_schema_scan_answer_through_the_store(valkey_url, namespace):
    store = CacheBox(valkey_url)
    digest = "abc123"
    pinned, plain = (module_key_name(namespace, "00ff00ff00ff00ff", digest, os.urandom(16)) for _ in range(2))
    missing = entry_key_name(namespace, "00ff00ff00ff00ff", os.urandom(16))
    store.put_entries([(pinned, b"a")])
    assert store.pin([pinned]) == 1  # pinned by the control plane: every write carries a TTL
    store.put_entries([(plain, b"b")], ttl=100)
    assert store.exists([pinned, missing, plain]) == [True, False, True]
    assert store.exists([]) == [] and store.ttls([]) == []
    ttl_pinned, ttl_plain, ttl_missing = store.ttls([pinned, plain, missing])
    assert ttl_pinned == -1 and 0 < ttl_plain <= 100 and ttl_missing == -2
    assert sorted(store.scan_schema_entries(digest)) == sorted([pinned, plain])
    assert store.memory_used()[0].isdigit()


def test_device_records_live_under_checked_names(valkey_url):
    store = CacheBox(valkey_url)
    name = f"board-{os.urandom(4).hex()}"
    assert store.get_device_record(name) is None
    store.put_device_record(name, '{"name": "x"}')
    assert store.get_device_record(name) == b'{"name": "x"}'
    assert device_key_name(name) == f"ec:device:{name}"
    for bad in ("", "a:b", "*", "x" * 65, "a b", "{a}"):
        with pytest.raises(ValueError, match="invalid device name"):
            store.get_device_record(bad)
    store.delete([device_key_name(name)])


def test_admission_bounds_runs_under_way_per_namespace_and_per_key_across_clients(valkey_url, namespace):
    from cachebox.keys import queue_key_names

    web1, web2 = CacheBox(valkey_url), CacheBox(valkey_url)  # two web processes, one count
    key_a, key_b = queue_key_names(namespace, "1"), queue_key_names(namespace, "2")
    assert key_a[0] == key_b[0] and key_a[1] != key_b[1]
    now = 1000.0
    assert [web1.admit(key_a, [3, 2], f"a{i}", now=now, until=now + 30)[0] for i in range(3)] == [
        0,
        0,
        2,
    ]  # key a's own bound
    assert web1.admit(key_a, [3, 2], "a0", now=now, until=now + 30)[0] == 0  # the same run again counts once
    assert web2.admit(key_b, [3, 2], "b0", now=now, until=now + 40) == (0, 0, 0)
    full, holds, oldest = web2.admit(key_b, [3, 2], "b1", now=now, until=now + 40)
    assert (full, holds, oldest) == (1, 3, now + 30)  # the namespace is full: a0 stops counting first
    assert web1.under_way(key_a[0], now) == 3
    web2.release(key_a, "a0")  # its answer came
    assert web2.admit(key_b, [3, 2], "b1", now=now, until=now + 40)[0] == 0
    # A run whose release was lost stops counting at its deadline; no limit (0) never refuses.
    assert web1.admit(key_a, [3, 2], "a3", now=now + 31, until=now + 61)[0] == 0
    assert web1.under_way(key_a[0], now + 31) == 3
    assert all(web1.admit(key_a, [0, 0], f"x{i}", now=now + 31, until=now + 61)[0] == 0 for i in range(10))
    web1.redis.delete(*key_a, key_b[1])


def test_several_small_keys_are_read_in_one_call_and_unset_ones_are_none(valkey_url, namespace):
    store = CacheBox(valkey_url)
    store.set_flag(f"test:{namespace}:a", 60, b"A")
    store.put_device_record(f"reader-{namespace}", b'{"name": "x"}')
    assert store.read_flags(
        [f"test:{namespace}:a", device_key_name(f"reader-{namespace}"), f"test:{namespace}:unset"]
    ) == [b"A", b'{"name": "x"}', None]


def test_a_key_whose_cluster_node_did_not_answer_is_not_read_as_unset(valkey_url, monkeypatch):
    """On a cluster, ``_batch`` gives None for the keys of a node that did not answer: read_flags
    must not hand that on as "unset" (a board would take its registry record for gone and refuse
    its work), but say the cache box did not answer, so the caller reads each key again."""
    store = CacheBox(valkey_url)
    monkeypatch.setattr(store, "_batch", lambda items, name_of, queue: [[b"record"], None])
    with pytest.raises(CacheBoxUnavailable, match="did not answer"):
        store.read_flags(["ec:device:a", "ec:cancel:a:1"])


def test_an_admission_sent_unanswered_counts_at_once_and_is_decided_as_admit_decides(valkey_url, namespace):
    """``admit_unanswered``: the run counts on the server as soon as it returns, its verdict is read
    later (the API routes meanwhile), the same as ``admit``'s; every connection goes back to the
    pool, and one whose answer was an error is dropped, not reused with an answer unread."""
    from cachebox.keys import queue_key_names

    store = CacheBox(valkey_url)
    names = queue_key_names(namespace, "7")
    now = 1000.0
    verdict = store.admit_unanswered(names, [2, 5], "r0", now=now, until=now + 30)
    assert CacheBox(valkey_url).under_way(names[0], now) == 1  # counted before its answer was read
    assert verdict() == (0, 0, 0)
    assert store.admit_unanswered(names, [2, 5], "r1", now=now, until=now + 30)() == (0, 0, 0)
    assert (
        store.admit_unanswered(names, [2, 5], "r2", now=now, until=now + 40)()
        == store.admit(names, [2, 5], "r2", now=now, until=now + 40)
        == (1, 2, now + 30)
    )  # the namespace is full, the same whichever way it is asked
    pool = store.redis.connection_pool
    assert not pool._in_use_connections
    store.redis.set(f"test:{namespace}:plain", b"x")  # not a sorted set: the server answers an error
    wrong = store.admit_unanswered([f"test:{namespace}:plain"], [2], "r3", now=now, until=now + 30)
    with pytest.raises(CacheBoxRefused, match="WRONGTYPE"):
        wrong()
    assert not pool._in_use_connections and store.under_way(names[0], now) == 2  # the next call works
    store.redis.delete(*names, f"test:{namespace}:plain")

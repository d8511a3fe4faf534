"""The cache box on a real Valkey Cluster (three masters on loopback, embedded.ensure_cluster)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest
import redis

from cachebox import embedded, sync
from cachebox.cluster import ClusterAddress, parse_cluster_url
from cachebox.errors import CacheBoxUnavailable
from cachebox.keys import (
    cancel_key_name,
    catalog_key_names,
    entry_key_name,
    prefix_keys,
    range_boundaries,
    stream_channel,
)
from cachebox.link import LinkProfile
from cachebox.store import CacheBox
from cachebox.sync import CatalogReplica
from dashboard.live import streams

pytestmark = pytest.mark.cachebox

FINGERPRINT = "00ff00ff00ff00ff"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A cluster the tests of this module share (none of them stops a node of it)."""
    started = embedded.ensure_cluster(tmp_path_factory.mktemp("cluster"))
    yield started
    started.stop()


@pytest.fixture
def own_cluster(tmp_path):
    """A cluster of the test's own: the test stops one of its nodes."""
    started = embedded.ensure_cluster(tmp_path / "cluster")
    yield started
    for index in range(len(started.ports)):
        pid_file = started.node_dir(index) / "valkey.pid"
        if pid_file.exists():  # a node left paused must not outlive the test
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGCONT)
            except ProcessLookupError:
                pass
    started.stop()


def node_clients(cluster) -> list[redis.Redis]:
    return [redis.Redis.from_url(cluster.node_url(index), socket_timeout=5) for index in range(len(cluster.ports))]


def node_index_of(cluster, name: str, asking: int = 0) -> int:
    """Which node serves ``name``, as the servers themselves say (CLUSTER KEYSLOT, CLUSTER SLOTS)."""
    client = redis.Redis.from_url(cluster.node_url(asking), socket_timeout=5)
    slot = client.execute_command("CLUSTER", "KEYSLOT", name)
    for first, last, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
        if first <= slot <= last:
            return cluster.ports.index(int(primary[1]))
    raise AssertionError(f"no node serves slot {slot}")


def entries_per_node(cluster, namespace: str) -> list[int]:
    return [
        sum(1 for _ in client.scan_iter(match=f"ec:[em]:{namespace}:*", count=1000)) for client in node_clients(cluster)
    ]


def test_cluster_urls_name_nodes_credentials_and_tls():
    address = parse_cluster_url("rediss+cluster://app:s%3Acret@10.0.0.1:7000,[::1]:7001,cache-2")
    assert address == ClusterAddress((("10.0.0.1", 7000), ("::1", 7001), ("cache-2", 6379)), "app", "s:cret", True)
    assert address.safe_url == "rediss+cluster://10.0.0.1:7000,[::1]:7001,cache-2:6379"  # no password
    assert parse_cluster_url("valkey+cluster://:pw@h:1/0").password == "pw"
    for wrong in ("redis://h:1/0", "redis+cluster://", "redis+cluster://h:1/3", "redis+cluster://h:x"):
        with pytest.raises(ValueError):
            parse_cluster_url(wrong)


def test_a_cluster_no_node_answers_fails_fast_and_then_skips_the_network():
    store = CacheBox(
        "redis+cluster://127.0.0.1:9,127.0.0.1:10", connect_timeout=0.3, timeout=0.5, retry_after=30
    )  # no I/O yet
    started = time.monotonic()
    with pytest.raises(CacheBoxUnavailable, match="unreachable"):
        store.read_entries(["ec:e:x:y:{00}"])
    assert time.monotonic() - started < 2.0
    started = time.monotonic()
    with pytest.raises(CacheBoxUnavailable, match="moments ago"):
        store.read_entries(["ec:e:x:y:{00}"])
    assert time.monotonic() - started < 0.05
    assert store.ping() is False and store.safe_url == "redis+cluster://127.0.0.1:9,127.0.0.1:10"


def test_entries_spread_over_every_node_and_multi_key_commands_span_slots(cluster):
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    store = CacheBox(cluster.url)
    names = [entry_key_name(namespace, FINGERPRINT, os.urandom(16)) for _ in range(60)]
    blobs = [os.urandom(1000 + index) for index in range(60)]
    assert store.put_entries(list(zip(names, blobs)), ttl=600) == sum(map(len, blobs))
    # Every node holds some: the hash tag of each entry is its own key digest.
    per_node = entries_per_node(cluster, namespace)
    assert sum(per_node) == 60 and min(per_node) > 0
    for name in names[:10]:  # and each one where the cluster says its slot lives
        assert redis.Redis.from_url(cluster.node_url(node_index_of(cluster, name))).exists(name)
    # Multi-key reads and writes over keys of 60 slots: no CROSSSLOT, answers in the order asked.
    missing = entry_key_name(namespace, FINGERPRINT, os.urandom(16))
    assert store.read_entries(names + [missing]) == blobs + [None]
    assert store.read_heads(names[:3] + [missing], 10) == [(blob[:10], len(blob)) for blob in blobs[:3]] + [(b"", 0)]
    assert store.read_prefixes(names[:2], 4) == [blob[:4] for blob in blobs[:2]]
    assert store.sizes(names[:2] + [missing]) == [len(blobs[0]), len(blobs[1]), 0]
    assert store.exists(names[:2] + [missing]) == [True, True, False]
    assert store.pin(names[:5]) == 5 and store.ttls(names[:6])[:5] == [-1] * 5
    assert store.unpin(names[:5], 300) == 5 and all(0 < ttl <= 300 for ttl in store.ttls(names[:5]))
    store.touch(names, 900)
    assert min(store.ttls(names[5:])) > 600
    assert store.delete(names[:30] + [missing]) == 30
    assert sorted(store.scan_entries(namespace)) == sorted(names[30:])  # SCAN walks every node
    assert store.flush(namespace) == 30
    assert entries_per_node(cluster, namespace) == [0, 0, 0]


def test_an_emulated_link_paces_the_connections_to_every_node(cluster):
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    per_node: dict[int, list[str]] = {0: [], 1: [], 2: []}
    while min(map(len, per_node.values())) < 4:  # four entries on each node, whatever the hash spreads
        name = entry_key_name(namespace, FINGERPRINT, os.urandom(16))
        if len(per_node[node := node_index_of(cluster, name)]) < 4:
            per_node[node].append(name)
    names = [name for node_names in per_node.values() for name in node_names]
    CacheBox(cluster.url).put_entries([(name, os.urandom(250_000)) for name in names])
    shaped = CacheBox(cluster.url, link=LinkProfile(bandwidth_mbps=80, rtt_ms=5))
    assert shaped.ping()  # connections and the slot map first
    started = time.monotonic()
    assert sum(map(len, shaped.read_entries(names))) == 3_000_000
    assert time.monotonic() - started >= 3_000_000 * 8 / 80e6  # 0.3 s: every byte crossed the 80 Mbit/s link
    CacheBox(cluster.url).flush(namespace)


def test_the_catalog_lives_on_one_node_and_compacts_there(cluster, monkeypatch):
    monkeypatch.setattr(sync, "COMPACT_AFTER_RECORDS", 10)
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    store = CacheBox(cluster.url)
    assert len({node_index_of(cluster, name) for name in catalog_key_names(namespace).values()}) == 1
    writer, newcomer = CatalogReplica(store, namespace), CatalogReplica(CacheBox(cluster.url), namespace)
    writer.sync()
    keys = [os.urandom(16) for _ in range(25)]
    writer.announce(keys)
    writer.sync()  # folds the log into the snapshot (WATCH + MULTI on the catalog's node) and trims it
    assert store.catalog_log_length(namespace) < 25 and store.catalog_snapshot(namespace)[0] is not None
    newcomer.sync()
    assert all(key in newcomer.catalog for key in keys)
    store.flush(namespace)


def test_a_publish_reaches_subscribers_on_every_node(cluster):
    """A board streams a run's tokens through the store; the control plane may listen on any node."""
    channel = f"ec:stream:{uuid.uuid4()}"

    def next_message(pubsub, kind):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.2)
            if message is not None and message["type"] == kind:
                return message
        raise AssertionError(f"no {kind} message within 5 s")

    clients, subscribers = node_clients(cluster), []  # clients kept: one that is collected closes its pool
    for client in clients:
        pubsub = client.pubsub()
        pubsub.subscribe(channel)
        next_message(pubsub, "subscribe")  # subscribed before anything is published
        subscribers.append(pubsub)
    CacheBox(cluster.url).publish(channel, b"token")  # counts the receiving node's subscribers only
    for pubsub in subscribers:
        assert next_message(pubsub, "message")["data"] == b"token"
        pubsub.close()


def test_the_control_plane_follows_runs_and_cancels_them_through_a_cluster_with_a_node_down(own_cluster):
    """What the API does around a streamed run: subscribe, read the board's tokens, set the cancel flag."""
    store = CacheBox(own_cluster.url, connect_timeout=0.3, timeout=2.0)
    request_ids = [str(uuid.uuid4()) for _ in range(12)]
    assert own_cluster.stop_node(0)  # the first node of the URL: the subscription moves on to the next

    async def follow_and_cancel():
        async with streams.subscribe(
            own_cluster.url, stream_channel("zero", request_ids[0]), connect_timeout=0.3, timeout=2.0
        ) as stream:
            await asyncio.to_thread(store.publish, stream_channel("zero", request_ids[0]), b"token")
            received = await stream.get(5.0)
        cancelled = []
        for request_id in request_ids:
            try:
                await streams.set_flag(
                    own_cluster.url,
                    cancel_key_name("zero", request_id),
                    60,
                    b"signed",
                    connect_timeout=0.3,
                    timeout=2.0,
                )
                cancelled.append(request_id)
            except CacheBoxUnavailable:
                pass
        return received, cancelled

    received, cancelled = asyncio.run(follow_and_cancel())
    assert received == b"token"
    # Every flag whose slot lives on a running node was set, where the board looks for it.
    on_running = [
        request_id
        for request_id in request_ids
        if node_index_of(own_cluster, cancel_key_name("zero", request_id), asking=1) != 0
    ]
    assert cancelled == on_running and len(on_running) > 0
    assert all(store.read_flag(cancel_key_name("zero", request_id)) == b"signed" for request_id in cancelled)


def test_a_node_that_stops_answering_costs_one_timeout_then_only_its_keys_are_skipped(own_cluster):
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    store = CacheBox(own_cluster.url, connect_timeout=0.3, timeout=0.5, retry_after=1.0)
    names = [entry_key_name(namespace, FINGERPRINT, os.urandom(16)) for _ in range(30)]
    store.put_entries([(name, name.encode()) for name in names])
    paused = node_index_of(own_cluster, names[0])
    on_paused = [node_index_of(own_cluster, name) == paused for name in names]
    pid = int((own_cluster.node_dir(paused) / "valkey.pid").read_text().strip())
    os.kill(pid, signal.SIGSTOP)  # accepts connections, never answers: only the read timeout ends a call
    try:
        started = time.monotonic()
        first = store.read_entries(names)
        took = time.monotonic() - started
        assert took < 0.5 + 0.5  # one read timeout, not redis-py's retries
        assert first == [None if lost else name.encode() for name, lost in zip(names, on_paused)]
        started = time.monotonic()
        assert store.read_entries(names) == first and time.monotonic() - started < 0.1  # skipped: no timeout again
        with pytest.raises(CacheBoxUnavailable):  # only keys of the silent node: nothing to answer with
            store.read_entries([name for name, lost in zip(names, on_paused) if lost])
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(1.0)  # retry_after: the node is tried again
    assert store.read_entries(names) == [name.encode() for name in names]


@pytest.mark.model
def test_a_cluster_cache_box_serves_hits_and_a_stopped_node_turns_only_its_entries_into_misses(
    own_cluster, namespace, make_board
):
    grid = 32
    board = make_board(own_cluster.url, namespace, chunk_tokens=grid)
    catalog_node = node_index_of(own_cluster, catalog_key_names(namespace)["log"])
    victim = next(index for index in range(3) if index != catalog_node)
    live = [index for index in range(3) if index != victim]

    def names_of(text: str) -> list[str]:
        tokens, _ = board.prefix.tokenize([text])
        boundaries = range_boundaries(len(tokens), grid)
        return [
            entry_key_name(namespace, board.engine.fingerprint, key)
            for key in prefix_keys(namespace, board.engine.fingerprint, tokens, boundaries, grid=grid)
        ]

    def first_prompt(make, wanted):
        for number in range(2000):
            text = make(number)
            if [node_index_of(own_cluster, name) for name in names_of(text)] == wanted:
                return text
        raise AssertionError(f"no prompt with entries on nodes {wanted}")

    # One range on a node that stays; one range on the node that will stop; two ranges, the
    # first on the other node that stays and the whole prompt on the one that will stop.
    def short(number):
        return f"Question {number}: which planet has the brightest rings?"

    def long(number):
        return f"Question {number}. " + "Edge boards share prompt states through a cache box that spans servers. " * 3

    on_live = first_prompt(short, [live[0]])
    on_victim = first_prompt(short, [victim])
    split = first_prompt(long, [live[1], victim])

    cold = {text: board.run([text], max_tokens=4) for text in (on_live, on_victim, split)}
    assert all(result.breakdown.case == "miss" and result.breakdown.cachebox == "ok" for result in cold.values())
    assert all(count > 0 for count in entries_per_node(own_cluster, namespace))  # spread over all three
    for text in cold:  # a repeated prompt: a full hit served from the cluster
        hit = board.run([text], max_tokens=4)
        assert hit.breakdown.case == "full" and hit.breakdown.tier == "cachebox" and hit.tokens == cold[text].tokens

    assert own_cluster.stop_node(victim)
    results = {}
    for text in cold:
        results[text] = board.run([text], max_tokens=4)  # never raises
        assert results[text].breakdown.fetch_ms < 1000  # the stopped node cost no timeout worth a wait
        assert results[text].tokens == cold[text].tokens and results[text].text == cold[text].text

    assert results[on_live].breakdown.case == "full" and results[on_live].breakdown.cachebox == "ok"
    gone = results[on_victim].breakdown  # its only entry was on the stopped node: local prefill, said so
    assert gone.case == "miss" and gone.cachebox == "unavailable" and gone.decision == "cachebox-unavailable"
    half = results[split].breakdown  # the range on a node that stays is still served
    assert half.case == "partial" and half.matched_tokens == grid

    # The catalog (on a node that stays) still syncs, and a board that starts now learns every key.
    assert board.catalogs.sync_all()
    newcomer = make_board(own_cluster.url, namespace, device="board-b", chunk_tokens=grid)
    assert newcomer.catalogs.sync_all()
    later = newcomer.run([on_live], max_tokens=4)
    assert later.breakdown.case == "full" and later.tokens == cold[on_live].tokens


@pytest.mark.django_db
def test_the_control_plane_points_only_its_cache_box_at_a_cluster(cluster, valkey_url, settings):
    from dashboard import actions

    settings.REDIS_URL = valkey_url  # broker and channel layer: one plain server
    settings.EDGECACHE_CACHEBOX_URL = cluster.url
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    name = entry_key_name(namespace, FINGERPRINT, os.urandom(16))
    CacheBox(cluster.url).put_entries([(name, b"entry")])
    assert actions.cachebox_url() == cluster.url and actions.cachebox().safe_url.startswith("redis+cluster://")
    assert actions.flush_entries(None, namespace, None) == 1 and not CacheBox(cluster.url).exists([name])[0]
    settings.EDGECACHE_CACHEBOX_URL = ""  # unset: the cache box is on REDIS_URL's server, as before
    assert actions.cachebox_url() == valkey_url


def test_a_cluster_url_is_refused_for_the_broker():
    from tests.conftest import run_manage

    done = run_manage("check", env={"REDIS_URL": "redis+cluster://127.0.0.1:7000"}, timeout=60)
    assert done.returncode != 0 and b"EDGECACHE_CACHEBOX_URL" in done.stderr


def test_a_board_reads_its_record_from_a_cluster_cache_box_and_its_queue_from_redis_url(cluster, valkey_url, tmp_path):

    from tests.conftest import run_manage
    from tests.inference.test_edge import publish

    name = f"clustered-{uuid.uuid4().hex[:8]}"
    publish(cluster.url, name, "the-right-token")
    # The registry's own answer (no board users on these test servers: EDGECACHE_BOARD_ACL=0).
    env = {
        "REDIS_URL": valkey_url,
        "EDGECACHE_CACHEBOX_URL": cluster.url,
        "EDGECACHE_BOARD_KEYS_DIR": str(tmp_path),
        "EDGECACHE_BOARD_ACL": "0",
    }
    done = run_manage("edge", "--name", name, "--token", "a-wrong-token", env=env, timeout=60)
    assert (
        done.returncode != 0 and b"wrong or expired token" in done.stderr
    )  # its record was found on the cluster ("unknown device" on REDIS_URL's server)

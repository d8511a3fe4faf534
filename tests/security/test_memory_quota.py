"""Memory no tenant can take from another: the cache box's write functions (size cap, TTL, a budget
per namespace) and the server's bounds on clients' buffers, tried with real board users on a real
Valkey with ACLs (issue 39, item 3).

Two tenants: ``acme`` (board ``zero``, the victim) and ``globex`` (board ``mallory``, which writes
as much as it can with its own credentials).
"""

from __future__ import annotations

import socket
import time
import uuid

import pytest
import redis
from redis.exceptions import NoPermissionError

from cachebox import acl, embedded, quota
from cachebox.errors import CacheBoxOverQuota
from cachebox.keys import cancel_key_name, entry_key_name, heartbeat_key, inbox_key
from cachebox.store import CacheBox

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]

PASSWORD = "the-control-planes-own-password"
MB = 1024 * 1024
FINGERPRINT = "57fa53c378686353"


@pytest.fixture(scope="module")
def small_box(tmp_path_factory):
    """A guarded Valkey of 64 MB, as `make run` starts it (password, ACL file, memory bounds)."""
    data_dir = tmp_path_factory.mktemp("small-box")
    port = embedded._low_free_ports(1)[0]
    url = embedded.ensure_running(data_dir, port=port, maxmemory="64mb", password=PASSWORD, max_value=2 * MB)
    yield url, port
    embedded.stop(data_dir, port, password=PASSWORD)


@pytest.fixture
def tenants(settings, small_box, monkeypatch):
    """The control plane on the small box: quota 8 MB per namespace, entries of at most 2 MB, a TTL
    of at most an hour; two tenants, one enrolled board each."""
    from dashboard import actions
    from dashboard.models import Namespace
    from tests.dashboard.test_dashboard import enrolled

    url, port = small_box
    settings.REDIS_URL = url
    settings.EDGECACHE_CACHEBOX_URL = ""
    settings.EDGECACHE_BOARD_ACL = True
    settings.EDGECACHE_NAMESPACE_QUOTA = 8 * MB
    settings.EDGECACHE_MAX_ENTRY_TTL = 3600
    settings.EDGECACHE_BOARD = settings.EDGECACHE_BOARD.with_(max_entry_bytes=2 * MB)
    monkeypatch.setattr("dashboard.actions.identities.declare_queue", lambda device: None)  # no Celery broker here
    for name in ("acme", "globex"):
        Namespace.objects.get_or_create(name=name)
    keys = {}
    for name, namespace in (("zero", "acme"), ("mallory", "globex")):
        device, token = actions.register_device(None, name=name, cpu_threads=1, namespace_id=namespace)
        keys[name] = enrolled(device, token)
    admin = redis.Redis(port=port, username="default", password=PASSWORD, socket_timeout=5)
    yield {"url": url, "port": port, "keys": keys, "admin": admin}
    for user in admin.execute_command("ACL", "USERS"):
        if user.decode().startswith((acl.BOARD_USER_PREFIX, acl.ENROLL_USER_PREFIX)):
            admin.execute_command("ACL", "DELUSER", user)
    admin.flushall()


def board_store(tenants, name: str) -> CacheBox:
    """The board's own client, as its own Redis user (what `manage.py edge` holds)."""
    return CacheBox(acl.with_credentials(tenants["url"], acl.board_user(name), tenants["keys"][name].redis_password))


def board_client(tenants, name: str) -> redis.Redis:
    return redis.Redis(
        port=tenants["port"],
        username=acl.board_user(name),
        password=tenants["keys"][name].redis_password,
        socket_timeout=5,
    )


def entry(namespace: str, index: int, salt: str = "") -> str:
    return entry_key_name(namespace, FINGERPRINT, f"{salt}{index:06d}".encode().ljust(16, b"-")[:16])


def test_a_board_that_writes_until_its_quota_is_refused_and_takes_nothing_from_the_others(tenants):
    zero, mallory = board_store(tenants, "zero"), board_store(tenants, "mallory")
    admin = tenants["admin"]
    victims = {entry("acme", index): bytes([index]) * (512 * 1024) for index in range(10)}
    zero.put_entries(list(victims.items()), ttl=600)

    # globex's board writes 1 MB entries as fast as it can: its namespace's 8 MB fill, then every
    # further write is refused, with the reason and what to do.
    stored, refusals = 0, []
    for index in range(40):
        try:
            stored += mallory.put_entries([(entry("globex", index), b"m" * MB)], ttl=2) // MB
        except CacheBoxOverQuota as exc:
            refusals.append(exc)
    assert 5 <= stored < 8 and len(refusals) == 40 - stored
    assert {exc.code for exc in refusals} == {"EC_QUOTA"}
    assert "namespace globex holds" in str(refusals[0]) and "EDGECACHE_NAMESPACE_QUOTA" in str(refusals[0])
    assert sum(1 for name in admin.scan_iter(match="ec:e:globex:*")) == stored  # a refused write stores nothing

    # acme's entries are all there, whole; the server is below its maxmemory and evicted nothing.
    assert admin.mget(list(victims)) == list(victims.values())
    memory, stats = admin.info("memory"), admin.info("stats")
    assert memory["used_memory"] < memory["maxmemory"] and stats["evicted_keys"] == 0

    # Dispatch, a report, a heartbeat and a cancel flag all still go through.
    assert admin.lpush("device.zero", b'{"task": "run"}') >= 1
    assert board_client(tenants, "zero").lpush(inbox_key("zero"), b"a report") >= 1
    assert board_client(tenants, "zero").psetex(heartbeat_key("zero"), 60_000, b"a heartbeat")
    flag = cancel_key_name("zero", str(uuid.uuid4()))
    CacheBox(tenants["url"]).set_flag(flag, 60, b"signed cancel")
    assert zero.read_flag(flag) == b"signed cancel"

    # The budget comes back as globex's entries expire (TTL 2 s): no sweeper, the next write credits them.
    deadline = time.monotonic() + 15
    while True:
        try:
            assert mallory.put_entries([(entry("globex", 0, "again"), b"m" * MB)], ttl=60) == MB
            break
        except CacheBoxOverQuota:
            assert time.monotonic() < deadline, "globex's budget did not recover after its entries expired"
            time.sleep(0.2)
    assert admin.mget(list(victims)) == list(victims.values())


def test_an_oversized_or_ttl_less_write_is_refused(tenants):
    mallory, direct, admin = board_store(tenants, "mallory"), board_client(tenants, "mallory"), tenants["admin"]
    own = entry("globex", 1)

    with pytest.raises(CacheBoxOverQuota) as too_large:
        mallory.put_entries([(own, b"x" * (2 * MB + 1))], ttl=60)
    assert too_large.value.code == "EC_TOO_LARGE" and "EDGECACHE_MAX_ENTRY_BYTES" in str(too_large.value)
    for ttl in (0, -1, 3601, "forever"):
        with pytest.raises(redis.ResponseError, match="EC_TTL"):
            direct.fcall(quota.PUT, 1, own, b"x", ttl)
    assert not admin.exists(own)

    # The board's own user has no command that stores a value without a TTL or grows one in place.
    attempts = {
        "SET": lambda: direct.set(own, b"x"),
        "SETNX": lambda: direct.setnx(own, b"x"),
        "MSET": lambda: direct.mset({own: b"x"}),
        "APPEND": lambda: direct.append(own, b"x"),
        "SETRANGE": lambda: direct.setrange(own, 0, b"x"),
        "PERSIST": lambda: direct.persist(own),
        "COPY": lambda: direct.copy(own, entry("globex", 2)),
        "RESTORE": lambda: direct.restore(own, 0, b"\x00"),
        "EVAL": lambda: direct.eval("return redis.call('SET', KEYS[1], 'x')", 1, own),
        "FUNCTION LOAD": lambda: direct.function_load(
            "#!lua name=evil\nredis.register_function('f', function() return 1 end)"
        ),
        "a budget of its own": lambda: direct.set("ec:quota:globex:{0}", b"0"),
    }
    allowed = []
    for name, call in attempts.items():
        try:
            call()
            allowed.append(name)
        except NoPermissionError:
            pass
    assert allowed == []
    assert (
        direct.psetex(own, 60_000, b"x") and 0 < direct.pttl(own) <= 60_000
    )  # what it can send directly carries a TTL

    # The control plane's own writes go through the same functions: no TTL asked, the longest allowed.
    control = CacheBox(tenants["url"])
    control.put_entries([(entry("acme", 3), b"y")])
    assert 0 < admin.ttl(entry("acme", 3)) <= 3600


def test_an_overwrite_is_charged_the_difference_and_a_delete_gives_the_bytes_back(tenants):
    mallory, admin = board_store(tenants, "mallory"), tenants["admin"]
    names = [entry("globex", index, "ow") for index in range(7)]
    mallory.put_entries([(name, b"o" * MB) for name in names], ttl=600)
    for _ in range(5):  # the same key, again and again: charged once
        mallory.put_entries([(names[0], b"p" * MB)], ttl=600)
    with pytest.raises(CacheBoxOverQuota):
        mallory.put_entries([(entry("globex", 99, "ow"), b"o" * (2 * MB))], ttl=600)
    assert mallory.delete(names[:2]) == 2
    mallory.put_entries([(entry("globex", 99, "ow"), b"o" * (2 * MB))], ttl=600)
    total = int(admin.hget("ec:quota:globex:{0}", "total"))
    assert 7 * MB < total <= 8 * MB


def _partial_set(port: int, key: str, announced: int, sent: int) -> socket.socket:
    """A client that starts a SET of ``announced`` bytes and sends only ``sent`` of them, then waits."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn.sendall(f"*3\r\n$3\r\nSET\r\n${len(key)}\r\n{key}\r\n${announced}\r\n".encode())
    conn.sendall(b"z" * sent)
    return conn


def test_unfinished_huge_writes_cannot_take_the_servers_memory(tmp_path):
    """The probe's two unfinished 80 MB SETs, and many unfinished SETs just under the value cap:
    the server refuses the first at once and closes the clients that hold the most, so a dispatch
    still finds room."""
    port = embedded._low_free_ports(1)[0]
    url = embedded.ensure_running(tmp_path, port=port, maxmemory="64mb", max_value=4 * MB)
    admin = redis.Redis.from_url(url, socket_timeout=5)
    conns: list[socket.socket] = []
    try:
        # A value over the cap is refused when its length is announced (nothing is buffered).
        huge = _partial_set(port, "huge", 80 * MB, 64 * 1024)
        conns.append(huge)
        assert b"invalid bulk length" in huge.recv(200)

        # 20 clients each start a 4.5 MB SET and stop short: 88 MB of buffers on a 64 MB server.
        for index in range(20):
            conns.append(_partial_set(port, f"part{index}", 4_500_000, 4_400_000))
        deadline = time.monotonic() + 30
        while admin.info("stats").get("evicted_clients", 0) == 0:
            assert time.monotonic() < deadline, "the server never closed a client over maxmemory-clients"
            time.sleep(0.05)
        memory = admin.info("memory")
        assert memory["used_memory"] < memory["maxmemory"]
        assert admin.lpush("device.zero", b'{"task": "run"}') == 1  # dispatch still finds room
    finally:
        for conn in conns:
            conn.close()
        admin.close()
        embedded.stop(tmp_path, port)


def test_on_a_cluster_each_node_holds_a_namespace_to_its_quota(tmp_path):
    """Keys of one slot per call: each node keeps the namespace's ledger under the first ``{k}`` it
    serves, so the budget is counted where the bytes are, and no node holds more than the quota."""
    cluster = embedded.ensure_cluster(tmp_path / "cluster")
    try:
        store = CacheBox(cluster.url)
        limits = quota.Limits(quota=64 * 1024, overhead=256)
        store.load_functions(limits)
        namespace = f"t-{uuid.uuid4().hex[:12]}"
        stored = refused = 0
        for index in range(240):
            try:
                store.put_entries([(entry(namespace, index), b"c" * 1000)], ttl=600)
                stored += 1
            except CacheBoxOverQuota as exc:
                assert exc.code == "EC_QUOTA"
                refused += 1
        charge = 1000 + len(entry(namespace, 0)) + limits.overhead
        assert refused > 0 and stored <= 3 * (limits.quota // charge)
        for port in cluster.ports:
            node = redis.Redis(port=port, socket_timeout=5)
            (ledger,) = [name for name in node.scan_iter(match=f"ec:quota:{namespace}:*") if not name.endswith(b":exp")]
            on_node = sum(1 for _ in node.scan_iter(match=f"ec:e:{namespace}:*"))
            assert int(node.hget(ledger, "total")) == on_node * charge <= limits.quota
            assert (
                on_node >= limits.quota // charge - 1
            )  # each node filled up to its quota (entries spread by their own digest)
    finally:
        cluster.stop()


def test_a_namespaces_quota_is_a_quarter_of_maxmemory_unless_set(settings, small_box):
    from dashboard.actions.cache import cachebox_limits

    admin = CacheBox(small_box[0])
    settings.EDGECACHE_NAMESPACE_QUOTA = 0
    assert cachebox_limits(admin).quota == 16 * MB  # of the small box's 64 MB
    settings.EDGECACHE_NAMESPACE_QUOTA = 5 * MB
    assert cachebox_limits(admin).quota == 5 * MB
    assert quota.default_quota(0) == 256 * MB  # a server with no maxmemory

"""A board's own Redis identity, tried from the attacker's seat: the probes of a compromised board,
replayed with that board's credentials against a real Valkey with ACLs (and the 3-node cluster).

Two tenants: ``acme`` (board ``zero``, the victim) and ``globex`` (board ``mallory``, whose
credentials the attacker holds). Every attack is refused by the server (NOPERM, or no such
login); everything ``mallory`` does as a board still works.
"""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from cachebox import acl, embedded, quota
from cachebox.store import CacheBox

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]

PASSWORD = "the-control-planes-own-password"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A Valkey whose default user needs the control plane's password (as `make run`'s)."""
    data_dir = tmp_path_factory.mktemp("guarded")
    port = embedded._low_free_ports(1)[0]
    url = embedded.ensure_running(data_dir, port=port, maxmemory="256mb", password=PASSWORD)
    yield url, port
    embedded.stop(data_dir, port, password=PASSWORD)


@pytest.fixture
def plane(settings, guarded, monkeypatch):
    """The control plane on the guarded Valkey; two tenants, one enrolled board each."""
    from dashboard import actions
    from dashboard.models import Namespace
    from tests.dashboard.test_dashboard import enrolled

    url, port = guarded
    settings.REDIS_URL = url
    settings.EDGECACHE_CACHEBOX_URL = ""
    settings.EDGECACHE_BOARD_ACL = True
    monkeypatch.setattr(
        "dashboard.actions.identities.declare_queue", lambda device: None
    )  # the test's Celery app has no broker here
    for name in ("acme", "globex"):
        Namespace.objects.get_or_create(name=name)
    boards = {}
    for name, namespace in (("zero", "acme"), ("mallory", "globex")):
        device, token = actions.register_device(None, name=name, cpu_threads=1, namespace_id=namespace)
        boards[name] = enrolled(device, token)
    yield {"url": url, "port": port, "keys": boards}
    admin = redis.Redis(port=port, username="default", password=PASSWORD)
    for user in admin.execute_command("ACL", "USERS"):
        if user.decode().startswith((acl.BOARD_USER_PREFIX, acl.ENROLL_USER_PREFIX)):
            admin.execute_command("ACL", "DELUSER", user)
    admin.flushall()


def as_board(plane, name: str) -> redis.Redis:
    return redis.Redis(
        port=plane["port"], username=acl.board_user(name), password=plane["keys"][name].redis_password, socket_timeout=5
    )


def refused(call) -> bool:
    try:
        call()
    except NoPermissionError:
        return True
    return False


def test_a_boards_credentials_reach_only_its_own_keys_queues_and_channels(plane):
    mallory = as_board(plane, "mallory")
    entry = f"ec:e:acme:57fa53c378686353:{{{'ab' * 16}}}"
    attacks = {
        # 1. code in the control plane: overwrite a Django cache value (a routing hint)
        "write Django's cache": lambda: mallory.set(
            "edgecache:django:1:api:prompt-cache-key:acme:x", b"\x80\x04pickle"
        ),
        # 2. forged key rings / registry records, another tenant's entries
        "write zero's registry record": lambda: mallory.set("ec:device:zero", b"{}"),
        "read zero's registry record": lambda: mallory.get("ec:device:zero"),
        "read acme's entries": lambda: mallory.get(entry),
        "re-sign acme's entries": lambda: mallory.set(entry, b"ECE3..."),
        "write acme's entries through the cache box's functions": lambda: mallory.fcall(
            quota.PUT, 1, entry, b"ECE3...", 60
        ),
        "give acme's budget away": lambda: mallory.hset("ec:quota:acme:{0}", "total", 10**12),
        "store its own entry with no TTL": lambda: mallory.set(f"ec:e:globex:57fa53c378686353:{{{'ef' * 16}}}", b"x"),
        "read acme's catalog": lambda: mallory.hgetall("ec:c:{acme}:snap"),
        # 3. fake tokens to an application: publish on zero's runs' channels
        "publish on zero's stream": lambda: mallory.publish(
            f"ec:stream:zero:{uuid.uuid4()}", b"Pay to IBAN DE00 ATTACKER"
        ),
        # 4. posing as the control plane: push a request into zero's queue, remote control
        "push into zero's queue": lambda: mallory.lpush("device.zero", b"{}"),
        "broadcast remote control": lambda: mallory.publish("/0.celery.pidbox", b"{}"),
        "cancel zero's runs": lambda: mallory.set(f"ec:cancel:zero:{uuid.uuid4()}", b"1"),
        # 5. other tenants' prompts: read queues and streams
        "read zero's queue": lambda: mallory.lrange("device.zero", 0, -1),
        "read the control queue": lambda: mallory.lrange("control", 0, -1),
        "take reports off the control queue": lambda: mallory.brpop("control", 1),
        "name a task on the control queue": lambda: mallory.lpush("control", b"{}"),
        "read zero's inbox": lambda: mallory.lrange("ec:inbox:zero", 0, -1),
        "write into zero's inbox": lambda: mallory.lpush("ec:inbox:zero", b"{}"),
        "enroll as zero": lambda: mallory.lpush("ec:enroll:zero", b"{}"),
        "read zero's heartbeat": lambda: mallory.get("ec:hb:zero"),
        "beat as zero": lambda: mallory.psetex("ec:hb:zero", 60_000, b"{}"),
        "beat without expiry": lambda: mallory.set("ec:hb:mallory", b"{}"),
        "read its own inbox back": lambda: mallory.lrange("ec:inbox:mallory", 0, -1),
        "empty its own inbox": lambda: mallory.delete("ec:inbox:mallory"),
        "listen to zero's stream": lambda: mallory.execute_command("SUBSCRIBE", f"ec:stream:zero:{uuid.uuid4()}"),
        # 6. answers lost: a competing consumer of zero's queue, or of its unacknowledged messages
        "take zero's work": lambda: mallory.brpop("device.zero", 1),
        "move zero's work into its own queue": lambda: mallory.blmove(
            "device.zero", "device.mallory", 0.1, "RIGHT", "LEFT"
        ),
        "read zero's unacknowledged work": lambda: mallory.hgetall("unacked.zero"),
        "delete the control queue": lambda: mallory.delete("control"),
        "overwrite the control queue": lambda: mallory.set("control", b"x"),
        # admin and dangerous commands
        "flush everything": lambda: mallory.flushall(),
        "list every key": lambda: mallory.keys("*"),
        "scan every key": lambda: mallory.scan(0),
        "reconfigure the server": lambda: mallory.config_set("maxmemory", "1"),
        "make a user": lambda: mallory.execute_command("ACL", "SETUSER", "evil", "on", ">x", "~*", "+@all"),
        "run a script": lambda: mallory.eval("return 1", 0),
        "load a script": lambda: mallory.execute_command("SCRIPT", "LOAD", "while true do end"),
        "kill clients": lambda: mallory.execute_command("CLIENT", "KILL", "TYPE", "normal"),
    }
    allowed = [name for name, call in attacks.items() if not refused(call)]
    assert allowed == []

    # What mallory does as a board still works.
    own = f"ec:e:globex:57fa53c378686353:{{{'cd' * 16}}}"
    assert mallory.fcall(quota.PUT, 1, own, b"ECE3 sealed state", 60) and mallory.get(own) == b"ECE3 sealed state"
    assert (
        mallory.getrange(own, 0, 3) == b"ECE3" and mallory.strlen(own) > 0 and mallory.fcall(quota.TOUCH, 1, own, 120)
    )
    assert mallory.fcall(quota.CATALOG_APPEND, 1, "ec:c:{globex}:log", b"k" * 16) and mallory.xrange(
        "ec:c:{globex}:log"
    )
    assert json.loads(mallory.get("ec:device:mallory"))["name"] == "mallory"
    assert mallory.lpush("ec:inbox:mallory", b"a report") == 1  # its own inbox, write-only
    assert mallory.psetex("ec:hb:mallory", 60_000, b"a heartbeat")  # its own latest heartbeat, write-only
    assert mallory.lpush("device.mallory", b"x") and mallory.brpop(["device.mallory", "boards.globex"], 1)
    assert (
        mallory.lpush("device.mallory", b"y")
        and mallory.blmove("device.mallory", "device.mallory", 0.1, "RIGHT", "RIGHT") == b"y"
    )
    assert mallory.brpop(["device.mallory"], 1) == (b"device.mallory", b"y")  # looked at, left in place
    assert mallory.publish(f"ec:stream:mallory:{uuid.uuid4()}", b"token") == 0
    assert mallory.get(f"ec:cancel:mallory:{uuid.uuid4()}") is None


def test_the_deployment_password_stays_with_the_control_plane(plane):
    """A board's credentials are its own user's; the server's default user needs the control plane's password."""
    with pytest.raises((AuthenticationError, ResponseError)):
        redis.Redis(port=plane["port"], socket_timeout=5).get("control")  # no password
    with pytest.raises(AuthenticationError):
        redis.Redis(
            port=plane["port"], username="default", password=plane["keys"]["mallory"].redis_password, socket_timeout=5
        ).ping()
    with pytest.raises(AuthenticationError):  # one board's password opens no other board's user
        redis.Redis(
            port=plane["port"],
            username=acl.board_user("zero"),
            password=plane["keys"]["mallory"].redis_password,
            socket_timeout=5,
        ).ping()
    from dashboard.models import Device

    row = Device.objects.filter(name="mallory").values().get()
    assert plane["keys"]["mallory"].redis_password not in json.dumps(row, default=str)  # only its SHA-256


def test_revoking_a_device_deletes_its_user_and_closes_its_connections(plane):
    from dashboard import actions
    from dashboard.models import Device

    mallory = as_board(plane, "mallory")
    assert mallory.ping()
    actions.revoke_device(None, Device.objects.get(name="mallory"))
    with pytest.raises((redis.ConnectionError, AuthenticationError)):
        mallory.ping()  # its connection was closed, and a new one cannot log in
    with pytest.raises(AuthenticationError):
        as_board(plane, "mallory").ping()


def test_a_rotated_token_leaves_the_old_board_no_login(plane):
    from dashboard import actions
    from dashboard.models import Device

    old = as_board(plane, "zero")
    assert old.ping()
    actions.rotate_token(None, Device.objects.get(name="zero"))
    with pytest.raises(AuthenticationError):
        as_board(plane, "zero").ping()


def test_the_users_come_back_after_the_server_lost_them(plane):
    """A cache box restarted without its ACL file: the sweeper's check applies every user again."""
    from dashboard.actions.devices import APPLIED_FLAG, ensure_identities

    admin = redis.Redis(port=plane["port"], username="default", password=PASSWORD)
    ensure_identities()  # as at the control plane's start: every user applied, the server flagged
    admin.execute_command("ACL", "DELUSER", acl.board_user("mallory"))
    assert ensure_identities() is False  # the server still has its flag: nothing to do (one GET)
    admin.delete(APPLIED_FLAG)
    assert ensure_identities() is True
    assert as_board(plane, "mallory").ping()


def test_a_device_registered_while_the_users_are_reconciled_keeps_its_enrollment_user(plane, monkeypatch):
    """The control worker's start reconciles every user while a board may be registered: the new
    device's enrollment user, made after the reconciler read the devices, was taken for a deleted
    device's and removed (its board then failed to log in, CI's hosts fleet once)."""
    from cachebox.store import CacheBox
    from dashboard import actions
    from dashboard.actions.identities import apply_all_identities
    from inference.board.identity import enrollment_redis_password

    listed = CacheBox.users
    late = {}

    def register_meanwhile(store):
        if not late:  # the device is registered between the reconciler's read and its listing of users
            late["token"] = actions.register_device(None, name="latecomer", cpu_threads=1, namespace_id="acme")[1]
        return listed(store)

    monkeypatch.setattr(CacheBox, "users", register_meanwhile)
    apply_all_identities()
    enrolling = redis.Redis(
        port=plane["port"],
        username=acl.enroll_user("latecomer"),
        password=enrollment_redis_password(late["token"]),
        socket_timeout=5,
    )
    assert enrolling.ping()  # its user is still there: the board can enroll
    admin = redis.Redis(port=plane["port"], username="default", password=PASSWORD)
    admin.execute_command("ACL", "SETUSER", acl.board_user("gone"), "on", ">x")  # a deleted device's user
    apply_all_identities()
    assert acl.board_user("gone").encode() not in admin.execute_command("ACL", "USERS")  # still removed


@pytest.mark.model
def test_a_board_on_the_cluster_with_its_own_credentials_keeps_to_its_namespace(
    settings, monkeypatch, tmp_path_factory, engine, signing_keys
):
    """The cluster URL too: users on every node; a board's store as its own user reads and writes its
    namespace's entries (one node per entry) and no other tenant's."""
    from dashboard import actions
    from dashboard.models import Namespace
    from inference.board.config import BoardConfig
    from inference.board.runtime import Board
    from tests.dashboard.test_dashboard import enrolled

    cluster = embedded.ensure_cluster(tmp_path_factory.mktemp("cluster-acl"))
    try:
        settings.REDIS_URL = cluster.node_url(0)  # the broker: one plain server (here a cluster node)
        settings.EDGECACHE_CACHEBOX_URL = cluster.url
        settings.EDGECACHE_BOARD_ACL = True
        monkeypatch.setattr("dashboard.actions.identities.declare_queue", lambda device: None)
        monkeypatch.setattr("dashboard.actions.identities.servers", lambda: [CacheBox(cluster.url)])
        Namespace.objects.get_or_create(name="acme")
        device, token = actions.register_device(None, name="zero", cpu_threads=1, namespace_id="acme")
        keys = enrolled(device, token)
        own_url = acl.with_credentials(cluster.url, acl.board_user("zero"), keys.redis_password)
        store = CacheBox(own_url, connect_timeout=0.5, timeout=5)
        board = Board(
            engine,
            store,
            BoardConfig(device="zero", namespace="acme", context_reuse=False, ram_tier_bytes=0),
            background_sync=False,
            keys=signing_keys,
        )
        prompt = "Question: which planet is the largest?\nAnswer:"
        cold = board.run(prompt, max_tokens=3)
        assert cold.breakdown.cachebox == "ok" and cold.breakdown.uploaded_bytes > 0
        board.catalogs.sync_all()
        hit = board.run(prompt, max_tokens=3)
        assert hit.breakdown.case == "full" and hit.tokens == cold.tokens
        with pytest.raises(Exception):
            store.put_entries([(f"ec:e:globex:57fa53c378686353:{{{'ab' * 16}}}", b"x")])  # another tenant's entry
        for node in range(3):  # the user exists on every node
            plain = redis.Redis(port=cluster.ports[node], username=acl.board_user("zero"), password=keys.redis_password)
            assert plain.ping()
            assert refused(lambda: plain.keys("*"))
    finally:
        cluster.stop()

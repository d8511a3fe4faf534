"""The probes of a compromised board, replayed: each test holds what an attacker holds (a board's
Redis access, a copy of the database, a Redis dump) and checks that the attack is refused.

Probes that need the whole stack with ACL users live in tests/security/test_board_acl.py; this file holds the
ones a Django test reaches directly.
"""

from __future__ import annotations

import ast
import asyncio
import json
import pickle
import threading
import uuid
from pathlib import Path

import pytest
import redis
from channels.layers import channel_layers, get_channel_layer
from django.core.cache import caches

from cachebox.store import CacheBox
from tests.conftest import ROOT

pytestmark = pytest.mark.django_db(transaction=False)


class _Marker:
    """A pickle that, when loaded, creates a file: what the attacker's payload did (ran code)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# -- probe 1: no pickle anywhere ----------------------------------------------------------------------
@pytest.fixture
def redis_cache(settings, valkey_url):
    """Django's cache as production configures it (the cache box's server), under this test's own prefix."""
    from dashboard import settings as configured

    prefix = f"edgecache-test-{uuid.uuid4().hex[:12]}"
    settings.CACHES = {"default": {**configured.CACHES["default"], "LOCATION": valkey_url, "KEY_PREFIX": prefix}}
    caches._settings = None  # noqa: SLF001 - re-read settings.CACHES
    server = redis.Redis.from_url(valkey_url)
    yield server, prefix
    caches["default"].clear()


@pytest.mark.cachebox
def test_a_pickle_planted_in_a_routing_hint_runs_nothing_and_is_ignored(redis_cache, tmp_path):
    from dashboard.api import board_choice

    server, prefix = redis_cache
    marker = tmp_path / "pwned"
    # The attacker, holding a board's Redis access, overwrites the hint of a prompt_cache_key.
    name = caches["default"].make_key(board_choice._cache_name("default", "victim-key"))
    server.set(name, pickle.dumps(_Marker(marker)))
    assert board_choice._remembered("default", "victim-key") is None
    assert not marker.exists()
    # Hints written by the control plane itself still work (JSON).
    board_choice.remember("default", "victim-key", type("D", (), {"name": "pi5"})())
    assert board_choice._remembered("default", "victim-key") == "pi5"
    assert json.loads(server.get(name)) == "pi5"


@pytest.mark.cachebox
def test_rate_limit_counters_stay_numbers_the_server_can_count(redis_cache):
    from dashboard.security import ratelimit

    server, prefix = redis_cache
    for expected in (1, 2, 3):
        assert ratelimit.hit("api", 7, 10).count == expected
    (key,) = server.keys(f"{prefix}:*")
    assert server.get(key) == b"3"


def test_no_configured_serializer_cache_or_queue_can_unpickle(tmp_path):
    """Every place that decodes bytes someone else wrote: Django's caches, sessions, Celery on both
    sides, the channel layer. A pickle handed to each must not run."""
    from django.core.cache.backends.base import BaseCache
    from django.utils.module_loading import import_string

    from dashboard import settings as configured
    from dashboard.celery import app as control_app
    from inference.board.app import celery_settings

    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Marker(marker))
    for alias, config in configured.CACHES.items():
        backend = import_string(config["BACKEND"])
        assert issubclass(backend, BaseCache)
        cache = backend(
            config.get("LOCATION", ""), {**config, "KEY_PREFIX": "probe", "OPTIONS": {**config.get("OPTIONS", {})}}
        )
        serializer = getattr(getattr(cache, "_cache", None), "_serializer", None) or getattr(cache, "_serializer", None)
        assert serializer is not None, f"cache {alias!r} names no serializer of ours"
        with pytest.raises(ValueError):
            serializer.loads(payload)
    from django.conf import settings as live

    assert live.SESSION_SERIALIZER == "django.contrib.sessions.serializers.JSONSerializer"
    for conf in (control_app.conf, celery_settings("redis://127.0.0.1:1/0")):
        get = conf.get if hasattr(conf, "get") else conf.__getitem__
        assert list(get("accept_content")) == ["json"]
        assert get("task_serializer") == "json" and get("result_serializer") == "json"
        assert get("worker_enable_remote_control") is False
    from kombu.serialization import loads

    with pytest.raises(Exception):
        loads(payload, "application/x-python-serialize", "binary", accept=["json"])
    from channels_redis.core import RedisChannelLayer

    layer = RedisChannelLayer(hosts=["redis://127.0.0.1:1/0"], symmetric_encryption_keys=["k" * 50])
    with pytest.raises(Exception):
        layer.deserialize(payload)
    assert not marker.exists()


def test_no_module_of_ours_imports_pickle():
    offenders = []
    for package in ("cachebox", "inference", "dashboard"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = [alias.name for alias in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
                module = node.module if isinstance(node, ast.ImportFrom) else None
                if any(name.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle") for name in names) or (
                    module or ""
                ).split(".")[0] in ("pickle", "dill"):
                    offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


# -- probe 7: the rate limit fails closed ----------------------------------------------------------------
def test_an_unreachable_cache_still_limits_in_this_process(settings, caplog):
    from dashboard.security import ratelimit

    settings.CACHES = {
        "default": {
            "BACKEND": "dashboard.store.django_cache.CacheBoxRedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",
            "KEY_PREFIX": "t",
            "OPTIONS": {"socket_connect_timeout": 0.2},
        }
    }
    caches._settings = None  # noqa: SLF001
    who = uuid.uuid4().hex
    verdicts = [ratelimit.hit("api", who, 5) for _ in range(8)]
    assert [verdict.allowed for verdict in verdicts] == [True] * 5 + [False] * 3
    assert all(verdict.retry_after >= 1 for verdict in verdicts[5:])
    assert "counted in this process" in caplog.text


@pytest.mark.cachebox
def test_two_hundred_parallel_requests_get_no_more_than_the_limit(redis_cache, settings):
    """The probe: 200 requests at once on a key limited to 60 per minute. A bounded pool makes some
    wait for a connection; none is let through uncounted."""
    from dashboard.security import ratelimit

    settings.CACHES["default"]["OPTIONS"] = {
        **settings.CACHES["default"]["OPTIONS"],
        "max_connections": 4,
        "timeout": 0.05,
    }
    caches._settings = None  # noqa: SLF001
    who = uuid.uuid4().hex
    allowed = []
    barrier = threading.Barrier(50)

    def burst():
        barrier.wait()
        for _ in range(4):
            allowed.append(ratelimit.hit("api", who, 60).allowed)

    threads = [threading.Thread(target=burst) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(allowed) == 200 and 0 < allowed.count(True) <= 60


# -- weak: bounded JSON, live events only from the server ----------------------------------------------------
def test_json_nested_a_hundred_thousand_deep_is_a_400_in_openais_shape(client):
    from dashboard.actions.api_keys import create_key
    from dashboard.models import Namespace

    Namespace.objects.get_or_create(name="default")
    _, key = create_key(None, "default")
    for body in ("[" * 100_000 + "]" * 100_000, '{"model": "m", "messages": ' + "[" * 40 + "]" * 40 + "}"):
        response = client.post(
            "/v1/chat/completions", data=body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
        )
        assert response.status_code == 400, response.content[:200]
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "nests too deeply" in error["message"]


def test_a_pages_socket_reads_longer_than_its_blocking_pop_waits():
    """A page's socket waits for events with a blocking pop; a read that gave up first (redis-py 8
    reads for 5 s by default, as long as the pop) killed the consumer under load, and the page lost
    the events that came while it reconnected (an encode's last progress, in a busy test run)."""
    from dashboard import settings as configured
    from dashboard.live.broadcast import AuthenticatedChannelLayer

    layer = AuthenticatedChannelLayer(**configured.CHANNEL_LAYERS["default"]["CONFIG"])
    assert layer.create_pool(0).connection_kwargs.get("socket_timeout", 0) > layer.brpop_timeout


@pytest.mark.cachebox
def test_a_live_event_written_into_redis_by_someone_else_never_reaches_a_page(settings, valkey_url):
    from dashboard import settings as configured
    from dashboard.live.broadcast import GROUP

    settings.CHANNEL_LAYERS = {
        "default": {
            **configured.CHANNEL_LAYERS["default"],
            "CONFIG": {
                **configured.CHANNEL_LAYERS["default"]["CONFIG"],
                "hosts": [valkey_url],
                "prefix": f"t{uuid.uuid4().hex[:8]}",
            },
        }
    }
    channel_layers.backends.clear()

    async def scenario():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(GROUP, channel)
        # The attacker writes a message of its own making where the layer keeps the channel's messages.
        from channels_redis.core import RedisChannelLayer

        forged = RedisChannelLayer(hosts=[valkey_url], prefix=layer.prefix)  # same server, no key
        await forged.group_send(
            GROUP,
            {"type": "live.event", "event": "device", "data": {"name": "zero", "revoked": True}, "device": "zero"},
        )
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(layer.receive(channel), timeout=1.0)
        # What the server itself sends arrives.
        await layer.group_send(
            GROUP, {"type": "live.event", "event": "run", "data": {"device": "zero"}, "device": "zero"}
        )
        message = await asyncio.wait_for(layer.receive(channel), timeout=5.0)
        assert message["event"] == "run"
        await layer.group_discard(GROUP, channel)
        await layer.flush()

    try:
        asyncio.run(scenario())
    finally:
        channel_layers.backends.clear()


# -- probe 9: registration keeps the namespace chosen; weak: schemas belong to namespaces -----------------
@pytest.fixture
def staff(django_user_model, client):
    user = django_user_model.objects.create_user("root", password="pw-root-12345", is_staff=True, is_superuser=True)
    client.force_login(user)
    return client


def test_registering_a_device_keeps_the_namespace_chosen(staff, monkeypatch):
    from django.urls import reverse

    from dashboard.models import Device, Namespace

    monkeypatch.setattr("dashboard.actions.devices.publish_device", lambda device, enrollment=None: True)
    tenant = Namespace.objects.create(name="tenant-b")
    response = staff.post(
        reverse("device-register"),
        {
            "name": "b-board",
            "namespace": tenant.name,
            "kind": "",
            "cpu_threads": 1,
            "memory_mb": 512,
            "link_preset": "none",
        },
    )
    assert response.status_code == 302 and response["Location"] == reverse("device-token", args=["b-board"]), (
        response.content[:500]
    )
    assert Device.objects.get(name="b-board").namespace_id == "tenant-b"


TRAVEL = '<schema name="{name}"><module name="city">Lisbon has trams.</module></schema>'


def test_a_namespaces_schema_is_neither_seen_nor_run_by_another_tenant(client, django_user_model):
    from django.urls import reverse

    from dashboard.forms import RunForm
    from dashboard.models import Device, Membership, Namespace, Schema

    for name in ("acme", "globex"):
        Namespace.objects.create(name=name)
    own = Schema(source=TRAVEL.format(name="acme-travel"), namespace="acme")
    own.full_clean(), own.save()
    shared = Schema(source=TRAVEL.format(name="shared-travel"))
    shared.full_clean(), shared.save()
    globex_device = Device.objects.create(name="g1", namespace_id="globex", token_sha256="x")
    bob = django_user_model.objects.create_user("bob", password="pw-bob-12345")
    Membership.objects.create(user=bob, namespace_id="globex")
    client.force_login(bob)
    listing = client.get(reverse("schemas")).content.decode()
    assert "shared-travel" in listing and "acme-travel" not in listing
    assert client.get(reverse("schema-detail", args=[own.pk])).status_code == 404
    form = RunForm(
        {
            "devices": [globex_device.pk],
            "source": "pml",
            "pml": '<prompt schema="acme-travel"><city/></prompt>',
            "max_tokens": 4,
        },
        user=bob,
    )
    assert not form.is_valid() and "schema" in form.errors
    form = RunForm(
        {
            "devices": [globex_device.pk],
            "source": "pml",
            "pml": '<prompt schema="shared-travel"><city/></prompt>',
            "max_tokens": 4,
        },
        user=bob,
    )
    assert form.is_valid(), form.errors


def test_an_api_key_runs_only_its_namespaces_and_shared_schemas(client):
    from dashboard.actions.api_keys import create_key
    from dashboard.models import Namespace, Schema

    for name in ("acme", "globex"):
        Namespace.objects.create(name=name)
    schema = Schema(source=TRAVEL.format(name="acme-travel"), namespace="acme")
    schema.full_clean(), schema.save()
    _, key = create_key(None, "globex")
    body = {
        "model": "m",
        "messages": [],
        "edgecache": {"schema": "acme-travel", "pml": '<prompt schema="acme-travel"><city/></prompt>'},
    }
    response = client.post(
        "/v1/chat/completions",
        data=json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key}",
    )
    assert response.status_code == 400 and "No schema named 'acme-travel'" in response.json()["error"]["message"]


# -- probe 8: a copy of the database opens nothing live ----------------------------------------------------
def test_a_session_copied_from_the_database_replays_no_login(client, django_user_model):
    from django.contrib.sessions.models import Session
    from django.test import Client

    admin = django_user_model.objects.create_superuser("admin", "", "pw-admin-12345")
    page = client.post("/accounts/login/", {"username": "admin", "password": "pw-admin-12345"})  # as a person logs in
    assert page.status_code == 302, page.content[:300]
    cookie = client.cookies["sessionid"].value
    assert client.get("/admin/").status_code == 200
    rows = list(Session.objects.values_list("session_key", flat=True))
    assert rows and cookie not in rows  # the table holds no cookie
    for stolen in rows:  # the attacker's replay of what the dump holds
        thief = Client()
        thief.cookies["sessionid"] = stolen
        assert thief.get("/admin/").status_code == 302
    client.logout()  # logging out still ends it server-side
    assert not Session.objects.exists()
    replay = Client()
    replay.cookies["sessionid"] = cookie
    assert replay.get("/admin/").status_code == 302
    assert admin.pk


def test_a_copy_of_the_database_enrolls_no_board(settings, monkeypatch):
    """The probe: a registered but not yet started device's enroll_key let the attacker enroll its own
    keys. The database now keeps the token's public key only: nothing in the row signs an enrollment."""
    from dashboard import actions
    from dashboard.models import Device
    from inference.board.identity import BoardKeys

    monkeypatch.setattr("dashboard.actions.devices.publish_device", lambda device, enrollment=None: True)
    monkeypatch.setattr("dashboard.actions.identities.apply_identity", lambda device, **kw: True)
    device, token = actions.register_device(None, name="pending", cpu_threads=1)
    row = Device.objects.filter(name="pending").values().get()
    attacker = BoardKeys.generate()
    for value in row.values():  # every secret-looking value of the row, tried as the token
        if isinstance(value, str) and value:
            assert actions.enroll_device(attacker.enrollment("pending", value)) is None
    assert Device.objects.get(name="pending").signing_public_key == ""
    assert actions.enroll_device(BoardKeys.generate().enrollment("pending", token)) is not None  # the token itself does


def test_an_expired_token_enrolls_nothing(monkeypatch):
    from datetime import timedelta

    from django.utils import timezone

    from dashboard import actions
    from dashboard.models import Device
    from inference.board.identity import BoardKeys

    monkeypatch.setattr("dashboard.actions.devices.publish_device", lambda device, enrollment=None: True)
    monkeypatch.setattr("dashboard.actions.identities.apply_identity", lambda device, **kw: True)
    device, token = actions.register_device(None, name="late", cpu_threads=1)
    Device.objects.filter(pk=device.pk).update(token_expires=timezone.now() - timedelta(seconds=1))
    assert actions.enroll_device(BoardKeys.generate().enrollment("late", token)) is None


def test_secrets_live_outside_the_state_folder(tmp_path):
    from inference.board.config import secrets_home

    home = tmp_path / "state"
    secrets = secrets_home({"EDGECACHE_HOME": str(home)})
    assert home not in secrets.parents and secrets != home
    assert (
        secrets_home({"EDGECACHE_HOME": str(home), "EDGECACHE_SECRETS_DIR": str(tmp_path / "vault")})
        == tmp_path / "vault"
    )


# -- probe 2: forged key rings and registry records ------------------------------------------------------
@pytest.mark.cachebox
def test_a_forged_ring_or_revocation_in_the_registry_changes_nothing_on_the_board(
    settings, valkey_url, monkeypatch, caplog
):
    """The attacker (able to write the registry key, as every board once was) seals a ring of its own to
    zero's public key, and then sets ``revoked: true``. zero refuses both records and serves on."""
    from cachebox.signing import control_plane_key, derive_keyring, seal
    from dashboard import actions
    from dashboard.models import Namespace
    from inference import board as edge
    from inference.board import devices as registry
    from inference.board.identity import BoardKeys

    settings.REDIS_URL = valkey_url
    settings.EDGECACHE_BOARD_ACL = (
        False  # the session's Valkey has no users to manage; the registry is what is tried here
    )
    Namespace.objects.get_or_create(name="default")
    device, token = actions.register_device(None, name="zero", cpu_threads=1)
    me = edge.become(
        "zero", BoardKeys.generate(), CacheBox(valkey_url), token=token, send=actions.enroll_device, timeout=5
    )
    good_ring = me.ring
    store = CacheBox(valkey_url)
    attacker = control_plane_key(b"the attacker's very own secret!!")
    planted = derive_keyring(b"the attacker's very own secret!!", "default", 1)
    record = registry.lookup(store, "zero")
    record.keyring = seal(planted, bytes.fromhex(me.keys.box_public_key), "zero", attacker)
    for forged in (
        {**record.signed_document, "keyring": record.keyring},  # the genuine signature over other fields
        registry.sign_document(
            attacker, {**record.signed_document, "keyring": record.keyring}
        ),  # the attacker's signature
        registry.sign_document(attacker, {**record.signed_document, "revoked": True}),
        {**record.signed_document, "revoked": True},
    ):
        store.put_device_record("zero", json.dumps(forged))
        with caplog.at_level("INFO", logger="edgecache.security"):
            me.recheck()  # refused and logged; not a revocation, not new keys
        assert me.ring == good_ring and not me.record.revoked
    assert sum(1 for r in caplog.records if r.getMessage() == "record_refused") >= 4
    # An older genuine record, replayed, is refused too (its serial is behind).
    actions.publish_device(device)
    older = json.loads(store.get_device_record("zero"))
    actions.rotate_signing_key(None, Namespace.objects.get(name="default"))
    me.recheck()
    assert me.ring.current == 2
    store.put_device_record("zero", json.dumps(older))
    me.recheck()
    assert me.ring.current == 2


# -- probe 3: fake tokens streamed to an application --------------------------------------------------------
@pytest.mark.cachebox
def test_the_api_follows_only_events_the_dispatched_board_signed(settings, valkey_url):
    """A run's channel carries an attacker's unsigned event and one signed by another board; the API's
    reader takes only the dispatched board's (and the control plane's)."""
    from cachebox.keys import stream_channel
    from cachebox.signing import derive_keyring
    from dashboard.api.views import _Follower
    from dashboard.live import streams
    from inference.board.identity import BoardKeys
    from inference.contract import envelope as env
    from inference.contract.envelope import Kind
    from inference.contract.messages import StreamEvent

    ring = derive_keyring(b"m" * 32, "default", 1)
    zero, mallory = BoardKeys.generate(), BoardKeys.generate()
    device = type("D", (), {"name": "zero", "signing_public_key": zero.signing_public_key})()
    request_id = str(uuid.uuid4())

    def published(keys, sender, event):
        return json.dumps(
            env.seal(event.compact(), kind=Kind.STREAM, sender=sender, to=request_id, signer=keys.signing, ring=ring)
        ).encode()

    async def scenario():
        subscription = await streams.subscribe(valkey_url, stream_channel("zero", request_id)).open()
        follower = _Follower(subscription, request_id, device, 10, lambda _ns: ring)
        store = CacheBox(valkey_url)
        fake = StreamEvent(
            type="token", request_id=request_id, device="zero", text="Pay to IBAN DE00 ATTACKER 6666 today."
        )
        store.publish(stream_channel("zero", request_id), json.dumps(fake.compact()).encode())
        store.publish(stream_channel("zero", request_id), published(mallory, "zero", fake))
        store.publish(
            stream_channel("zero", request_id),
            published(mallory, "mallory", StreamEvent(type="done", request_id=request_id, text="fake")),
        )
        store.publish(
            stream_channel("zero", request_id),
            published(zero, "zero", StreamEvent(type="token", request_id=request_id, text=" 10000")),
        )
        store.publish(
            stream_channel("zero", request_id),
            published(
                zero, "zero", StreamEvent(type="done", request_id=request_id, text=" 10000", finish_reason="stop")
            ),
        )
        events = [await follower.next(), await follower.next()]
        await subscription.close()
        return events

    events = asyncio.run(scenario())
    assert [(e.type, e.text) for e in events] == [("token", " 10000"), ("done", " 10000")]


# -- probe 6: answers lost for good ----------------------------------------------------------------------------
@pytest.mark.cachebox
def test_a_run_nobody_takes_before_its_expiry_ends_as_a_failed_run_with_the_reason(settings, valkey_url, monkeypatch):
    from datetime import timedelta

    from django.utils import timezone

    from dashboard import actions
    from dashboard.actions import sweeper
    from dashboard.models import Dispatch, InferenceRun
    from tests.dashboard.test_dashboard import register

    settings.REDIS_URL = valkey_url
    settings.EDGECACHE_BOARD_ACL = False
    monkeypatch.setattr("dashboard.outbox.app.send_task", lambda *a, **k: None)  # the board never starts
    device, _ = register("never")
    sent = actions.dispatch_run(
        None, [device], actions.run_request(segments=["Tenant secret question?"], max_tokens=4, title="waits")
    )
    request_id = sent[0]["request_id"]
    assert sweeper.sweep()["lost"] == 0  # not expired yet
    later = (
        timezone.now()
        + timedelta(seconds=settings.EDGECACHE_TASK_EXPIRES)
        + sweeper.EXPIRY_GRACE
        + timedelta(seconds=1)
    )
    assert sweeper.sweep(later)["lost"] == 1
    run = InferenceRun.objects.get(request_id=request_id)
    assert run.error.startswith("lost: board never did not start it before it expired") and "send it again" in run.error
    assert run.device == device and run.prompt == "Tenant secret question?"
    assert Dispatch.objects.get(request_id=request_id).outcome == "lost" and sweeper.sweep(later)["lost"] == 0  # once


# -- a copy of the database ------------------------------------------------------------------------
SECRET_PROMPT, SECRET_ANSWER, SECRET_MODULE, SECRET_SAVED = (
    "the merger closes on Friday",
    "keep it quiet",
    "Quarterly numbers: 4.2M",
    "Alice's diagnosis",
)


def _database_copy() -> str:
    """Every value of every table, as a copy of the database (a dump, a backup) shows it."""
    from django.db import connection

    parts = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            parts += [str(value) for row in cursor.fetchall() for value in row]
    return "\n".join(parts)


def test_a_copy_of_the_database_shows_no_prompt_answer_or_schema_text(monkeypatch, django_user_model):
    """The probe: the database held prompts, answers and schema texts in clear, and so did a copy.
    They are now sealed at rest under a key derived from the master secret (in the secrets folder,
    never in the database); the control plane reads them as before, and its search still finds them."""

    from dashboard import actions
    from dashboard.forms import RunFilterForm
    from dashboard.models import Dispatch, InferenceRun, SavedPrompt, Schema

    monkeypatch.setattr("dashboard.actions.devices.publish_device", lambda device, enrollment=None: True)
    monkeypatch.setattr("dashboard.actions.identities.apply_identity", lambda device, **kw: True)
    device, _ = actions.register_device(None, name="copied", cpu_threads=1)
    run = InferenceRun.objects.create(
        device=device, title=SECRET_PROMPT[:20], prompt=SECRET_PROMPT, text=SECRET_ANSWER, error=""
    )
    Dispatch.objects.create(
        request_id=uuid.uuid4(), kind="run", device=device, namespace="default", request={"segments": [SECRET_PROMPT]}
    )
    SavedPrompt.objects.create(name="notes", text=SECRET_SAVED)
    schema = Schema(source=TRAVEL.format(name="finance").replace("Lisbon has trams.", SECRET_MODULE))
    schema.full_clean()
    schema.save()

    copy = _database_copy()
    for secret in (SECRET_PROMPT, SECRET_ANSWER, SECRET_MODULE, SECRET_SAVED, "merger", "diagnosis"):
        assert secret not in copy, f"{secret!r} is in clear in the database"
    assert "ec1:" in copy

    run.refresh_from_db()
    assert (run.prompt, run.text) == (SECRET_PROMPT, SECRET_ANSWER)
    assert Dispatch.objects.get(device=device).request == {"segments": [SECRET_PROMPT]}
    assert (
        SavedPrompt.objects.get(name="notes").text == SECRET_SAVED
        and SECRET_MODULE in Schema.objects.get(name="finance").source
    )
    assert InferenceRun.objects.filter(error="").count() == 1  # "" stays "": filters on empty text keep working
    staff = django_user_model.objects.create_user("auditor", password="pw-auditor-123", is_staff=True)
    assert list(RunFilterForm({"q": "MERGER"}, user=staff).apply(InferenceRun.objects.all())) == [run]
    assert list(RunFilterForm({"q": "no such words"}, user=staff).apply(InferenceRun.objects.all())) == []

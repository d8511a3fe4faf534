"""The probes of a compromised board, replayed: each test holds what an attacker holds (a board's
Redis access, a copy of the database, a Redis dump) and checks that the attack is refused.

Probes that need the whole stack with ACL users live in tests/test_board_acl.py; this file holds the
ones a Django test reaches directly.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import pickle
import threading
import uuid
from pathlib import Path

import pytest
import redis
from channels.layers import channel_layers, get_channel_layer
from django.core.cache import caches

from .conftest import ROOT

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
    from dashboard.api import routing

    server, prefix = redis_cache
    marker = tmp_path / "pwned"
    # The attacker, holding a board's Redis access, overwrites the hint of a prompt_cache_key.
    name = caches["default"].make_key(routing._cache_name("default", "victim-key"))
    server.set(name, pickle.dumps(_Marker(marker)))
    assert routing._remembered("default", "victim-key") is None
    assert not marker.exists()
    # Hints written by the control plane itself still work (JSON).
    routing.remember("default", "victim-key", type("D", (), {"name": "pi5"})())
    assert routing._remembered("default", "victim-key") == "pi5"
    assert json.loads(server.get(name)) == "pi5"


@pytest.mark.cachebox
def test_rate_limit_counters_stay_numbers_the_server_can_count(redis_cache):
    from dashboard import ratelimit

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
    from inference.worker import celery_settings

    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Marker(marker))
    for alias, config in configured.CACHES.items():
        backend = import_string(config["BACKEND"])
        assert issubclass(backend, BaseCache)
        cache = backend(config.get("LOCATION", ""), {**config, "KEY_PREFIX": "probe", "OPTIONS": {**config.get("OPTIONS", {})}})
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
                if any(name.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle") for name in names) or (module or "").split(".")[0] in ("pickle", "dill"):
                    offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


# -- probe 7: the rate limit fails closed ----------------------------------------------------------------
def test_an_unreachable_cache_still_limits_in_this_process(settings, caplog):
    from dashboard import ratelimit

    settings.CACHES = {"default": {"BACKEND": "cachebox.django_cache.CacheBoxRedisCache", "LOCATION": "redis://127.0.0.1:1/0", "KEY_PREFIX": "t", "OPTIONS": {"socket_connect_timeout": 0.2}}}
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
    from dashboard import ratelimit

    settings.CACHES["default"]["OPTIONS"] = {**settings.CACHES["default"]["OPTIONS"], "max_connections": 4, "timeout": 0.05}
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
    from dashboard.api.keys import create_key
    from dashboard.models import Namespace

    Namespace.objects.get_or_create(name="default")
    _, key = create_key(None, "default")
    for body in ("[" * 100_000 + "]" * 100_000, '{"model": "m", "messages": ' + "[" * 40 + "]" * 40 + "}"):
        response = client.post("/v1/chat/completions", data=body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")
        assert response.status_code == 400, response.content[:200]
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "nests too deeply" in error["message"]


@pytest.mark.cachebox
def test_a_live_event_written_into_redis_by_someone_else_never_reaches_a_page(settings, valkey_url):
    from dashboard import settings as configured
    from dashboard.live import GROUP

    settings.CHANNEL_LAYERS = {"default": {**configured.CHANNEL_LAYERS["default"], "CONFIG": {**configured.CHANNEL_LAYERS["default"]["CONFIG"], "hosts": [valkey_url], "prefix": f"t{uuid.uuid4().hex[:8]}"}}}
    channel_layers.backends.clear()

    async def scenario():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(GROUP, channel)
        # The attacker writes a message of its own making where the layer keeps the channel's messages.
        from channels_redis.core import RedisChannelLayer

        forged = RedisChannelLayer(hosts=[valkey_url], prefix=layer.prefix)  # same server, no key
        await forged.group_send(GROUP, {"type": "live.event", "event": "device", "data": {"name": "zero", "revoked": True}, "device": "zero"})
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(layer.receive(channel), timeout=1.0)
        # What the server itself sends arrives.
        await layer.group_send(GROUP, {"type": "live.event", "event": "run", "data": {"device": "zero"}, "device": "zero"})
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
    response = staff.post(reverse("device-register"), {"name": "b-board", "namespace": tenant.name, "kind": "", "cpu_threads": 1, "memory_mb": 512, "link_preset": "none"})
    assert response.status_code == 200, response.content[:500]
    assert Device.objects.get(name="b-board").namespace_id == "tenant-b"


TRAVEL = '<schema name="{name}"><module name="city">Lisbon has trams.</module></schema>'


def test_a_namespaces_schema_is_neither_seen_nor_run_by_another_tenant(client, django_user_model):
    from django.urls import reverse

    from dashboard.forms import RunForm
    from dashboard.models import Device, Membership, Namespace
    from inference.models import Schema

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
    form = RunForm({"devices": [globex_device.pk], "source": "pml", "pml": '<prompt schema="acme-travel"><city/></prompt>', "max_tokens": 4}, user=bob)
    assert not form.is_valid() and "schema" in form.errors
    form = RunForm({"devices": [globex_device.pk], "source": "pml", "pml": '<prompt schema="shared-travel"><city/></prompt>', "max_tokens": 4}, user=bob)
    assert form.is_valid(), form.errors


def test_an_api_key_runs_only_its_namespaces_and_shared_schemas(client):
    from dashboard.api.keys import create_key
    from dashboard.models import Namespace
    from inference.models import Schema

    for name in ("acme", "globex"):
        Namespace.objects.create(name=name)
    schema = Schema(source=TRAVEL.format(name="acme-travel"), namespace="acme")
    schema.full_clean(), schema.save()
    _, key = create_key(None, "globex")
    body = {"model": "m", "messages": [], "edgecache": {"schema": "acme-travel", "pml": '<prompt schema="acme-travel"><city/></prompt>'}}
    response = client.post("/v1/chat/completions", data=json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 400 and "No schema named 'acme-travel'" in response.json()["error"]["message"]

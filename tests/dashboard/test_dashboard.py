"""Control plane: views, forms, the store-and-broadcast function, consumers, admin actions.

Real Valkey (device registry, cache box, channel layer); Celery's send_task is captured
so no board is needed (the end-to-end browser test runs real boards).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.layers import channel_layers, get_channel_layer
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.urls import reverse

from cachebox.entry import EntryHeader, encode_entry
from cachebox.keys import entry_key_name
from cachebox.signing import derive_keyring, shared_producer_ring
from cachebox.store import CacheBox
from dashboard import actions, admission, tasks
from dashboard.celery import app as celery_app
from dashboard.live.broadcast import GROUP
from dashboard.live.consumers import LiveConsumer
from dashboard.models import AuditEvent, CacheEntry, Device, Dispatch, InferenceRun
from dashboard.security.signing import control_plane_public_key, device_ring
from inference.board import devices as registry
from inference.board.identity import BoardKeys
from inference.contract import envelope
from inference.contract.envelope import CONTROL, Kind

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]


@pytest.fixture
def control_plane(settings, valkey_url):
    """Point the control plane at the test session's real Valkey (its bounded queues empty: each
    test counts its own runs under way, ``dashboard.admission``)."""
    settings.REDIS_URL = valkey_url
    settings.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [valkey_url]}}
    }
    channel_layers.backends.clear()
    store = CacheBox(valkey_url)
    _empty_queues(store)
    yield store
    _empty_queues(store)
    channel_layers.backends.clear()


def _empty_queues(store: CacheBox) -> None:
    names = list(store.redis.scan_iter(match="ec:q:*"))
    if names:
        store.redis.delete(*names)


@pytest.fixture
def sent_tasks(monkeypatch):
    """What the control plane sends to boards, opened as the board would open it (the envelope as
    sent is kept under "envelope")."""
    calls = []

    def capture(name, args=None, queue=None, **kwargs):
        json.dumps(args)  # messages must be plain JSON
        call = {"name": name, "args": args, "queue": queue, **kwargs}
        kind = {"edgecache.run_prompt": Kind.RUN, "edgecache.encode_schema": Kind.ENCODE}.get(name)
        if kind is not None:
            device = Device.objects.select_related("namespace").get(name=queue.removeprefix("device."))
            message, _ = envelope.open_envelope(
                args[0],
                kind=kind,
                to=device.name,
                signer_public_key=control_plane_public_key(),
                ring_for=lambda _ns: device_ring(device),
            )
            call.update(args=[message], envelope=args[0])
        calls.append(call)

    monkeypatch.setattr(celery_app, "send_task", capture)
    return calls


@pytest.fixture
def staff_client(client, django_user_model):
    user = django_user_model.objects.create_user("alice", password="pw-alice-123", is_staff=True)
    client.force_login(user)
    client.user = user
    return client


@pytest.fixture
def plain_client(client, django_user_model):
    user = django_user_model.objects.create_user("bob", password="pw-bob-123")
    client.force_login(user)
    return client


def register(name="zero", **fields):
    defaults = dict(
        kind="Raspberry Pi Zero 2W", cpu_threads=1, memory_mb=512, link_bandwidth_mbps=20.9, link_rtt_ms=4.0
    )
    return actions.register_device(None, name=name, **{**defaults, **fields})


def enrolled(device, token) -> BoardKeys:
    """The keys of a board that enrolled as ``device`` with ``token`` and pinned the control plane
    (as `manage.py edge` does)."""
    keys = BoardKeys.generate().pinned(control_plane_public_key())
    assert actions.enroll_device(keys.enrollment(device.name, token)) is not None
    return keys


def board_message(keys, device_name: str, kind: Kind, message: dict, *, sealed: bool = True) -> dict:
    """A message as ``device_name``'s board sends it: signed with ``keys``, sealed under its
    namespace's key (``sealed``; a device the database does not know seals with a key of its own)."""
    ring = None
    if sealed:
        device = Device.objects.select_related("namespace").filter(name=device_name).first()
        ring = (
            device_ring(device)
            if device is not None
            else derive_keyring(b"a key of its own, 32 bytes long!", "default", 1)
        )
    return envelope.seal(message, kind=kind, sender=device_name, to=CONTROL, signer=keys.signing, ring=ring)


def heartbeat(keys, status=None, device="zero"):
    return board_message(keys, device, Kind.HEARTBEAT, {"device": device, "status": status or {}}, sealed=False)


def result_payload(device, keys, *, dispatched=True, **overrides):
    """A run report of ``device``'s board, signed with its ``keys``, for a request dispatched to it."""
    payload = {
        "request_id": str(uuid.uuid4()),
        "device": device.name,
        "prompt": "Q: 2+2?\nA:",
        "text": " 4",
        "error": "",
        "meta": {"source": "text", "title": "Q: 2+2?", "expected_answer": ""},
        "breakdown": {
            "case": "partial",
            "ttft_ms": 120.0,
            "ttlt_ms": 150.0,
            "prompt_tokens": 300,
            "matched_tokens": 256,
            "prefill_ms": 90.0,
            "redis_ms": 20.0,
            "state_bytes": 5_000_000,
        },
        "uploaded": [
            {
                "name": f"ec:e:default:00ff00ff00ff00ff:{{{'ab' * 16}}}",
                "namespace": "default",
                "model": "00ff00ff00ff00ff",
                "start": 256,
                "end": 300,
                "bytes": 800_000,
            }
        ],
        "fetched": [],
    }
    payload.update(overrides)
    if dispatched:
        Dispatch.objects.get_or_create(
            request_id=payload["request_id"],
            defaults={"kind": "run", "device": device, "namespace": device.namespace_id},
        )
    return board_message(keys, device.name, Kind.REPORT, payload)


# -- access ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, args",
    [("home", []), ("devices", []), ("run", []), ("cache", []), ("device-detail", ["zero"]), ("device-register", [])],
)
def test_every_page_needs_a_login(client, name, args):
    response = client.get(reverse(name, args=args))
    assert response.status_code == 302 and "login" in response["Location"]


@pytest.mark.parametrize("name", ["device-register", "cache", "device-rotate", "device-revoke"])
def test_credentials_and_cache_pages_are_staff_only(plain_client, control_plane, name):
    register()
    args = [] if name in ("device-register", "cache") else ["zero"]
    response = plain_client.get(reverse(name, args=args))
    assert (
        response.status_code == 403 and b"For staff only" in response.content
    )  # said on a page of its own, not Django's admin login


def test_login_page_logs_in(client, django_user_model):
    django_user_model.objects.create_user("carol", password="pw-carol-123")
    response = client.post(reverse("login"), {"username": "carol", "password": "pw-carol-123"})
    assert response.status_code == 302 and response["Location"] == reverse("home")
    assert client.get(reverse("home")).status_code == 200


# -- devices --------------------------------------------------------------------------------------
def test_register_shows_the_token_once_and_keeps_only_its_hash(staff_client, control_plane):
    response = staff_client.post(
        reverse("device-register"),
        {"name": "zero", "kind": "Raspberry Pi Zero 2W", "cpu_threads": 1, "memory_mb": 512, "link_preset": "wifi4"},
        follow=True,  # posted, then redirected to the page that shows the token once
    )
    assert response.status_code == 200
    token = response.context["token"]
    assert token in response.content.decode() and "shown only once" in response.content.decode()
    assert response["Cache-Control"].startswith("max-age=0") or "no-cache" in response["Cache-Control"]
    device = Device.objects.get(name="zero")
    assert device.token_sha256 == registry.hash_token(token) and token not in json.dumps(
        list(Device.objects.values()), default=str
    )
    assert (device.link_bandwidth_mbps, device.link_rtt_ms) == (20.9, 4.0)
    record = registry.lookup(control_plane, "zero")  # what boards read: public data only
    assert (
        record.threads == 1
        and record.token_sha256 == registry.hash_token(token)
        and not record.signing_key
        and not record.keyring
    )
    assert token not in json.dumps(control_plane.get_device_record("zero").decode())
    assert token not in staff_client.get(device.get_absolute_url()).content.decode()
    assert AuditEvent.objects.filter(action="device.register", target="zero").exists()


@pytest.mark.parametrize(
    "data, field",
    [
        ({"name": "two words"}, "name"),
        ({"cpu_threads": 0}, "cpu_threads"),
        ({"link_preset": "custom", "link_bandwidth_mbps": -1}, "link_bandwidth_mbps"),
    ],
)
def test_register_form_errors_are_shown_inline(staff_client, control_plane, data, field):
    form = {"name": "zero", "kind": "", "cpu_threads": 1, "memory_mb": 512, "link_preset": "none", **data}
    response = staff_client.post(reverse("device-register"), form)
    assert response.status_code == 200 and field in response.context["form"].errors
    assert not Device.objects.exists()


def test_rotating_asks_first_then_the_old_board_and_token_stop_working(staff_client, control_plane):
    device, old = register()
    board = enrolled(device, old)
    page = staff_client.post(reverse("device-rotate", args=["zero"]), {})
    assert page.status_code == 200 and "Rotate the token" in page.content.decode()
    assert registry.authenticate(control_plane, "zero", board)  # unchanged until confirmed
    response = staff_client.post(reverse("device-rotate", args=["zero"]), {"confirm": "on"}, follow=True)
    new = response.context["token"]
    assert new != old
    with pytest.raises(registry.DeviceRefused, match="not enrolled"):
        registry.authenticate(control_plane, "zero", board)
    assert actions.record_run(result_payload(device, board)) is None  # the old board is refused
    with pytest.raises(registry.DeviceRefused, match="wrong or expired token"):
        registry.lookup(control_plane, "zero").check_token(old)
    assert actions.enroll_device(BoardKeys.generate().enrollment("zero", old)) is None  # a spent token enrolls no one
    replacement = enrolled(Device.objects.get(name="zero"), new)
    assert registry.authenticate(control_plane, "zero", replacement).keyring
    assert actions.record_run(result_payload(device, replacement)) is not None


def test_a_revoked_device_is_refused_by_boards_and_control_plane(staff_client, control_plane):
    device, token = register()
    board = enrolled(device, token)
    staff_client.post(reverse("device-revoke", args=["zero"]), {"confirm": "on"})
    with pytest.raises(registry.DeviceRefused, match="revoked"):
        registry.authenticate(control_plane, "zero", board)
    assert actions.record_run(result_payload(device, board)) is None
    assert actions.record_heartbeat(heartbeat(board)) is None
    assert not InferenceRun.objects.exists()


def test_unknown_devices_are_refused():
    assert (
        actions.record_run(
            board_message(
                BoardKeys.generate(), "ghost", Kind.REPORT, {"device": "ghost", "request_id": str(uuid.uuid4())}
            )
        )
        is None
    )


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"request_id": "r-1"}, "request_id"),
        ({"breakdown": {"case": "bogus"}}, "breakdown"),
        ({"breakdown": {"ttft_ms": "fast"}}, "ttft_ms"),
        (
            {"uploaded": [{"name": "ec:e:x", "namespace": "default", "model": "zz", "start": 5, "end": 1, "bytes": 1}]},
            "uploaded",
        ),
        ({"tokens": "not a list"}, "tokens"),
        ({"extra_field": 1}, "extra_field"),
    ],
)
def test_a_malformed_board_report_is_refused_logged_and_stores_nothing(control_plane, change, reason, caplog):
    """The control plane's worker validates what boards send: a bad report never crashes it or half-writes a run."""
    device, token = register()
    keys = enrolled(device, token)
    with caplog.at_level(logging.INFO, logger="edgecache.security"):
        assert (
            tasks.record_run.run(result_payload(device, keys, dispatched="request_id" not in change, **change)) is None
        )
    assert not InferenceRun.objects.exists() and not CacheEntry.objects.exists()
    refused = [
        record
        for record in caplog.records
        if record.name == "edgecache.security" and record.getMessage() == "message_refused"
    ]
    assert refused and reason in refused[-1].security_fields["reason"]
    assert actions.record_run(result_payload(device, keys)) is not None  # the next good report is stored


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"signature": None}, "not signed"),
        ({"from": "pi5"}, "unknown device"),
        ({"ts": 1.0}, "not signed"),
        ({"v": 0}, "not a signed"),
        ({"sealed": "AAAA"}, "not signed"),
    ],
)
def test_an_altered_or_unsigned_envelope_is_refused_logged_and_stores_nothing(control_plane, change, reason, caplog):
    device, token = register()
    keys = enrolled(device, token)
    with caplog.at_level(logging.INFO, logger="edgecache.security"):
        assert tasks.record_run.run({**result_payload(device, keys), **change}) is None
    assert not InferenceRun.objects.exists()
    refused = [
        record
        for record in caplog.records
        if record.name == "edgecache.security" and record.getMessage() == "board_message_refused"
    ]
    assert refused and reason in refused[-1].security_fields["reason"]


def test_device_pages_show_summaries_and_breakeven(staff_client, control_plane):
    device, token = register()
    keys = enrolled(device, token)
    for matched, prefill, redis_ms in [(0, 900.0, 0.0), (0, 450.0, 0.0), (300, 100.0, 25.0), (400, 0.0, 32.0)]:
        actions.record_run(
            result_payload(
                device,
                keys,
                breakdown={
                    "case": "full" if matched else "miss",
                    "prompt_tokens": 400 if matched != 0 or prefill > 500 else 200,
                    "matched_tokens": matched,
                    "prefill_ms": prefill,
                    "redis_ms": redis_ms,
                    "ttft_ms": prefill + redis_ms,
                },
            )
        )
    actions.record_heartbeat(
        heartbeat(keys, {"catalogs": {"default": {"approx_items": 12, "estimated_fp_rate": 1e-9, "last_sync": 1.7e9}}})
    )
    listing = staff_client.get(reverse("devices")).content.decode()
    assert "online" in listing and "zero" in listing
    detail = staff_client.get(device.get_absolute_url())
    assert detail.status_code == 200
    figure = staff_client.get(reverse("device-breakeven", args=["zero"])).json()
    assert "Break-even on 20.9 Mbit/s" in figure["layout"]["title"]["text"]
    names = [trace["name"] for trace in figure["data"]]
    assert "prefill (measured)" in names and any(name.startswith("link model") for name in names)
    overlapped = next(trace for trace in figure["data"] if trace["name"] == "compute the front while the back loads")
    together = "computing the front while the back loads"
    assert together in figure["verdict"] and together in detail.content.decode()  # under the chart, not in its title
    computing = next(trace for trace in figure["data"] if trace["name"].startswith("prefill fit"))
    assert overlapped["y"][-1] < computing["y"][-1]  # together beats computing alone on this slow link


# -- runs -----------------------------------------------------------------------------------------
def test_run_page_sends_json_messages_to_each_device_queue(staff_client, control_plane, sent_tasks):
    register("zero")
    register("pi5", cpu_threads=2)
    ids = list(Device.objects.values_list("pk", flat=True))
    response = staff_client.post(
        reverse("run"),
        {
            "devices": ids,
            "source": "mmlu",
            "topic": "astronomy",
            "shots": 2,
            "question": 3,
            "max_tokens": 4,
            "use_cache": "on",
        },
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 200
    dispatched = response.json()["dispatched"]
    assert {item["device"] for item in dispatched} == {"zero", "pi5"}
    assert sorted(call["queue"] for call in sent_tasks) == ["device.pi5", "device.zero"]
    message = sent_tasks[0]["args"][0]
    assert sent_tasks[0]["name"] == "edgecache.run_prompt"
    assert len(message["segments"]) == 4 and message["segments"][-1].endswith("Answer:")
    assert message["meta"]["expected_answer"] in "ABCD" and message["max_tokens"] == 4 and message["use_cache"] is True


def test_run_page_fails_closed_with_a_503_when_the_cache_box_cannot_count_runs(
    staff_client, control_plane, sent_tasks, settings
):
    """Admission counts runs under way in the cache box; when it does not answer, nothing is admitted
    uncounted (it used to let every run through): a 503 says so and nothing is sent."""
    register("zero")
    with socket.socket() as probe:  # a port nobody listens on: the cache box is down
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    settings.EDGECACHE_CACHEBOX_URL = f"redis://127.0.0.1:{dead}/0"
    device = Device.objects.get(name="zero")
    response = staff_client.post(
        reverse("run"),
        {"devices": [device.pk], "source": "text", "text": "hi", "max_tokens": 4},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 503, response.content
    error = response.json()["errors"]["__all__"][0]
    assert (
        error["code"] == "cachebox_unavailable"
        and "cache box is unreachable" in error["message"]
        and "Nothing was sent" in error["message"]
    )
    assert response["Retry-After"]
    assert sent_tasks == [] and not Dispatch.objects.exists()
    with pytest.raises(admission.CacheBoxUnreachable):
        admission.admit("default", str(uuid.uuid4()), online_boards=1, hold_s=5)
    settings.EDGECACHE_CACHEBOX_URL = ""  # the cache box answers again: the same run is admitted
    assert admission.admit("default", str(uuid.uuid4()), online_boards=1, hold_s=5).names


@pytest.mark.parametrize(
    "data, field",
    [
        ({"source": "text", "text": "   "}, "text"),
        ({"source": "mmlu", "topic": "astronomy", "shots": 5, "question": 100000}, "question"),
        ({"source": "saved"}, "saved_prompt"),
        ({"source": "text", "text": "hi", "namespace": "bad space"}, "namespace"),
    ],
)
def test_run_form_refuses_bad_input_with_a_message(staff_client, control_plane, sent_tasks, data, field):
    device, _ = register()
    response = staff_client.post(
        reverse("run"), {"devices": [device.pk], "max_tokens": 4, **data}, HTTP_ACCEPT="application/json"
    )
    assert response.status_code == 400 and field in response.json()["errors"]
    assert sent_tasks == []


def test_record_run_stores_once_mirrors_entries_and_broadcasts_once(control_plane, django_capture_on_commit_callbacks):
    device, token = register()
    keys = enrolled(device, token)
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(GROUP, channel)
    payload = result_payload(device, keys)
    with django_capture_on_commit_callbacks(execute=True):
        run = actions.record_run(payload)
    with django_capture_on_commit_callbacks(execute=True):
        again = actions.record_run(payload)  # a redelivered message
    assert run.pk == again.pk and InferenceRun.objects.count() == 1
    assert run.case == "partial" and run.ttft_ms == 120.0 and run.get_breakdown().matched_tokens == 256
    message = async_to_sync(layer.receive)(channel)
    assert message["event"] == "run" and message["data"]["request_id"] == str(run.request_id)
    entry = CacheEntry.objects.get()
    assert (entry.start, entry.end, entry.creator_device) == (256, 300, "zero")
    actions.record_run(result_payload(device, keys, fetched=[entry.key]))
    entry.refresh_from_db()
    assert entry.hits == 1 and entry.last_hit is not None


def test_heartbeat_marks_the_device_online(control_plane):
    device, token = register()
    keys = enrolled(device, token)
    assert not device.online
    actions.record_heartbeat(heartbeat(keys, {"catalogs": {}}))
    device.refresh_from_db()
    assert device.online and device.last_seen is not None


# -- live pages -----------------------------------------------------------------------------------
def test_socket_refuses_anonymous_users(control_plane):
    from django.contrib.auth.models import AnonymousUser

    async def scenario():
        communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
        communicator.scope["user"] = AnonymousUser()
        connected, code = await communicator.connect()
        return connected, code

    connected, code = async_to_sync(scenario)()
    assert not connected and code == 4401


def test_socket_delivers_stored_runs_to_logged_in_pages(control_plane, django_capture_on_commit_callbacks):
    device, token = register()
    keys = enrolled(device, token)
    user = get_user_model().objects.create_user("dave", password="pw-dave-123")
    from dashboard.models import Membership

    Membership.objects.create(user=user, namespace_id="default")  # not staff: sees the boards of his namespaces
    payload = result_payload(device, keys)

    async def scenario():
        from asgiref.sync import sync_to_async

        communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
        communicator.scope["user"] = user
        connected, _ = await communicator.connect()
        assert connected

        def store():
            with django_capture_on_commit_callbacks(execute=True):
                actions.record_run(payload)

        # Plain sync_to_async: it runs in the test's thread and transaction (database_sync_to_async would close it).
        await sync_to_async(store)()
        received = await communicator.receive_json_from(timeout=5)
        await communicator.disconnect()
        return received

    received = async_to_sync(scenario)()
    assert received["event"] == "run" and received["data"]["device"] == "zero"
    assert received["data"]["breakdown"]["ttft_ms"] == 120.0


def test_dashboard_renders_charts_with_run_points(staff_client, control_plane):
    device, token = register()
    keys = enrolled(device, token)
    actions.record_run(result_payload(device, keys))
    response = staff_client.get(reverse("home"))
    charts = response.context["chart_data"]
    assert [trace["name"] for trace in charts["breakdown"]["data"]] == [
        "Token",
        "Bloom",
        "P-decode",
        "Redis",
        "R-decode",
        "Sample",
        "other",
    ]
    assert charts["breakdown"]["data"][2]["y"] == [90.0]
    assert charts["breakdown"]["data"][-1]["y"] == [
        40.0
    ]  # TTLT 150 less P-decode 90 and Redis 20: the bar is the run's TTLT
    assert "chart-data" in response.content.decode()
    assert staff_client.get(reverse("plotly-js"))["Content-Type"] == "application/javascript"


# -- cache management -------------------------------------------------------------------------
def store_entry(store, namespace, start=0, end=64, device="zero"):
    state = os.urandom(2048)
    key = os.urandom(16)
    header = EntryHeader("00ff00ff00ff00ff", namespace, start, end, "d" * 32, 0, device=device)
    name = entry_key_name(namespace, "00ff00ff00ff00ff", key)
    store.put_entries(
        [(name, encode_entry(header, state, shared_producer_ring(derive_keyring(b"k" * 32, namespace, 1))))], ttl=3600
    )
    return name, key


def test_reconcile_rebuilds_the_mirror_and_the_master_catalog(control_plane, namespace):
    from cachebox.catalog import Catalog
    from dashboard.store.mirror import reconcile

    names = [store_entry(control_plane, namespace, 64 * i, 64 * (i + 1)) for i in range(3)]
    CacheEntry.objects.create(
        key=entry_key_name(namespace, "00ff00ff00ff00ff", b"\0" * 16),
        model="00ff00ff00ff00ff",
        namespace=namespace,
        start=0,
        end=1,
        bytes=1,
    )
    control_plane.redis.set(entry_key_name(namespace, "00ff00ff00ff00ff", b"\1" * 16), b"garbage")
    result = reconcile(control_plane)
    rows = CacheEntry.objects.filter(namespace=namespace)
    assert sorted(rows.values_list("key", flat=True)) == sorted(name for name, _ in names)
    assert result["removed_rows"] >= 1
    assert not control_plane.redis.exists(entry_key_name(namespace, "00ff00ff00ff00ff", b"\1" * 16))
    bloom, _, _ = control_plane.catalog_snapshot(namespace)
    assert all(key in Catalog.from_bytes(bloom) for _, key in names)


def test_admin_evict_asks_then_removes_from_store_and_mirror(staff_client, control_plane, namespace):
    from dashboard.store.mirror import reconcile

    names = [store_entry(control_plane, namespace, 0, 64)[0], store_entry(control_plane, namespace, 64, 128)[0]]
    reconcile(control_plane)
    staff_client.user.is_superuser = True
    staff_client.user.save()
    target = CacheEntry.objects.get(key=names[0])
    url = reverse("admin:dashboard_cacheentry_changelist")
    page = staff_client.post(url, {"action": "evict", "_selected_action": [target.pk]})
    assert page.status_code == 200 and "Evict 1 cache entries?" in page.content.decode()
    assert control_plane.redis.exists(names[0])
    done = staff_client.post(url, {"action": "evict", "_selected_action": [target.pk], "confirmed": "yes"})
    assert done.status_code == 302
    assert not control_plane.redis.exists(names[0]) and control_plane.redis.exists(names[1])
    assert not CacheEntry.objects.filter(key=names[0]).exists()
    assert AuditEvent.objects.filter(action="cache.evict").exists()


def test_admin_pin_and_unpin_change_the_entrys_ttl(staff_client, control_plane, namespace):
    from dashboard.store.mirror import reconcile

    name = store_entry(control_plane, namespace)[0]
    reconcile(control_plane)
    staff_client.user.is_superuser = True
    staff_client.user.save()
    entry = CacheEntry.objects.get(key=name)
    url = reverse("admin:dashboard_cacheentry_changelist")
    staff_client.post(url, {"action": "pin", "_selected_action": [entry.pk]})
    assert control_plane.redis.ttl(name) == -1 and CacheEntry.objects.get(key=name).pinned
    staff_client.post(url, {"action": "unpin", "_selected_action": [entry.pk], "confirmed": "yes"})
    assert control_plane.redis.ttl(name) > 0 and not CacheEntry.objects.get(key=name).pinned


def test_flush_needs_confirmation_and_a_scope(staff_client, control_plane, namespace):
    from dashboard.store.mirror import reconcile

    name = store_entry(control_plane, namespace)[0]
    reconcile(control_plane)
    staff_client.post(reverse("cache-flush"), {"namespace": namespace})  # not confirmed
    assert control_plane.redis.exists(name)
    staff_client.post(reverse("cache-flush"), {"confirm": "on"})  # no scope
    assert control_plane.redis.exists(name)
    staff_client.post(reverse("cache-flush"), {"namespace": namespace, "confirm": "on"})
    assert not control_plane.redis.exists(name) and not CacheEntry.objects.filter(namespace=namespace).exists()
    page = staff_client.get(reverse("cache")).content.decode()
    assert "cache.flush" in page


# -- schemas ------------------------------------------------------------------------------------
TRAVEL = (__import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "travel.pml").read_text()


def test_schema_errors_are_shown_inline_with_their_line(staff_client, control_plane):
    bad = TRAVEL.replace('<param name="duration" len="4"/>', '<param name="duration"/>')
    response = staff_client.post(reverse("schema-new"), {"source": bad})
    assert response.status_code == 200
    errors = " ".join(response.context["form"].errors["source"])
    assert "line 3" in errors and "len=" in errors
    from dashboard.models import Schema

    assert not Schema.objects.exists()


@pytest.mark.model
def test_schema_page_lists_modules_with_tokens_and_positions(staff_client, control_plane):
    response = staff_client.post(reverse("schema-new"), {"source": TRAVEL})
    from dashboard.models import Schema

    schema = Schema.objects.get()
    assert response.status_code == 302 and response["Location"] == schema.get_absolute_url()
    assert (schema.name, len(schema.digest)) == ("travel", 16)
    page = staff_client.get(schema.get_absolute_url())
    rows = {row["piece"]: row for row in page.context["rows"]}
    assert set(rows) == {"_text0", "trip-plan", "miami", "tokyo", "tokyo/kyoto", "scaffold:plan-miami"}
    assert rows["miami"]["start"] == rows["tokyo"]["start"] and rows["trip-plan"]["params"].startswith(
        "duration (len 4"
    )
    assert all(row["tokens"] > 0 for row in rows.values())
    duplicate = staff_client.post(reverse("schema-new"), {"source": TRAVEL})
    assert "exists already" in " ".join(duplicate.context["form"].errors["source"])


def test_encoding_is_sent_to_boards_and_its_result_mirrored(
    staff_client, control_plane, sent_tasks, django_capture_on_commit_callbacks
):
    from dashboard.models import Schema
    from inference.serving.pml import parse_schema

    device, token = register()
    board = enrolled(device, token)
    schema = Schema.objects.create(name="travel", source=TRAVEL, digest=parse_schema(TRAVEL).digest)
    response = staff_client.post(
        reverse("schema-encode", args=[schema.pk]), {"devices": [device.pk]}, HTTP_ACCEPT="application/json"
    )
    assert response.status_code == 200 and sent_tasks[0]["queue"] == "device.zero"
    message = sent_tasks[0]["args"][0]
    assert (
        sent_tasks[0]["name"] == "edgecache.encode_schema"
        and message["schema"] == TRAVEL
        and message["schema_id"] == schema.pk
    )
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(GROUP, channel)
    name = f"ec:m:default:00ff00ff00ff00ff:{schema.digest}:{{{'cd' * 16}}}"
    with django_capture_on_commit_callbacks(execute=True):  # pages hear of it once it commits
        actions.record_encoded(
            board_message(
                board,
                "zero",
                Kind.ENCODED,
                {
                    "device": "zero",
                    "request_id": message["request_id"],
                    "schema_id": schema.pk,
                    "stored": [
                        {
                            "name": name,
                            "namespace": "default",
                            "model": "00ff00ff00ff00ff",
                            "start": 0,
                            "end": 13,
                            "bytes": 1000,
                        }
                    ],
                    "skipped": [],
                },
            )
        )
    assert CacheEntry.objects.filter(key=name).exists()
    event = async_to_sync(layer.receive)(channel)
    assert event["event"] == "encode.done" and event["data"]["stored"] == 1


def test_deleting_a_schema_deletes_its_cache_entries(staff_client, control_plane):
    from dashboard.models import Schema
    from inference.serving.pml import parse_schema

    schema = Schema.objects.create(name="travel", source=TRAVEL, digest=parse_schema(TRAVEL).digest)
    mine = f"ec:m:default:00ff00ff00ff00ff:{schema.digest}:{{{'ab' * 16}}}"
    other = f"ec:m:default:00ff00ff00ff00ff:{'0' * 16}:{{{'ab' * 16}}}"
    control_plane.redis.set(mine, b"x")
    control_plane.redis.set(other, b"y")
    CacheEntry.objects.create(key=mine, model="00ff00ff00ff00ff", namespace="default", start=0, end=1, bytes=1)
    assert staff_client.post(reverse("schema-delete", args=[schema.pk]), {}).status_code == 200  # asks first
    assert Schema.objects.exists()
    staff_client.post(reverse("schema-delete", args=[schema.pk]), {"confirm": "on"})
    assert not Schema.objects.exists() and not control_plane.redis.exists(mine) and control_plane.redis.exists(other)
    assert not CacheEntry.objects.filter(key=mine).exists()
    control_plane.redis.delete(other)


def test_run_page_sends_pml_prompts_with_their_schema(staff_client, control_plane, sent_tasks):
    from dashboard.models import Schema
    from inference.serving.pml import parse_schema

    device, _ = register()
    schema = Schema.objects.create(name="travel", source=TRAVEL, digest=parse_schema(TRAVEL).digest)
    form = {"devices": [device.pk], "source": "pml", "schema": schema.pk, "max_tokens": 4}
    bad = staff_client.post(
        reverse("run"),
        {**form, "pml": '<prompt schema="travel"><miami/><tokyo/></prompt>'},
        HTTP_ACCEPT="application/json",
    )
    assert bad.status_code == 400 and "one union" in bad.json()["errors"]["pml"][0]["message"]
    good = staff_client.post(
        reverse("run"),
        {**form, "pml": '<prompt schema="travel"><miami/><user>Surf?</user></prompt>'},
        HTTP_ACCEPT="application/json",
    )
    assert good.status_code == 200
    message = sent_tasks[0]["args"][0]
    assert message["schema"] == TRAVEL and "<miami/>" in message["pml"] and message["segments"] == []


def test_benchmarks_page_lists_reports_and_serves_only_them(staff_client, settings, tmp_path):
    settings.BASE_DIR = tmp_path
    folder = tmp_path / "bench-results"
    folder.mkdir()
    (folder / "cases-1.json").write_text(
        json.dumps({"ttft_ratio_full_to_cold": 0.01, "greedy_agreement": 1.0, "n": 100, "machine": {"date": "today"}})
    )
    (folder / "cases-1.html").write_text("<!doctype html><p>chart</p>")
    (tmp_path / "secret.html").write_text("not a report")
    page = staff_client.get(reverse("benchmarks"))
    assert "full hit / cold TTFT 0.01" in page.content.decode()
    report = staff_client.get(reverse("benchmark-report", args=["cases-1"]))
    assert (
        report.status_code == 200
        and b"chart" in report.content
        and "default-src 'none'" in report["Content-Security-Policy"]
    )
    assert staff_client.get("/benchmarks/secret/").status_code == 404
    assert staff_client.get("/benchmarks/..%2Fsecret/").status_code == 404


def test_run_page_sends_a_lab_strategy_and_refuses_it_for_schema_prompts(staff_client, control_plane, sent_tasks):
    device, _ = register("lab-board")
    form = {"devices": [device.pk], "source": "mmlu", "topic": "astronomy", "shots": 1, "question": 1, "max_tokens": 4}
    response = staff_client.post(
        reverse("run"), {**form, "strategy": "kv-prediction:6"}, HTTP_ACCEPT="application/json"
    )
    assert response.status_code == 200 and sent_tasks[0]["args"][0]["strategy"] == "kv-prediction:6"
    exact = staff_client.post(reverse("run"), form, HTTP_ACCEPT="application/json")  # no choice: exact serving
    assert exact.status_code == 200 and sent_tasks[1]["args"][0]["strategy"] == ""
    pml = {
        **form,
        "source": "pml",
        "pml": '<prompt schema="travel"><user>Surf?</user></prompt>',
        "strategy": "kv-prediction:3",
    }
    refused = staff_client.post(reverse("run"), pml, HTTP_ACCEPT="application/json")
    assert refused.status_code == 400 and "exact strategy" in refused.json()["errors"]["strategy"][0]["message"]
    assert len(sent_tasks) == 2


def test_a_busy_database_delays_a_report_but_never_loses_it(monkeypatch):
    """'database is locked' (SQLite) or a restarting PostgreSQL: the record_run task retries."""
    from django.db import OperationalError

    from dashboard import tasks

    calls = []

    def flaky(payload):
        calls.append(payload)
        if len(calls) < 3:
            raise OperationalError("database is locked")

    monkeypatch.setattr(tasks.actions, "record_run", flaky)
    result = tasks.record_run.apply(args=[{"request_id": "r"}])
    assert result.successful() and len(calls) == 3


@pytest.mark.django_db
def test_every_model_change_has_its_migration():
    from django.core.management import call_command

    call_command("makemigrations", "--check", "--dry-run", verbosity=0)  # exits 1 when a migration is missing


def test_an_audit_verdict_counts_once_from_the_board_it_was_sent_to_and_staff_can_trust_a_board_again(
    staff_client, control_plane, settings
):
    """A mismatch quarantines the producer (the signed producer table lists it; its page says why);
    the same verdict from another board, or again, changes nothing; "Trust its entries again" lifts it."""
    from dashboard.models import EntryAudit

    settings.EDGECACHE_BOARD_ACL = False
    keys = {}
    for name in ("zero", "pi5", "liar"):
        device, token = register(name)
        keys[name] = enrolled(device, token)
    table = json.loads(control_plane.get_producer_table("default"))
    assert set(table["producers"]) == {"zero", "pi5", "liar"} and table["quarantined"] == {}
    entry = f"ec:e:default:00ff00ff00ff00ff:{{{'ab' * 16}}}"
    row = EntryAudit.objects.create(
        request_id=uuid.uuid4(),
        entry=entry,
        namespace="default",
        run_device="pi5",
        auditor=Device.objects.get(name="zero"),
    )
    verdict = {
        "request_id": str(row.request_id),
        "entry": entry,
        "verdict": "mismatch",
        "producer": "liar",
        "detail": "its state differs from the cold state",
    }

    def from_board(name):
        return board_message(keys[name], name, Kind.AUDITED, {"device": name, **verdict})

    assert actions.record_audit(from_board("pi5")) is None  # not sent to pi5
    assert Device.objects.get(name="liar").quarantined_at is None
    assert actions.record_audit(from_board("zero")) is not None
    assert actions.record_audit(from_board("zero")) is None  # delivered again: counted once
    liar = Device.objects.get(name="liar")
    assert liar.quarantined_at is not None and liar.audit_mismatches == 1
    table = json.loads(control_plane.get_producer_table("default"))
    assert "liar" not in table["producers"] and table["quarantined"]["liar"].endswith(
        "its state differs from the cold state"
    )
    assert registry.verify_document(table, control_plane_public_key())
    page = staff_client.get(reverse("device-detail", args=["liar"])).content.decode()
    assert "Entries quarantined since" in page and "its state differs from the cold state" in page
    staff_client.post(reverse("device-trust", args=["liar"]), {"confirm": "on"})
    table = json.loads(control_plane.get_producer_table("default"))
    assert "liar" in table["producers"] and table["quarantined"] == {}
    assert Device.objects.get(name="liar").quarantined_at is None

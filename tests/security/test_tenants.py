"""Namespaces (tenants) and signing keys, from the control plane to the boards.

Real Valkey for the device registry, the database for devices and namespaces, and the
real model for the isolation of boards' entries.
"""

from __future__ import annotations

import uuid

import pytest
from django.urls import reverse

from cachebox.signing import derive_key
from cachebox.store import CacheBox
from dashboard import actions
from dashboard.models import AuditEvent, Namespace
from inference import board as edge
from inference.board import devices as registry
from inference.board.devices import DeviceRefused
from inference.board.identity import BoardKeys
from inference.contract.messages import RunRequest
from tests.dashboard.test_dashboard import control_plane, register, sent_tasks, staff_client  # noqa: F401  (fixtures)


def become(name: str, token: str, url: str):
    """Start the board ``name`` in this process as `manage.py edge` does: fresh keys, enrolled with ``token``."""
    return edge.become(name, BoardKeys.generate(), CacheBox(url), token=token, send=actions.enroll_device, timeout=5)


pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]


@pytest.fixture(autouse=True)
def no_identity(monkeypatch):
    monkeypatch.setattr(edge.enrollment, "_identity", None)


def tenant(name: str, share: bool = True) -> Namespace:
    namespace = Namespace(name=name, share_across_devices=share)
    actions.save_namespace(None, namespace)
    return namespace


def test_an_enrolled_board_receives_its_namespace_keys_sealed(control_plane, settings, valkey_url):
    acme = tenant("acme")
    device, token = register("acme-1", namespace=acme)
    assert registry.lookup(CacheBox(valkey_url), "acme-1").keyring == ""  # nothing sealed before the board enrolls
    me = become("acme-1", token, valkey_url)
    raw = CacheBox(valkey_url).redis.get("ec:device:acme-1").decode()
    assert derive_key(settings.EDGECACHE_SIGNING_SECRET, "acme", 1).hex() not in raw  # never in clear in the cache box
    assert token not in raw
    record = registry.lookup(CacheBox(valkey_url), "acme-1")
    assert (record.namespace, record.share, record.cache_namespace) == ("acme", True, "acme")
    ring = record.open_keyring(me.keys)
    assert ring.namespace == "acme" and ring.current == 1 and ring.covers("acme") and not ring.covers("default")
    with pytest.raises(ValueError, match="cannot open"):
        record.open_keyring(BoardKeys.generate())  # another board's private key opens nothing


def test_rotation_reaches_boards_at_their_next_check_and_is_audited(control_plane, valkey_url):
    acme = tenant("acme")
    device, token = register("acme-1", namespace=acme)
    me = become("acme-1", token, valkey_url)
    assert me.ring.current == 1
    assert actions.rotate_signing_key(None, acme) == 2
    me.recheck()  # what every heartbeat does
    assert me.ring.current == 2 and sorted(me.ring.keys) == [1, 2]
    assert AuditEvent.objects.filter(action="namespace.rotate_key", target="acme").exists()


def test_a_revoked_board_is_refused_and_its_record_holds_no_keys(control_plane, valkey_url):
    device, token = register("zero")
    me = become("zero", token, valkey_url)
    actions.revoke_device(None, device)
    assert registry.lookup(CacheBox(valkey_url), "zero").keyring == ""
    with pytest.raises(DeviceRefused, match="revoked"):
        me.recheck()


def test_moving_a_device_to_another_namespace_stops_its_board(control_plane, valkey_url):
    device, token = register("zero")
    me = become("zero", token, valkey_url)
    device.namespace = tenant("acme")
    actions.update_device(None, device)
    with pytest.raises(DeviceRefused, match="restart the board"):
        me.recheck()


def test_a_board_refuses_messages_for_another_namespace(control_plane, valkey_url, sent_tasks):
    device, token = register("acme-1", namespace=tenant("acme"))
    become("acme-1", token, valkey_url)
    request = RunRequest.parse({"request_id": str(uuid.uuid4()), "segments": ["hello"], "namespace": "globex"})
    report = edge.serve(type("NoBoard", (), {"store": None})(), request)  # refused before the board is asked anything
    assert "does not serve 'globex'" in report.error
    # The control plane sends each device its own namespace.
    actions.dispatch_run(None, [device], actions.run_request(segments=["hello"], max_tokens=1, title="t"))
    assert sent_tasks[-1]["args"][0]["namespace"] == "acme"


def test_rotate_in_the_admin_asks_first(staff_client, control_plane):
    staff_client.user.is_superuser = True
    staff_client.user.save()
    acme = tenant("acme")
    url = reverse("admin:dashboard_namespace_changelist")
    asked = staff_client.post(url, {"action": "rotate_key", "_selected_action": [acme.pk]})
    assert asked.status_code == 200 and b"Yes, rotate" in asked.content
    acme.refresh_from_db()
    assert acme.key_generation == 1
    staff_client.post(url, {"action": "rotate_key", "_selected_action": [acme.pk], "confirmed": "yes"})
    acme.refresh_from_db()
    assert acme.key_generation == 2 and acme.key_rotated_at is not None


@pytest.mark.model
def test_boards_see_only_their_namespace_and_private_namespaces_share_nothing(control_plane, valkey_url, engine):
    """Tenants cannot read each other's entries; in a namespace that does not share, not even boards of one tenant."""
    from inference.board.config import BoardConfig
    from inference.board.runtime import Board

    clinic, acme = tenant("clinic", share=False), tenant("acme")
    boards = {}
    for name, namespace in (("ward-1", clinic), ("ward-2", clinic), ("acme-1", acme)):
        device, token = register(name, namespace=namespace)
        me = become(name, token, valkey_url)
        options = BoardConfig(device=name, namespace=me.record.cache_namespace)
        boards[name] = (Board(engine, CacheBox(valkey_url), options, background_sync=False, keys=me.keychain()), me)
    prompt = "Patient notes: chest pain for two days, no fever. Question: what should be checked first?"
    store = CacheBox(valkey_url)
    try:
        first = boards["ward-1"][0].run(prompt, max_tokens=2)
        assert first.breakdown.case == "miss" and first.breakdown.uploaded_bytes > 0
        assert {entry.namespace for entry in first.uploaded} == {"clinic.dev-ward-1"}
        for name in ("ward-2", "acme-1"):
            board, _ = boards[name]
            board.catalogs.sync_all()
            other = board.run(prompt, max_tokens=2)
            assert other.breakdown.case == "miss" and other.breakdown.decision == "catalog-miss", (
                name
            )  # no timing signal
            assert other.tokens == first.tokens
        # Keys do not cross tenants: acme's board has no ring for the clinic's entries.
        assert boards["acme-1"][1].keychain().ring("clinic.dev-ward-1") is None
        assert boards["ward-2"][1].keychain().ring("clinic.dev-ward-1") is None
        assert boards["ward-1"][0].run(prompt, max_tokens=2).breakdown.case == "full"
    finally:
        for namespace in ("clinic.dev-ward-1", "clinic.dev-ward-2", "acme"):
            store.flush(namespace)


def test_device_page_tells_its_namespace_and_key_generation(staff_client, control_plane):
    register("ward-1", namespace=tenant("clinic", share=False))
    page = staff_client.get(reverse("device-detail", args=["ward-1"])).content.decode()
    assert "clinic.dev-ward-1" in page and "signing key generation 1" in page
    assert "clinic" in staff_client.get(reverse("devices")).content.decode()


@pytest.mark.django_db(transaction=True, serialized_rollback=True)
def test_a_flushed_database_gets_its_default_namespace_back_where_devices_land_by_default():
    from django.core.management import call_command

    call_command("flush", interactive=False, verbosity=0)
    assert Namespace.objects.filter(name="default").exists()
    device, _ = actions.register_device(None, name="after-flush", cpu_threads=1)
    assert device.namespace_id == "default"

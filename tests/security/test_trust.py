"""Trust boundaries, each test replaying a probe that succeeded against the previous design:
what a reader of the broker, of Redis or of the database gets; a board answering for another;
a board steering a staff eviction onto a registry key; Redis errors that are not connection
failures; catalog bytes that claim absurd sizes; private namespaces that collided."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid

import pytest
import redis
from celery import current_app
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from cachebox import acl, embedded
from cachebox.catalog import DEFAULT_CAPACITY, DEFAULT_FP_RATE, Catalog, expected_filter_bytes, max_snapshot_bytes
from cachebox.errors import CatalogFormatError
from cachebox.keys import catalog_key_names, enrollment_refusal_key_name
from cachebox.signing import private_namespace, unseal
from cachebox.store import CacheBox
from cachebox.sync import CatalogReplica
from dashboard import actions
from dashboard.models import CacheEntry, Device, InferenceRun
from dashboard.security.signing import control_plane_public_key
from inference import board as edge
from inference.board import devices as registry
from inference.board.identity import BoardKeys, verify_signature
from inference.contract.envelope import Kind
from inference.contract.messages import RunReport, RunRequest, Task
from tests.dashboard.test_dashboard import (  # noqa: F401  (fixtures)
    board_message,
    control_plane,
    enrolled,
    register,
    result_payload,
    sent_tasks,
    staff_client,
)

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]


def security_events(caplog, name: str) -> list[dict]:
    return [
        record.security_fields
        for record in caplog.records
        if record.name == "edgecache.security" and record.getMessage() == name
    ]


# -- 1. no secret on the wire, in Redis or in the database ------------------------------------
def test_broker_messages_carry_no_token_and_are_signed_by_the_board(control_plane, valkey_url):
    device, token = register("dev-a")
    me = edge.become(
        "dev-a", BoardKeys.generate(), CacheBox(valkey_url), token=token, send=actions.enroll_device, timeout=5
    )
    client = redis.Redis.from_url(valkey_url)
    client.delete("ec:inbox:dev-a")
    current_app.conf.broker_url = valkey_url
    request_id = str(uuid.uuid4())
    edge.report(RunReport(device="dev-a", request_id=request_id, text="hello"))
    raw = client.lrange("ec:inbox:dev-a", 0, -1)  # the board's own inbox, the only list it may write
    assert len(raw) == 1 and token.encode() not in raw[0]  # what `LRANGE ec:inbox:dev-a` shows
    message = json.loads(raw[0])
    assert (
        set(message) == {"task", "body"} and message["task"] == Task.RECORD_RUN
    )  # names no Celery task: the inbox does
    payload = message["body"]
    assert "token" not in payload and "hello" not in json.dumps(payload)  # the answer is sealed
    assert (
        payload["from"] == "dev-a" and payload["kind"] == "report" and payload["sealed"] and payload["id"] == request_id
    )
    device.refresh_from_db()
    assert verify_signature(payload, device.signing_public_key)
    assert not verify_signature({**payload, "to": "somewhere"}, device.signing_public_key)
    assert me.keys.signing_public_key == device.signing_public_key
    report = actions.record_run(payload)  # the control plane opens it: no dispatch, so refused, but read
    assert report is None
    client.delete("ec:inbox:dev-a")


def test_a_redis_dump_or_a_database_dump_alone_opens_no_key_ring(control_plane, valkey_url):
    device, token = register("dev-a")
    board = enrolled(device, token)
    record = json.loads(CacheBox(valkey_url).get_device_record("dev-a"))
    assert (
        token not in json.dumps(record) and record["keyring"] and not record["token_sha256"]
    )  # spent: no longer published
    row = Device.objects.filter(name="dev-a").values().get()
    assert token not in json.dumps(row, default=str) and row["enroll_key"] == ""  # spent at enrollment
    # Everything 32-byte-like in the database row, tried as the key that opens the sealed ring: nothing opens it.
    for value in row.values():
        if isinstance(value, str) and len(value) == 64:
            with pytest.raises(ValueError, match="cannot open"):
                unseal(
                    record["keyring"],
                    X25519PrivateKey.from_private_bytes(bytes.fromhex(value)),
                    "dev-a",
                    control_plane_public_key(),
                )
    assert (
        unseal(record["keyring"], board.box, "dev-a", control_plane_public_key()).namespace == "default"
    )  # only the board's own key does


# -- 2. a board answers only for its own work ---------------------------------------------------
def test_a_board_cannot_answer_for_another_board(
    control_plane, sent_tasks, caplog
):  # the run is recorded as sent, not sent
    device_a, token_a = register("dev-a")
    device_b, token_b = register("dev-b")
    board_a, board_b = enrolled(device_a, token_a), enrolled(device_b, token_b)
    sent = actions.dispatch_run(
        None, [device_b], actions.run_request(segments=["Q: capital of France?"], max_tokens=2, title="probe")
    )
    request_id = sent[0]["request_id"]
    forged = board_message(
        board_a, "dev-a", Kind.REPORT, {"device": "dev-a", "request_id": request_id, "text": "FAKE ANSWER FROM A"}
    )
    with caplog.at_level(logging.INFO, logger="edgecache.security"):
        assert actions.record_run(forged) is None
        # Claiming to be dev-b does not help: the signature is dev-a's.
        assert (
            actions.record_run(
                board_message(
                    board_a,
                    "dev-b",
                    Kind.REPORT,
                    {"device": "dev-b", "request_id": request_id, "text": "FAKE ANSWER FROM A"},
                )
            )
            is None
        )
        assert (
            actions.record_run(
                board_message(
                    board_a,
                    "dev-a",
                    Kind.REPORT,
                    {"device": "dev-b", "request_id": request_id, "text": "FAKE ANSWER FROM A"},
                )
            )
            is None
        )
        # Nor does answering a request nobody dispatched.
        assert actions.record_run(result_payload(device_a, board_a, dispatched=False)) is None
    assert security_events(caplog, "report_refused") and security_events(caplog, "board_message_refused")
    real = actions.record_run(
        board_message(board_b, "dev-b", Kind.REPORT, {"device": "dev-b", "request_id": request_id, "text": " Paris"})
    )
    assert real is not None and InferenceRun.objects.get(request_id=request_id).text == " Paris"


# -- 3. a board cannot make staff delete a key that is not an entry -----------------------------
def test_fake_uploads_are_not_mirrored_and_staff_verbs_touch_only_entries(control_plane, caplog):
    device_a, token_a = register("dev-a")
    device_b, token_b = register("dev-b")
    board_a = enrolled(device_a, token_a)
    enrolled(device_b, token_b)
    fingerprint = "00ff00ff00ff00ff"
    real = f"ec:e:default:{fingerprint}:{{{'ab' * 16}}}"
    uploads = [
        {"name": "ec:device:dev-b", "namespace": "default", "model": fingerprint, "start": 0, "end": 5, "bytes": 10},
        {
            "name": f"ec:e:other-tenant:{fingerprint}:{{{'cd' * 16}}}",
            "namespace": "other-tenant",
            "model": fingerprint,
            "start": 0,
            "end": 5,
            "bytes": 10,
        },
        {"name": real, "namespace": "default", "model": fingerprint, "start": 0, "end": 5, "bytes": 10},
    ]
    with caplog.at_level(logging.INFO, logger="edgecache.security"):
        assert actions.record_run(result_payload(device_a, board_a, uploaded=uploads)) is not None
    assert list(CacheEntry.objects.values_list("key", flat=True)) == [real]
    assert len(security_events(caplog, "mirror_refused")) == 2
    # Even a mirror row that names a registry key (written by hand) cannot be evicted.
    CacheEntry.objects.create(key="ec:device:dev-b", model=fingerprint, namespace="default", start=0, end=5, bytes=10)
    actions.evict_entries(None, CacheEntry.objects.filter(key="ec:device:dev-b"))
    assert control_plane.get_device_record("dev-b") is not None


# -- 5. catalog bytes that claim absurd sizes ----------------------------------------------------
@pytest.mark.parametrize("capacity, fp_rate", [(10**11, 0.01), (10**12, 0.01), (1000, 1e-300), (-5, 0.01)])
def test_catalog_bytes_with_absurd_sizes_are_refused_before_allocating(capacity, fp_rate):
    good = Catalog(1000, 0.01).to_bytes()
    body = good[8 + int.from_bytes(good[4:8], "little") :]
    params = json.dumps({"capacity": capacity, "fp_rate": fp_rate}).encode()
    forged = b"ECB1" + len(params).to_bytes(4, "little") + params + body
    with pytest.raises(CatalogFormatError):
        Catalog.from_bytes(forged)  # once aborted the process: "memory allocation of 119813229717 bytes failed"


def test_a_board_refuses_a_forged_master_snapshot_logs_it_and_drops_it(valkey_url, caplog):
    store = CacheBox(valkey_url)
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    replica = CatalogReplica(store, namespace)
    replica.sync()
    params = json.dumps({"capacity": 10**11, "fp_rate": 0.01}).encode()
    store.redis.hset(
        catalog_key_names(namespace)["snapshot"],
        mapping={
            "bloom": b"ECB1" + len(params).to_bytes(4, "little") + params + b"\0" * 64,
            "last_id": "0",
            "epoch": replica.epoch,
        },
    )
    with caplog.at_level(logging.INFO, logger="edgecache.security"):
        CatalogReplica(store, namespace).sync()  # a fresh board meets it
    assert security_events(caplog, "catalog_refused")
    assert not store.redis.exists(catalog_key_names(namespace)["snapshot"])
    store.flush(namespace)


def _board_store(store: CacheBox, url: str, name: str, namespace: str) -> CacheBox:
    """The cache box as board ``name`` reaches it: its own ACL user (``cachebox.acl.board_rules``)."""
    password = uuid.uuid4().hex
    store.set_user(
        acl.board_user(name), acl.board_rules(name, namespace, hashlib.sha256(password.encode()).hexdigest())
    )
    return CacheBox(acl.with_credentials(url, acl.board_user(name), password))


def _planted_snapshot(capacity: int, fp_rate: float = 0.01) -> bytes:
    """A master snapshot of a valid format (sizes that agree) for a catalog of ``capacity`` keys."""
    params = json.dumps({"capacity": capacity, "fp_rate": fp_rate}).encode()
    return b"ECB1" + len(params).to_bytes(4, "little") + params + b"\0" * expected_filter_bytes(capacity, fp_rate)


def _bytes_sent(store: CacheBox) -> int:
    return int(store.redis.info("stats")["total_net_output_bytes"])


def test_a_board_refuses_an_oversized_master_snapshot_without_fetching_it(valkey_url, caplog):
    """The probe's snapshot bomb: a board of the namespace plants a snapshot of a valid format but 30x
    the namespace's configured size (36 MB; the probe's 102 MB took boards from 480 to 850 MB). A
    board reading the master copy checks its size first (HSTRLEN) and fetches none of it."""
    store = CacheBox(valkey_url)
    namespace, board = f"t-{uuid.uuid4().hex[:10]}", f"b-{uuid.uuid4().hex[:8]}"
    mallory = _board_store(store, valkey_url, board, namespace)
    try:
        CatalogReplica(mallory, namespace).sync()  # the namespace's epoch exists
        epoch = store.redis.get(catalog_key_names(namespace)["epoch"]).decode()
        planted = _planted_snapshot(30_000_000)
        assert len(planted) > 25 * max_snapshot_bytes(DEFAULT_CAPACITY, DEFAULT_FP_RATE)
        mallory.redis.hset(
            catalog_key_names(namespace)["snapshot"], mapping={"bloom": planted, "last_id": "0", "epoch": epoch}
        )  # its ACL allows it
        before = _bytes_sent(store)
        with caplog.at_level(logging.INFO, logger="edgecache.security"):
            fresh = CatalogReplica(_board_store(store, valkey_url, board, namespace), namespace)
            fresh.sync()  # a board (re)starting meets it
        sent = _bytes_sent(store) - before
        assert sent < max_snapshot_bytes(DEFAULT_CAPACITY, DEFAULT_FP_RATE), (
            f"the board fetched {sent} bytes of a {len(planted)}-byte snapshot"
        )
        refusal = security_events(caplog, "catalog_refused")
        assert refusal and "not fetched" in refusal[0]["reason"], refusal
        assert not store.redis.exists(
            catalog_key_names(namespace)["snapshot"]
        )  # dropped: no other board or page meets it

        # A snapshot of the namespace's own size is still read, through the board's own ACL user.
        writer = CatalogReplica(mallory, namespace)
        writer.sync()
        writer.announce([b"k" * 16])
        writer.sync()
        assert mallory.catalog_put_snapshot(namespace, writer.catalog.to_bytes(), writer.last_id, writer.epoch)
        newcomer = CatalogReplica(mallory, namespace)
        newcomer.sync()
        assert b"k" * 16 in newcomer.catalog and newcomer.last_id == writer.last_id
    finally:
        store.delete_user(acl.board_user(board))
        store.flush(namespace)


def test_the_cache_page_never_fetches_an_oversized_master_snapshot(staff_client, control_plane, settings):
    """Each staff view of /cache/ loaded the planted snapshot (the probe: web process 337 -> 621 MB);
    now its size is read first and the page says it was refused, unread."""
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    store = control_plane
    settings.EDGECACHE_NAMESPACE = namespace  # the page lists this namespace's master catalog
    epoch = store.catalog_epoch(namespace, uuid.uuid4().hex)
    planted = _planted_snapshot(30_000_000)
    store.redis.hset(
        catalog_key_names(namespace)["snapshot"], mapping={"bloom": planted, "last_id": "0", "epoch": epoch}
    )
    try:
        before = _bytes_sent(store)
        page = staff_client.get("/cache/")
        sent = _bytes_sent(store) - before
        assert page.status_code == 200
        assert sent < 2 * max_snapshot_bytes(DEFAULT_CAPACITY, DEFAULT_FP_RATE), (
            f"the page fetched {sent} bytes of a {len(planted)}-byte snapshot"
        )
        assert "snapshot refused (not read)" in page.content.decode()
    finally:
        store.flush(namespace)


# -- 5b. forged enrollments ------------------------------------------------------------------------
def test_a_forged_enrollment_for_an_enrolled_device_changes_no_record(control_plane, valkey_url, caplog):
    """The probe: a forged enrollment for an enrolled device made the control plane re-sign and
    publish the device's record with the attacker's signing key in it. Now the record a real board
    reads stays byte for byte as it was; why it was refused goes to a short-lived note keyed by the
    request's key, which only that device's enrollment user may read."""
    device, token = register("dev-a")
    board = enrolled(device, token)
    before = control_plane.get_device_record("dev-a")
    attacker = BoardKeys.generate().pinned(control_plane_public_key())
    with caplog.at_level(logging.INFO, logger="edgecache.security"):
        assert actions.enroll_device(attacker.enrollment("dev-a", "guessed-token")) is None
    assert security_events(caplog, "enrollment_refused")
    after = control_plane.get_device_record("dev-a")
    assert after == before, "the device's record was re-published"
    assert attacker.signing_public_key.encode() not in after
    assert (
        registry.authenticate(control_plane, "dev-a", board).signing_key == board.signing_public_key
    )  # the real board carries on

    # The note: signed by the control plane, for that key only, expiring; readable by the enrollment user and nobody else's.
    note_key = enrollment_refusal_key_name("dev-a", attacker.signing_public_key)
    assert 0 < control_plane.redis.ttl(note_key) <= registry.ENROLLMENT_REFUSAL_TTL_S
    password = uuid.uuid4().hex
    control_plane.set_user(
        acl.enroll_user("dev-a"), acl.enroll_rules("dev-a", hashlib.sha256(password.encode()).hexdigest())
    )
    control_plane.set_user(
        acl.enroll_user("dev-b"), acl.enroll_rules("dev-b", hashlib.sha256(password.encode()).hexdigest())
    )
    try:
        as_enroller = CacheBox(acl.with_credentials(valkey_url, acl.enroll_user("dev-a"), password))
        assert "already used to enroll" in registry.enrollment_refused(as_enroller, "dev-a", attacker)
        assert registry.enrollment_refused(as_enroller, "dev-a", board) is None  # nothing said about another key
        other = redis.Redis.from_url(acl.with_credentials(valkey_url, acl.enroll_user("dev-b"), password))
        with pytest.raises(redis.exceptions.NoPermissionError):
            other.get(note_key)
        # A note not signed by the pinned control plane says nothing.
        control_plane.set_flag(
            note_key,
            60,
            json.dumps({"name": "dev-a", "signing_key": attacker.signing_public_key, "reason": "forged"}).encode(),
        )
        assert registry.enrollment_refused(as_enroller, "dev-a", attacker) is None
    finally:
        control_plane.delete_user(acl.enroll_user("dev-a"))
        control_plane.delete_user(acl.enroll_user("dev-b"))
        control_plane.delete([note_key])


def test_enrollment_attempts_are_rate_limited_per_device(control_plane, settings, caplog):
    settings.EDGECACHE_ENROLL_RATE = 3
    device, token = register("dev-a")
    other, other_token = register("dev-b")
    with caplog.at_level(logging.INFO, logger="edgecache.security"):
        for _ in range(6):
            assert actions.enroll_device(BoardKeys.generate().enrollment("dev-a", "guessed-token")) is None
    reasons = [event["reason"] for event in security_events(caplog, "enrollment_refused")]
    assert reasons[:3] == ["wrong token"] * 3
    assert len(reasons) == 6 and all("over 3 enrollment attempts this minute" in reason for reason in reasons[3:])
    notes = list(control_plane.redis.scan_iter(match="ec:enroll-refused:dev-a:*"))
    assert len(notes) == 3  # nothing was looked at, or written, past the limit
    # Another device is not affected; this one's own board waits for the next minute.
    assert actions.enroll_device(BoardKeys.generate().enrollment("dev-b", other_token)) is not None
    assert actions.enroll_device(BoardKeys.generate().enrollment("dev-a", token)) is None
    control_plane.delete(notes)


# -- 6. private namespaces cannot collide ----------------------------------------------------------
def test_private_namespaces_of_long_similar_names_differ():
    a, b = "kiosk-" + "x" * 34 + "-1", "kiosk-" + "x" * 34 + "-2"
    assert private_namespace("hospital-north-wing-12", a) != private_namespace("hospital-north-wing-12", b)
    for name in (private_namespace("hospital-north-wing-12", a), private_namespace("t", "b")):
        assert len(name) <= 64
    assert private_namespace("t", "b") == "t.dev-b"  # short ones stay readable


def test_the_board_task_sends_its_report_signed_and_sealed_onto_its_own_inbox(monkeypatch):
    """The task path: ``report`` signs with the board's key whatever message it is given, seals it,
    and pushes it onto the board's own inbox (no Celery task, no queue of the control plane's)."""
    from inference.board import outbox
    from tests.inference.test_edge import board_identity

    me = board_identity("dev-a")
    monkeypatch.setattr(edge.enrollment, "_identity", me)
    pushed = []

    class Client:
        def lpush(self, key, raw):
            pushed.append((key, json.loads(raw)))

    monkeypatch.setattr(outbox, "write_to_broker", lambda command, **_: command(Client()))
    edge.report(RunReport(device="dev-a", request_id=str(uuid.uuid4()), text="the answer"))
    [(key, message)] = pushed
    assert key == "ec:inbox:dev-a" and message["task"] == Task.RECORD_RUN
    assert verify_signature(message["body"], me.keys.signing_public_key) and "the answer" not in json.dumps(message)


# -- 4. any cache-box error degrades to local work; the answer always reaches the control plane --
@pytest.fixture
def small_valkey(tmp_path):
    data_dir = tmp_path / "valkey"
    url = embedded.ensure_running(data_dir, maxmemory="4mb")
    yield url
    embedded.stop(data_dir)


PROMPT = "".join(f"Line {i}: the tide comes in and the tide goes out. " for i in range(40))


@pytest.mark.model
def test_a_full_cache_box_refusing_writes_loses_no_answer(small_valkey, make_board):
    """Valkey at maxmemory with entries it may not evict (no TTL): SET answers OOM after the answer is computed."""
    board = make_board(small_valkey, "oom", entry_ttl=None)
    request = RunRequest.parse(
        {"request_id": str(uuid.uuid4()), "segments": [PROMPT], "max_tokens": 4, "namespace": "oom"}
    )
    report = edge.serve(board, request)  # raised OutOfMemoryError before: no report, the run lost
    assert report.error == "" and report.text and report.breakdown.cachebox == "unavailable"
    assert report.uploaded == [] and report.breakdown.uploaded_bytes == 0
    cold = board.run(PROMPT, max_tokens=4, namespace="oom", use_cache=False)
    assert report.tokens == cold.tokens


@pytest.mark.model
def test_a_key_of_the_wrong_type_is_a_miss_not_a_lost_run(valkey_url, namespace, make_board):
    first = make_board(valkey_url, namespace, device="dev-a")
    cold = first.run(PROMPT, max_tokens=4, namespace=namespace)
    store = CacheBox(valkey_url)
    for name in store.scan_entries(namespace):
        store.redis.delete(name)
        store.redis.rpush(name, "not an entry")  # WRONGTYPE for GETRANGE/GET
    second = make_board(valkey_url, namespace, device="dev-b")
    second.catalogs.sync_all()
    request = RunRequest.parse(
        {"request_id": str(uuid.uuid4()), "segments": [PROMPT], "max_tokens": 4, "namespace": namespace}
    )
    report = edge.serve(second, request)
    assert report.error == "" and report.tokens == cold.tokens
    assert report.breakdown.cachebox == "unavailable" and report.breakdown.decision == "cachebox-unavailable"


@pytest.mark.model
def test_an_entry_over_one_boards_limit_is_skipped_there_not_evicted_for_everyone(valkey_url, namespace, make_board):
    big = make_board(valkey_url, namespace, device="dev-a")
    big.run(PROMPT, max_tokens=2, namespace=namespace)
    stored = sorted(CacheBox(valkey_url).scan_entries(namespace))
    small = make_board(valkey_url, namespace, device="dev-b", max_entry_bytes=100_000)
    small.catalogs.sync_all()
    result = small.run(PROMPT, max_tokens=2, namespace=namespace, upload=False)
    assert result.breakdown.case == "miss" and result.breakdown.rejected_entries == 0
    assert sorted(CacheBox(valkey_url).scan_entries(namespace)) == stored  # still there for boards that take it
    assert big.run(PROMPT, max_tokens=2, namespace=namespace).breakdown.case == "full"


@pytest.mark.model
def test_a_schema_whose_layout_cannot_fit_the_context_is_refused_with_the_numbers(settings):
    from django.core.exceptions import ValidationError

    from dashboard.models import Schema

    settings.EDGECACHE_N_CTX = 2048
    modules = "".join(f'<module name="m{i}">{"Tide and wind and salt. " * 60}</module>' for i in range(12))
    with pytest.raises(ValidationError, match=r"spans \d+ positions, but the model's context holds 2048"):
        Schema(source=f'<schema name="huge">{modules}</schema>').full_clean()
    Schema(source='<schema name="small"><module name="a">Tide and wind.</module></schema>').full_clean()

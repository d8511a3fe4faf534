"""Lying boards caught: the probe of a namespace member that re-seals another prompt's state, on real
parts (a Valkey whose boards log in as their own ACL users, the control plane's verbs, the real
model on boards built like ``make_board``'s).

Tenant ``acme`` has four enrolled boards: ``honest`` computes prompts X and Y, ``liar`` holds the
namespace's ring (its key file and its registry record) and writes with its own Valkey user,
``victim`` answers X from the cache box, ``auditor`` recomputes what the control plane samples.

- The liar keeps X's honest header (and its producer's signature) and re-seals Y's state behind it:
  refused at read, the victim answers X cold (on main: a full hit that answers Y's continuation).
- The liar signs the forgery as itself: it is served until audited; the audit (another board,
  same model, cold, bit for bit) names the liar, deletes the entry, quarantines every entry of the
  liar (the producer table), counts it in /metrics and marks the device; the victim then refuses
  the liar's next entry.
"""

from __future__ import annotations

import uuid

import pytest
import redis

from cachebox import acl, embedded
from cachebox.entry import SEAL_OVERHEAD, EntryHeader, decode_header, encode_entry, open_entry
from cachebox.keys import range_boundaries
from cachebox.store import CacheBox
from inference.board import devices as registry
from inference.board.enrollment import EdgeIdentity
from inference.contract.envelope import Kind
from inference.contract.messages import RunReport, RunRequest
from inference.serving.exchange import prefix_refs

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox, pytest.mark.model]

PASSWORD = "the-control-planes-own-password"
TENANT = "acme"
X_TEXT = "The old ship left the harbour at dawn, and high above the grey water the gulls"
Y_WORDS = (
    "In the morning the baker opened his shop on the corner of the square and the smell of fresh bread "
    "drifted across the street where the children waited for the school bus to arrive"
).split()
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A Valkey whose default user needs the control plane's password: boards log in as their own users."""
    data_dir = tmp_path_factory.mktemp("guarded-liars")
    port = embedded._low_free_ports(1)[0]
    url = embedded.ensure_running(data_dir, port=port, maxmemory="256mb", password=PASSWORD)
    yield url, port
    embedded.stop(data_dir, port, password=PASSWORD)


@pytest.fixture
def fleet(settings, guarded, monkeypatch, make_board):
    """The control plane on the guarded Valkey and four enrolled boards of ``acme``, each reaching it
    as its own ACL user, with the keys it enrolled and the ring and records it was sent."""
    from dashboard import actions
    from dashboard.celery import app as celery_app
    from dashboard.models import Namespace
    from tests.dashboard.test_dashboard import enrolled

    url, port = guarded
    settings.REDIS_URL = url
    settings.EDGECACHE_CACHEBOX_URL = ""
    settings.EDGECACHE_BOARD_ACL = True
    monkeypatch.setattr("dashboard.actions.identities.declare_queue", lambda device: None)  # no broker here
    sent = []
    monkeypatch.setattr(
        celery_app,
        "send_task",
        lambda name, args=None, queue=None, **kwargs: sent.append({"name": name, "args": args, "queue": queue}),
    )
    Namespace.objects.get_or_create(name=TENANT)
    boards = {}
    for name in ("honest", "liar", "victim", "auditor"):
        device, token = actions.register_device(None, name=name, cpu_threads=1, namespace_id=TENANT)
        keys = enrolled(device, token)
        board_url = acl.with_credentials(url, acl.board_user(name), keys.redis_password)
        store = CacheBox(board_url)
        me = EdgeIdentity(name, keys, registry.authenticate(store, name, keys), store)
        me.recheck()  # its ring (and the tenant's producers), as a board takes them at a heartbeat
        board = make_board(board_url, TENANT, device=name, keys=me.keychain(), codec="raw")
        boards[name] = {"me": me, "board": board, "store": store, "device": device}
    yield {"url": url, "port": port, "boards": boards, "sent": sent}
    admin = redis.Redis(port=port, username="default", password=PASSWORD)
    for user in admin.execute_command("ACL", "USERS"):
        if user.decode().startswith((acl.BOARD_USER_PREFIX, acl.ENROLL_USER_PREFIX)):
            admin.execute_command("ACL", "DELUSER", user)
    admin.flushall()


def tokens_of(board, text: str) -> list[int]:
    return board.prefix.layout([text])[0]


def y_text_as_long_as(board, x_tokens: int) -> str:
    """Prompt Y: another story cut to X's token count (so its state fits X's range)."""
    for count in range(1, len(Y_WORDS) + 1):
        text = " ".join(Y_WORDS[:count])
        if len(tokens_of(board, text)) == x_tokens:
            return text
    raise AssertionError(f"no prefix of Y has {x_tokens} tokens")


def full_entry_name(board, text: str) -> str:
    """The name of the entry that holds the whole prompt (a full hit reads it)."""
    tokens, cuts = board.prefix.layout([text])
    boundaries = range_boundaries(len(tokens), board.config.chunk_tokens, cuts)
    refs = prefix_refs(TENANT, board.engine.fingerprint, tokens, boundaries, grid=board.config.chunk_tokens, extra=cuts)
    return refs[-1].name


def computed_by_honest(fleet):
    """Honest computes X and Y cold (their entries are stored, signed by it); returns X's cold answer,
    Y's text and the two full entries' names."""
    honest = fleet["boards"]["honest"]["board"]
    x_tokens = tokens_of(honest, X_TEXT)
    assert len(x_tokens) < honest.config.chunk_tokens  # one range: the full entry is the whole prompt
    y_text = y_text_as_long_as(honest, len(x_tokens))
    cold_x = honest.run([X_TEXT], max_tokens=MAX_TOKENS)
    cold_y = honest.run([y_text], max_tokens=MAX_TOKENS)
    assert cold_x.breakdown.case == "miss" and cold_x.tokens != cold_y.tokens
    return cold_x, y_text, full_entry_name(honest, X_TEXT), full_entry_name(honest, y_text)


def victim_answers_x(fleet):
    victim = fleet["boards"]["victim"]
    victim["me"].recheck()  # its heartbeat: the registry record and the producer table
    victim["board"].catalogs.sync_all()
    return victim["board"].run([X_TEXT], max_tokens=MAX_TOKENS)


def test_a_state_resealed_behind_an_honest_header_is_refused_at_read(fleet):
    """The liar keeps X's header as stored (honest's, with honest's signature) and seals Y's state
    behind it with the namespace's data key: every key check passes, but the state is not the one
    honest signed. The victim refuses and evicts it and answers X cold.
    On main: served as a full hit with Y's state (the answer is not X's)."""
    cold_x, y_text, x_name, y_name = computed_by_honest(fleet)
    liar = fleet["boards"]["liar"]
    ring = liar["board"].keys.ring(TENANT)
    x_blob, y_blob = liar["store"].read_entries([x_name, y_name])
    _, y_state = open_entry(y_blob, ring, 1 << 30)
    header, offset = decode_header(x_blob)
    assert len(y_state) + SEAL_OVERHEAD == header.state_bytes  # the same size: it fits behind X's header
    sealed = bytearray(header.state_bytes)
    ring.seal_into(y_state, header.signed_bytes, memoryview(sealed), cipher=header.cipher)
    liar["store"].put_entries([(x_name, x_blob[:offset] + bytes(sealed))], ttl=3600)  # as its own Valkey user

    answer = victim_answers_x(fleet)

    assert answer.tokens == cold_x.tokens, f"the victim answered X with another prompt's continuation: {answer.text!r}"
    assert answer.breakdown.case == "miss" and answer.breakdown.rejected_entries == 1


def test_a_liar_signing_its_forgery_is_named_by_the_audit_and_quarantined(fleet, settings, client, django_user_model):
    """The probe as the liar can best do it now: Y's state and top logits under X's range and tokens
    digest, signed as itself. The victim serves it (a full hit: nothing refuses a member's signed
    entry before an audit); the control plane samples the hit, the auditor recomputes X cold and
    compares bit for bit: the liar is named, the entry deleted, every entry of the liar quarantined
    (the victim refuses the next one), the mismatch counted in /metrics and shown on the device page."""
    from django.utils import timezone

    from dashboard import actions
    from dashboard.models import Device, Dispatch, EntryAudit
    from inference.contract.messages import AuditReport, AuditRequest
    from inference.serving.audit import audit_entry

    settings.EDGECACHE_AUDIT_RATE = 1.0
    cold_x, y_text, x_name, y_name = computed_by_honest(fleet)
    boards = fleet["boards"]
    liar = boards["liar"]
    ring = liar["board"].keys.ring(TENANT)
    (hx, _), (hy, y_state) = (open_entry(blob, ring, 1 << 30) for blob in liar["store"].read_entries([x_name, y_name]))
    forged = EntryHeader(
        fingerprint=hx.fingerprint,
        namespace=hx.namespace,
        start=hx.start,
        end=hx.end,
        tokens_digest=hx.tokens_digest,
        state_bytes=0,
        device=hx.device,
        top_ids=hy.top_ids,
        top_logits=hy.top_logits,
    )
    forgery = encode_entry(forged, y_state, ring)
    liar["store"].put_entries([(x_name, forgery)], ttl=3600)

    served = victim_answers_x(fleet)
    assert served.breakdown.case == "full" and served.tokens != cold_x.tokens  # the lie, before an audit

    # The victim's report reaches the control plane; the hit is sampled for an audit.
    victim, auditor = boards["victim"], boards["auditor"]
    Device.objects.filter(name="auditor").update(
        last_seen=timezone.now(), status={"fingerprint": auditor["board"].engine.fingerprint, "heartbeat_s": 5}
    )
    request = RunRequest(request_id=str(uuid.uuid4()), segments=[X_TEXT], max_tokens=MAX_TOKENS, namespace=TENANT)
    Dispatch.objects.create(
        request_id=request.request_id, kind="run", device=victim["device"], namespace=TENANT, request=request.dump()
    )
    report = RunReport(
        device="victim",
        request_id=request.request_id,
        prompt=X_TEXT,
        text=served.text,
        tokens=served.tokens,
        breakdown=served.breakdown,
        fetched=served.fetched,
    )
    assert actions.record_run(victim["me"].seal(report, Kind.REPORT)) is not None
    [sent] = [task for task in fleet["sent"] if task["name"] == "edgecache.audit_entry"]
    assert sent["queue"] == "device.auditor"

    # The auditor takes it as its task does: the control plane's signed, sealed request, for it only.
    body = auditor["me"].open_request(sent["args"][0], Kind.AUDIT)
    verdict = audit_entry(auditor["board"], AuditRequest.parse(body))
    assert verdict["verdict"] == "mismatch" and verdict["producer"] == "liar", verdict
    assert actions.record_audit(auditor["me"].seal(AuditReport(device="auditor", **verdict), Kind.AUDITED)) is not None

    row = EntryAudit.objects.get(request_id=body["request_id"])
    assert (row.verdict, row.producer, row.entry, row.run_device) == ("mismatch", "liar", x_name, "victim")
    marked = Device.objects.get(name="liar")
    assert (
        marked.quarantined_at is not None
        and marked.audit_mismatches == 1
        and "differs from the cold state" in marked.quarantine_reason
    )
    assert CacheBox(fleet["url"]).read_entries([x_name]) == [
        None
    ]  # deleted (the control plane reads as the deployment)

    # Every entry of the liar is refused from now on: it plants the forgery again.
    liar["store"].put_entries([(x_name, forgery)], ttl=3600)
    again = victim_answers_x(fleet)
    assert again.tokens == cold_x.tokens and again.breakdown.rejected_entries == 1
    assert victim["me"].producers.quarantined["liar"].startswith("audit ")

    # Counted in /metrics, shown on the device page.
    staff = django_user_model.objects.create_user("alice", password="pw-alice-123", is_staff=True)
    client.force_login(staff)
    settings.EDGECACHE_METRICS_CACHE_SECONDS = 0
    metrics = client.get("/metrics").content.decode()
    assert 'edgecache_audit_mismatches_total{device="liar",namespace="acme"} 1.0' in metrics
    assert 'edgecache_board_quarantined{device="liar",namespace="acme"} 1.0' in metrics
    page = client.get(marked.get_absolute_url()).content.decode()
    assert "quarantined" in page and "differs from the cold state" in page


def test_revoking_a_board_quarantines_its_entries(fleet):
    """Honest's entries are served; once it is revoked the producer table lists it, the entries the
    mirror knows it stored are deleted, and a reader refuses (and evicts) any other it finds."""
    from dashboard import actions
    from dashboard.models import Device

    cold_x, _, x_name, _ = computed_by_honest(fleet)
    assert victim_answers_x(fleet).breakdown.case == "full"
    actions.revoke_device(None, Device.objects.get(name="honest"))
    answer = victim_answers_x(fleet)
    assert answer.breakdown.case == "miss" and answer.breakdown.rejected_entries == 1 and answer.tokens == cold_x.tokens
    assert fleet["boards"]["victim"]["me"].producers.quarantined == {"honest": "revoked"}

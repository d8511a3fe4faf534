"""The dashboard tells the truth while it is open (issue 28, its operations half): boards going
down reach open pages, the queue, where an answer came from, the names operators' tools know.

Real Valkey (device registry, channel layer) as in tests/dashboard/test_dashboard.py; no board: reports and
heartbeats are signed here with an enrolled board's keys.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.utils import timezone

from dashboard import actions
from dashboard.actions import sweeper
from dashboard.live.consumers import LiveConsumer
from dashboard.models import Device, Membership, Namespace
from tests.conftest import REQUIRE_ALL, ROOT, require
from tests.dashboard.test_dashboard import control_plane, enrolled, heartbeat, register, sent_tasks, staff_client  # noqa: F401  (fixtures)


def _member(username: str, namespace: str = "default"):
    user = get_user_model().objects.create_user(username, password=f"pw-{username}-123")
    Namespace.objects.get_or_create(name=namespace)
    Membership.objects.create(user=user, namespace_id=namespace)
    return user


# -- B1: a board that stops beating goes offline on every open page ---------------------------------
@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_board_that_misses_its_heartbeats_is_marked_offline_and_open_pages_are_told_once(
    control_plane, settings, django_capture_on_commit_callbacks, monkeypatch
):
    # The live socket's consumer closes old database connections around its queries, as it should
    # in production; here the test's transaction holds the only connection (PostgreSQL's would end).
    import channels.db

    monkeypatch.setattr(channels.db, "close_old_connections", lambda: None)
    settings.EDGECACHE_MISSED_HEARTBEATS = 3
    device, token = register()
    keys = enrolled(device, token)
    actions.record_heartbeat(heartbeat(keys, {"heartbeat_s": 1.0}))
    device.refresh_from_db()
    assert device.online and device.announced_online
    user = _member("erin")

    async def scenario():
        communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
        communicator.scope["user"] = user
        connected, _ = await communicator.connect()
        assert connected
        # Within its heartbeats (1 s each, 3 missed + 1 of slack): still online, nothing said.
        assert await sync_to_async(sweeper.announce_liveness)(device.last_seen + timedelta(seconds=3.5)) == []
        assert await communicator.receive_nothing(timeout=0.3)
        # Past them: marked offline, and the page hears it at once.
        assert await sync_to_async(sweeper.announce_liveness)(device.last_seen + timedelta(seconds=4.5)) == ["zero"]
        told = await communicator.receive_json_from(timeout=5)
        # A second sweep (another control worker's, say) marks nothing and says nothing.
        again = await sync_to_async(sweeper.announce_liveness)(device.last_seen + timedelta(seconds=30))
        quiet = await communicator.receive_nothing(timeout=0.3)

        # Its next heartbeat brings it back, on the page too (told once the heartbeat commits).
        def beat():
            with django_capture_on_commit_callbacks(execute=True):
                actions.record_heartbeat(heartbeat(keys, {"heartbeat_s": 1.0}))

        # Plain sync_to_async: it runs in the test's thread and transaction.
        await sync_to_async(beat)()
        back = await communicator.receive_json_from(timeout=5)
        await communicator.disconnect()
        return told, again, quiet, back

    told, again, quiet, back = async_to_sync(scenario)()
    assert told["event"] == "device" and told["data"]["name"] == "zero" and told["data"]["online"] is False
    assert told["data"]["last_seen"]  # the page says "offline since HH:MM"
    assert again == [] and quiet
    assert back["event"] == "device" and back["data"]["online"] is True
    assert Device.objects.get(name="zero").announced_online


@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_page_that_connects_late_asks_the_state_of_its_boards_and_gets_only_its_tenants(control_plane, monkeypatch):
    # A page whose socket opens (or reopens) after a board went offline missed that event: it asks
    # the state of the boards it shows, and learns nothing of another tenant's board by naming it.
    import channels.db

    monkeypatch.setattr(channels.db, "close_old_connections", lambda: None)  # as above: one transaction
    device, token = register()
    keys = enrolled(device, token)
    actions.record_heartbeat(heartbeat(keys, {"heartbeat_s": 1.0}))
    Device.objects.filter(pk=device.pk).update(last_seen=timezone.now() - timedelta(minutes=5))
    Namespace.objects.get_or_create(name="tenant-b")
    register("bee", namespace=Namespace.objects.get(name="tenant-b"))
    user = _member("frank")

    async def scenario():
        communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
        communicator.scope["user"] = user
        connected, _ = await communicator.connect()
        assert connected
        await communicator.send_json_to({"sync": ["bee", "zero", "nobody", 7]})
        state = await communicator.receive_json_from(timeout=5)
        rest = await communicator.receive_nothing(timeout=0.3)
        await communicator.send_json_to({"sync": ["bee"]})
        nothing = await communicator.receive_nothing(timeout=0.3)
        await communicator.disconnect()
        return state, rest, nothing

    state, rest, nothing = async_to_sync(scenario)()
    assert state["event"] == "device" and state["data"]["name"] == "zero" and state["data"]["online"] is False
    assert rest and nothing  # "bee" is tenant-b's: neither its state nor that it exists


@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_offline_mark_follows_the_missed_heartbeats_setting(control_plane, settings):
    device, token = register()
    keys = enrolled(device, token)
    actions.record_heartbeat(heartbeat(keys, {"heartbeat_s": 2.0}))
    device.refresh_from_db()
    settings.EDGECACHE_MISSED_HEARTBEATS = 5  # 2 s beats: offline after 12 s (5 missed, one of slack)
    assert sweeper.announce_liveness(device.last_seen + timedelta(seconds=11)) == []
    assert sweeper.announce_liveness(device.last_seen + timedelta(seconds=13)) == ["zero"]
    assert not Device.objects.get(name="zero").announced_online


# -- C8 and the queue: what waits, how long, what ended unanswered; Revoke -----------------------------
@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_queue_page_shows_what_waits_and_what_expired_and_revokes_a_queued_run(
    control_plane, staff_client, sent_tasks, settings
):
    from cachebox.keys import cancel_key_name
    from dashboard.models import AuditEvent, Dispatch, InferenceRun

    settings.EDGECACHE_BOARD_ACL = False
    zero, _ = register("zero")
    waits = actions.dispatch_run(
        None, [zero], actions.run_request(segments=["Which planet is red?"], max_tokens=4, title="red planet")
    )[0]["request_id"]
    expired = actions.dispatch_run(
        None, [zero], actions.run_request(segments=["Never taken?"], max_tokens=4, title="never taken")
    )[0]["request_id"]
    Dispatch.objects.filter(request_id=expired).update(
        expires_at=timezone.now() - sweeper.EXPIRY_GRACE - timedelta(seconds=1)
    )
    assert sweeper.sweep()["lost"] == 1  # the board never started it: a failed run with the reason

    page = staff_client.get("/queue/").content.decode()
    waiting = page[page.index('id="queue-waiting"') : page.index('id="queue-ended"')]
    ended = page[page.index('id="queue-ended"') :]
    assert (
        waits in waiting
        and "red planet" in waiting
        and "Revoke" in waiting
        and "waiting for its board to start" in waiting
    )
    assert expired in ended and "never taken" in ended and "did not start it before it expired" in ended
    boards = page[page.index('id="queue-boards"') : page.index('id="queue-namespaces"')]
    assert '<tr data-board="zero"><td>zero</td><td>1</td>' in boards  # one waits; one expired

    response = staff_client.post(
        "/queue/revoke/", {"request_id": waits, "confirming": "1", "confirm": "on"}, follow=True
    )
    assert "Revoked the run" in response.content.decode()
    assert Dispatch.objects.get(request_id=waits).outcome == "revoked"
    run = InferenceRun.objects.get(request_id=waits)
    assert run.error.startswith("revoked: alice took it back from the queue") and run.title == "red planet"
    assert control_plane.read_flag(cancel_key_name("zero", waits)) is not None  # the board drops it if it ever takes it
    assert AuditEvent.objects.filter(action="run.revoke", target=waits).exists()
    runs_page = staff_client.get("/runs/").content.decode()
    assert "took it back from the queue" in runs_page and "did not start it before it expired" in runs_page
    # Once: a second Revoke changes nothing.
    assert "Nothing revoked" in staff_client.post("/queue/revoke/", {"request_id": waits}, follow=True).content.decode()


@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_member_of_another_tenant_sees_nothing_of_a_queue_and_revokes_nothing(
    control_plane, client, sent_tasks, settings
):
    from dashboard.models import Dispatch

    settings.EDGECACHE_BOARD_ACL = False
    Namespace.objects.get_or_create(name="tenant-b")
    zero, _ = register("zero")
    bee, _ = register("bee", namespace=Namespace.objects.get(name="tenant-b"))
    secret = actions.dispatch_run(
        None, [zero], actions.run_request(segments=["Default's secret?"], max_tokens=4, title="default secret")
    )[0]["request_id"]
    own = actions.dispatch_run(
        None, [bee], actions.run_request(segments=["Bee's question?"], max_tokens=4, title="bee question")
    )[0]["request_id"]
    client.force_login(_member("mallory", "tenant-b"))
    page = client.get("/queue/").content.decode()
    assert own in page and "bee question" in page
    assert (
        secret not in page
        and "default secret" not in page
        and 'data-board="zero"' not in page
        and 'data-namespace="default"' not in page
    )
    assert "Nothing revoked" in client.post("/queue/revoke/", {"request_id": secret}, follow=True).content.decode()
    assert Dispatch.objects.get(request_id=secret).outcome == ""


# -- B5, B6, B7: where an answer came from, said one way everywhere -------------------------------
def test_a_context_hit_says_the_boards_context_not_the_cache_box():
    from inference.serving.breakdown import served_from, source_label, tokens_by_tier

    context = {
        "prompt_tokens": 468,
        "matched_tokens": 468,
        "tier": "context",
        "context_tokens": 468,
        "decision": "local",
        "redis_ms": 0.0,
    }
    assert (
        served_from(context) == "468/468 prompt tokens from the board's own context"
        and source_label(context) == "context"
    )
    mixed = {
        "prompt_tokens": 400,
        "matched_tokens": 300,
        "tier": "cachebox",
        "context_tokens": 100,
        "fetched_tokens": 200,
    }
    assert (
        served_from(mixed)
        == "300/400 prompt tokens reused: 100 from the board's own context, 200 from the cache box, 100 computed"
    )
    assert source_label(mixed) == "context + cache box"
    ram = {"prompt_tokens": 200, "matched_tokens": 128, "tier": "local", "local_tokens": 128}
    assert (
        served_from(ram) == "128/200 prompt tokens from the board's RAM tier, 72 computed"
        and source_label(ram) == "RAM tier"
    )
    assert served_from({"prompt_tokens": 50, "matched_tokens": 0}) == "all 50 prompt tokens computed"
    # Recorded before boards counted tokens per tier: the tier it names, else the cache box (schema runs).
    assert tokens_by_tier({"matched_tokens": 64, "tier": "context"}) == {
        "context": 64,
        "local": 0,
        "flash": 0,
        "cachebox": 0,
    }
    assert tokens_by_tier({"matched_tokens": 64, "tier": ""}) == {"context": 0, "local": 0, "flash": 0, "cachebox": 64}
    flash = {"prompt_tokens": 300, "matched_tokens": 256, "tier": "flash", "flash_tokens": 256}
    assert (
        served_from(flash) == "256/300 prompt tokens from the board's flash tier, 44 computed"
        and source_label(flash) == "flash tier"
    )


def test_the_walk_over_the_tiers_counts_each_tiers_tokens():
    from inference.serving.breakdown import Breakdown, Tier
    from inference.tiers.base import Held, TierRun, restore_nearest_first

    class Serves:
        def __init__(self, label, upto, computed=0):
            self.label, self.upto, self.computed = label, upto, computed

        def lookup(self, run, held):
            return self.upto if self.upto > held.matched else None

        def restore(self, run, upto, held):
            return Held(matched=upto, computed=held.computed + self.computed, used=held.used)

    breakdown = Breakdown()
    run = TierRun(None, list(range(500)), 64, (), [], breakdown)
    held = restore_nearest_first(
        [Serves(Tier.CONTEXT, 128), Serves(Tier.LOCAL, 128), Serves(Tier.CACHEBOX, 448, computed=64)], run
    )
    # The cache box's loader computed the front's 64 tokens itself while loading: not served by it.
    assert held.served == 384
    assert (breakdown.context_tokens, breakdown.local_tokens, breakdown.fetched_tokens) == (128, 0, 256)


def test_the_breakeven_chart_plots_only_fetches_from_the_cache_box():
    from inference.serving.breakeven import points_from_breakdowns

    points = points_from_breakdowns(
        [
            {
                "prompt_tokens": 468,
                "matched_tokens": 468,
                "context_tokens": 468,
                "fetched_tokens": 0,
                "redis_ms": 0.0,
                "local_ms": 3.0,
                "tier": "context",
            },
            {
                "prompt_tokens": 349,
                "matched_tokens": 349,
                "local_tokens": 349,
                "fetched_tokens": 0,
                "redis_ms": 0.0,
                "tier": "local",
            },
            {
                "prompt_tokens": 349,
                "matched_tokens": 349,
                "flash_tokens": 349,
                "fetched_tokens": 0,
                "redis_ms": 0.0,
                "tier": "flash",
            },
            {
                "prompt_tokens": 400,
                "matched_tokens": 349,
                "context_tokens": 0,
                "fetched_tokens": 349,
                "redis_ms": 2600.0,
                "prefill_ms": 50.0,
                "tier": "cachebox",
            },
            {
                "prompt_tokens": 300,
                "matched_tokens": 256,
                "tier": "local",
                "fetched_bytes": 0,
                "redis_ms": 0.0,
            },  # recorded before per-tier counts
        ]
    )
    assert points.fetch == [(349, 2600.0)]


def test_a_slow_hit_names_its_link_once():
    from dashboard.pages.explain import why

    b = {
        "case": "full",
        "tier": "cachebox",
        "fetch_ms": 2600.0,
        "redis_ms": 2650.0,
        "ttft_ms": 2700.0,
        "fetched_bytes": 6_500_000,
        "link": "emulated link 20.9 Mbit/s, 4 ms RTT",
        "predicted_prefill_ms": 1200.0,
    }
    assert why(b)[0].startswith("A slow hit: the emulated 20.9 Mbit/s, 4 ms RTT link took 2.6 s for 6.5 MB")
    assert "the emulated Wi-Fi 4 (20.9 Mbit/s, 4 ms) link took" in why({**b, "link": "Wi-Fi 4 (20.9 Mbit/s, 4 ms)"})[0]


@pytest.mark.django_db
@pytest.mark.cachebox
def test_pages_say_where_a_context_hit_came_from(control_plane, staff_client):
    from dashboard.actions.runs import run_json
    from dashboard.models import InferenceRun

    zero, _ = register("zero")
    breakdown = {
        "case": "full",
        "prompt_tokens": 468,
        "matched_tokens": 468,
        "tier": "context",
        "context_tokens": 468,
        "decision": "local",
        "cachebox": "ok",
        "ttft_ms": 20.0,
        "ttlt_ms": 40.0,
        "generated_tokens": 3,
    }
    run = InferenceRun.objects.create(
        device=zero, case="full", breakdown=breakdown, prompt_tokens=468, matched_tokens=468, ttft_ms=20.0, text=" ok"
    )
    assert (run.context_tokens, run.fetched_tokens, run.tpot_ms) == (468, 0, 10.0)
    live = run_json(run)
    assert (
        live["served_from"] == "468/468 prompt tokens from the board's own context"
        and live["served_from_label"] == "context"
    )
    detail = staff_client.get(f"/runs/{run.pk}/").content.decode()
    assert "468/468 prompt tokens from the board&#x27;s own context" in detail and "from the cache box" not in detail
    listed = staff_client.get("/runs/").content.decode()
    assert "<td>468/468</td><td>context</td>" in listed


# -- /health and /ready, for load balancers ---------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.cachebox
def test_health_is_503_while_the_cache_box_or_a_migration_is_missing_and_200_when_ready(
    control_plane, client, monkeypatch
):
    from cachebox.store import CacheBox
    from dashboard.ops import health

    assert client.get("/health").json() == {"status": "ok"}
    monkeypatch.setattr(health, "_migrated", False)
    monkeypatch.setattr(health, "_pending_migrations", lambda: 2)
    starting = client.get("/health")
    assert starting.status_code == 503 and starting.json()["waiting_for"] == [
        "2 database migrations (python manage.py migrate)"
    ]
    monkeypatch.setattr(health, "_pending_migrations", lambda: 0)
    monkeypatch.setattr(CacheBox, "ping", lambda self: False)
    down = client.get("/health")
    assert down.status_code == 503 and down.json() == {"status": "starting", "waiting_for": ["the cache box"]}


@pytest.mark.django_db
@pytest.mark.cachebox
def test_ready_says_per_model_whether_a_board_is_online_and_names_no_board(control_plane, client):
    device, token = register("zero")
    keys = enrolled(device, token)
    assert client.get("/ready").status_code == 503  # no board has said what it serves
    actions.record_heartbeat(heartbeat(keys, {"model": "gemma-3-270m", "heartbeat_s": 1.0}))
    register("ghost")  # never started: serves no model yet
    ready = client.get("/ready")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "models": {"gemma-3-270m": {"boards": 1, "online": 1, "ready": True}}}
    assert "zero" not in ready.content.decode()
    Device.objects.filter(name="zero").update(last_seen=timezone.now() - timedelta(minutes=5))
    gone = client.get("/ready")
    assert gone.status_code == 503 and gone.json()["models"]["gemma-3-270m"] == {
        "boards": 1,
        "online": 0,
        "ready": False,
    }


# -- what the alert rules read (docs/ops/) ----------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.cachebox
def test_metrics_an_operator_alerts_on(control_plane, sent_tasks, settings):
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dashboard.ops import metrics
    from dashboard.ops.security_counts import KEY
    from inference.board.identity import BoardKeys

    settings.EDGECACHE_METRICS_CACHE_SECONDS = 0
    settings.EDGECACHE_BOARD_ACL = False
    control_plane.redis.delete(KEY)
    zero, token = register("zero")
    keys = enrolled(zero, token)
    actions.record_heartbeat(heartbeat(keys, {"heartbeat_s": 1.0}))
    register("ghost")
    actions.dispatch_run(None, [zero], actions.run_request(segments=["Waits?"], max_tokens=4))
    from dashboard.models import Dispatch

    Dispatch.objects.update(created=timezone.now() - timedelta(seconds=90))
    # A heartbeat signed with another key than zero's: refused, and counted for every process to see.
    assert actions.record_heartbeat(heartbeat(BoardKeys.generate(), {"heartbeat_s": 1.0})) is None

    found = {}
    for family in text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    zero_labels, ghost_labels = (
        (("device", "zero"), ("namespace", "default")),
        (("device", "ghost"), ("namespace", "default")),
    )
    assert found[("edgecache_board_up", zero_labels)] == 1 and found[("edgecache_board_up", ghost_labels)] == 0
    assert found[("edgecache_board_last_seen_timestamp_seconds", ghost_labels)] == 0
    assert found[("edgecache_queue_runs", zero_labels)] == 1
    assert 89 < found[("edgecache_queue_oldest_wait_seconds", zero_labels)] < 200
    assert found[("edgecache_cachebox_memory_max_bytes", ())] == 512 * 1024 * 1024  # the test Valkey's maxmemory
    assert 0 < found[("edgecache_cachebox_memory_used_bytes", ())] < 512 * 1024 * 1024
    assert found[("edgecache_security_events_total", (("event", "board_message_refused"),))] >= 1


OPS = ROOT / "docs" / "ops"
EXPOSED_NAME = re.compile(r"\b((?:edgecache|gen_ai)_[a-z0-9_]+)")


def _exposed_names() -> set[str]:
    """Every sample name /metrics serves (counters with _total, histograms with _bucket, _sum, _count)."""
    from dashboard.ops import metrics

    names = set()
    for family in metrics.REGISTRY.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_alert_rules_and_the_grafana_dashboard_read_only_metrics_that_exist(control_plane, settings):
    import json

    yaml = require("yaml", "the alert rules are YAML")
    settings.EDGECACHE_METRICS_CACHE_SECONDS = 0
    exposed = _exposed_names()
    rules = yaml.safe_load((OPS / "edgecache-alerts.yml").read_text())["groups"][0]["rules"]
    alerts = {rule["alert"] for rule in rules}
    assert {
        "EdgeCacheBoardDown",
        "EdgeCacheHitRatioFalling",
        "EdgeCacheMemoryNearMax",
        "EdgeCacheQueueWaitHigh",
        "EdgeCacheSignatureRefusals",
        "EdgeCacheAuditMismatch",
    } <= alerts
    expressions = [rule["expr"] for rule in rules]
    for rule in rules:
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    dashboard = json.loads((OPS / "edgecache-grafana.json").read_text())
    expressions += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in expressions for name in EXPOSED_NAME.findall(expr)}
    assert used and used <= exposed, sorted(used - exposed)


def _promtool() -> str | None:
    import shutil

    return shutil.which("promtool") or next(
        (str(path) for path in [ROOT / ".venv" / "bin" / "promtool"] if path.exists()), None
    )


def test_promtool_accepts_the_alert_rules():
    import subprocess

    promtool = _promtool()
    if promtool is None:
        message = "promtool is missing: `make promtool` installs Debian's prometheus package (it ships promtool)"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    done = subprocess.run(
        [promtool, "check", "rules", str(OPS / "edgecache-alerts.yml")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 8 rules found" in done.stdout


def test_an_audit_mismatch_fires_its_alert_and_a_match_does_not(tmp_path):
    """promtool runs the rule over series as /metrics exports them: one mismatch of the liar fires
    EdgeCacheAuditMismatch for it; a board with none fires nothing."""
    import subprocess

    promtool = _promtool()
    if promtool is None:
        message = "promtool is missing: `make promtool` installs Debian's prometheus package (it ships promtool)"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    yaml = require("yaml", "the alert rules are YAML")
    rules = yaml.safe_load((OPS / "edgecache-alerts.yml").read_text())["groups"][0]["rules"]
    [rule] = [rule for rule in rules if rule["alert"] == "EdgeCacheAuditMismatch"]
    cases = tmp_path / "audit-alert-test.yml"
    series = 'edgecache_audit_mismatches_total{{device={!r},namespace="acme"}}'
    cases.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(OPS / "edgecache-alerts.yml")],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [
                            {"series": series.format("liar").replace("'", '"'), "values": "0 0 1 1 1"},
                            {"series": series.format("honest").replace("'", '"'), "values": "0 0 0 0 0"},
                        ],
                        "alert_rule_test": [
                            {
                                "eval_time": "4m",
                                "alertname": "EdgeCacheAuditMismatch",
                                "exp_alerts": [
                                    {
                                        "exp_labels": {"severity": "critical", "device": "liar", "namespace": "acme"},
                                        "exp_annotations": {
                                            "summary": "an audit caught liar (acme): 1 entries not what they claim",
                                            "description": rule["annotations"]["description"],
                                        },
                                    }
                                ],
                            },
                            {"eval_time": "1m", "alertname": "EdgeCacheAuditMismatch", "exp_alerts": []},
                        ],
                    }
                ],
            }
        )
    )
    done = subprocess.run([promtool, "test", "rules", str(cases)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_operations_metrics_cost_two_queries_however_many_boards_and_runs_wait(
    control_plane, settings, django_assert_max_num_queries
):
    import uuid

    from dashboard.models import Dispatch
    from dashboard.ops import metrics

    for index in range(12):
        board = Device.objects.create(name=f"board-{index}", token_sha256="0" * 64)
        for _ in range(3):
            Dispatch.objects.create(request_id=uuid.uuid4(), kind="run", device=board, namespace="default")
    metrics.OPERATIONS.invalidate()
    with django_assert_max_num_queries(2):
        families = {family.name: family for family in metrics.OPERATIONS.collect()}
    assert len(families["edgecache_board_up"].samples) == 12
    assert {sample.value for sample in families["edgecache_queue_runs"].samples} == {3.0} and len(
        families["edgecache_queue_runs"].samples
    ) == 12

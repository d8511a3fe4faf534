"""The Run page and the charts, without a browser: time between tokens on the
real model, chart time ranges served (and downsampled) from the database, one colour per
device, empty charts that say so, answers that explain themselves, cache entries people can
read, the Run page's streamed runs (real Valkey pub/sub) and its Cancel.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.urls import reverse
from django.utils import timezone

from cachebox.keys import cancel_key_name, stream_channel
from dashboard import actions
from dashboard.models import CacheEntry, Device, InferenceRun
from dashboard.pages import chart_series, explain
from dashboard.security.signing import control_plane_public_key, device_ring
from inference.contract import envelope
from inference.contract.envelope import Kind
from inference.contract.messages import StreamEvent
from tests.dashboard.test_dashboard import control_plane, enrolled, register, result_payload, sent_tasks, staff_client  # noqa: F401  (fixtures)


# -- time between tokens (issue 13, part 6): the real model --------------------------------------------
@pytest.mark.model
@pytest.mark.cachebox
def test_every_run_records_time_between_its_answer_tokens(make_board, namespace):
    board = make_board(None, namespace)
    result = board.run("The days of the week are Monday, Tuesday,", max_tokens=12, use_cache=False)
    b = result.breakdown
    assert b.generated_tokens >= 3
    assert 0 < b.tbt_p50_ms <= b.tbt_p99_ms
    # The gaps lie between the first token and the last: together no longer than that span.
    assert b.tbt_p50_ms * (b.generated_tokens - 1) <= (b.ttlt_ms - b.ttft_ms) * 1.5 + 1.0
    # A gap holds one decode step: the longest gaps at least the average step (the median may be
    # far below it when a loaded machine stalled a few steps).
    assert b.tbt_p99_ms >= b.decode_ms / (b.generated_tokens - 1) * 0.5


@pytest.mark.model
@pytest.mark.cachebox
def test_a_one_token_answer_has_no_time_between_tokens(make_board, namespace):
    board = make_board(None, namespace)
    b = board.run("Paris is the capital of", max_tokens=1, use_cache=False).breakdown
    assert b.generated_tokens == 1 and b.tbt_p50_ms == 0.0 and b.tbt_p99_ms == 0.0


# -- charts people can steer ---------------------------------------------------------------------------
def _run(device, *, ago: timedelta, ttft=100.0, case="miss", tbt=(10.0, 14.0), error="", tier=None):
    breakdown = {
        "ttft_ms": ttft,
        "ttlt_ms": ttft + 50,
        "case": case,
        "tbt_p50_ms": tbt[0],
        "tbt_p99_ms": tbt[1],
        "state_bytes": 2_000_000,
    }
    if tier is not None:  # runs recorded before boards kept tiers have none
        breakdown["tier"] = tier
    run = InferenceRun.objects.create(
        device=device,
        title="t",
        prompt="p",
        text="x",
        error=error,
        case=case,
        ttft_ms=ttft,
        ttlt_ms=ttft + 50,
        matched_tokens=0 if case == "miss" else 128,
        breakdown=breakdown,
    )
    InferenceRun.objects.filter(pk=run.pk).update(created=timezone.now() - ago)
    return run


@pytest.mark.cachebox
@pytest.mark.django_db
def test_chart_ranges_are_served_from_the_database(staff_client, control_plane):
    zero, _ = register("zero")
    one, _ = register("one")
    _run(zero, ago=timedelta(minutes=5), tbt=(11.0, 19.0))
    _run(zero, ago=timedelta(minutes=40), case="full")
    _run(one, ago=timedelta(hours=3))
    _run(one, ago=timedelta(days=3))
    _run(one, ago=timedelta(minutes=1), error="boom")  # failed runs are not charted

    def traces(range_name):
        data = staff_client.get(reverse("home-charts"), {"range": range_name}).json()
        return data, {trace["name"]: trace for trace in data["timeline"]["data"]}

    data, timeline = traces("15m")
    assert data["range"] == "15m" and data["runs"] == 1 and data["granularity"] == "run"
    assert len(timeline["zero TTFT"]["x"]) == 1 and timeline["one TTFT"]["x"] == []
    tbt = {trace["name"]: trace["y"] for trace in data["tbt"]["data"]}
    assert tbt["zero TBT p50"] == [11.0] and tbt["zero TBT p99"] == [19.0]
    assert traces("1h")[0]["runs"] == 2
    assert traces("24h")[0]["runs"] == 3
    data, timeline = traces("all")
    assert data["runs"] == 4 and len(timeline["one TTFT"]["x"]) == 2
    assert data["hitCounts"] == {"zero": [1, 2], "one": [0, 2]}
    # The page opens with the range of its address.
    page = staff_client.get(reverse("home"), {"range": "1h"})
    assert page.context["chart_data"]["runs"] == 2 and 'data-range="1h"' in page.content.decode()


@pytest.mark.cachebox
@pytest.mark.django_db
def test_many_runs_are_downsampled_by_the_database(staff_client, control_plane, monkeypatch):
    zero, _ = register("zero")
    for minute in range(6):
        for second in (0, 20, 40):  # three runs in each minute
            _run(
                zero,
                ago=timedelta(minutes=minute, seconds=second),
                ttft=100.0 + second,
                case="full" if second == 0 else "miss",
            )
    monkeypatch.setattr(chart_series, "RAW_LIMIT", 5)
    monkeypatch.setattr(chart_series, "MAX_BUCKETS", 20)  # 15 min in minutes: 15 buckets
    series = chart_series.chart_series(InferenceRun.objects.all(), "15m")
    assert series.granularity == "minute" and series.runs == 18
    assert 6 <= len(series.points) <= 7  # one point per minute that holds runs (a minute edge may split one)
    assert sum(point.runs for point in series.points) == 18 and sum(point.hits for point in series.points) == 6
    assert all(100.0 <= point.ttft_ms <= 140.0 for point in series.points)
    assert all(point.tbt_p50_ms == 10.0 for point in series.points)
    data = staff_client.get(reverse("home-charts"), {"range": "15m"}).json()
    assert data["granularity"] == "minute"
    assert "averaged per minute" in staff_client.get(reverse("home"), {"range": "15m"}).content.decode()


@pytest.mark.cachebox
@pytest.mark.django_db
def test_each_device_keeps_one_colour_on_every_chart(staff_client, control_plane):
    zero, _ = register("zero")
    one, _ = register("one")
    _run(zero, ago=timedelta(minutes=1))
    _run(one, ago=timedelta(minutes=2))
    data = staff_client.get(reverse("home-charts"), {"range": "1h"}).json()
    assert data["colors"]["zero"] != data["colors"]["one"]
    for chart in ("timeline", "tbt", "hits", "bytes"):
        for trace in data[chart]["data"]:
            device = trace["name"].split(" ")[0]
            color = (trace.get("line") or {}).get("color") or (trace.get("marker") or {}).get("color")
            assert color == data["colors"][device], f"{chart}: {trace['name']}"


@pytest.mark.cachebox
@pytest.mark.django_db
def test_an_empty_chart_says_so_instead_of_drawing_empty_axes(staff_client, control_plane):
    register("zero")
    data = staff_client.get(reverse("home-charts"), {"range": "15m"}).json()
    for chart in ("timeline", "tbt", "hits", "bytes", "breakdown"):
        layout = data[chart]["layout"]
        assert layout["meta"] == {"empty": True}, chart
        assert layout["xaxis"]["visible"] is False and layout["yaxis"]["visible"] is False
        assert layout["annotations"][0]["text"] == "No runs in this time range yet"


# -- the hit ratio by tier (issue 18): the board's context, its RAM tier, the cache box ------------------------
def _point(device, second, tier, runs=1):
    """A chart point of ``runs`` runs, one of them a hit from ``tier`` ("" for none)."""
    hits = {f"{name}_hits": int(tier == name) for name in chart_series.HIT_TIERS}
    return chart_series.ChartPoint(
        timezone.now() + timedelta(seconds=second), device, 100.0, 150.0, 0.0, 0.0, 0.0, runs, **hits
    )


def test_a_hit_is_attributed_to_the_tier_that_served_it():
    assert chart_series.hit_tier("full", "context") == "context"
    assert chart_series.hit_tier("partial", "local") == "local"
    assert chart_series.hit_tier("partial", "cachebox") == "cachebox"
    # Schema runs (modules) and runs recorded before boards kept tiers: the cache box's.
    assert chart_series.hit_tier("full", "") == "cachebox" and chart_series.hit_tier("full", None) == "cachebox"
    assert chart_series.hit_tier("miss", "context") == "" and chart_series.hit_tier("", None) == ""


def test_the_hit_ratio_chart_draws_one_line_per_tier_whose_shares_add_up_to_the_hit_ratio():
    from dashboard.pages.charts import hit_ratio_figure, tier_counts

    points = [
        _point("zero", 0, ""),
        _point("zero", 1, "cachebox"),
        _point("zero", 2, "context"),
        _point("zero", 3, "local"),
        _point("one", 4, "local", runs=4),
    ]
    figure = hit_ratio_figure(points, ["zero", "one"], {"zero": "#111111", "one": "#222222"})
    lines = {trace["name"]: trace for trace in figure["data"]}
    assert list(lines) == [
        "zero context",
        "zero RAM tier",
        "zero flash tier",
        "zero cache box",
        "one context",
        "one RAM tier",
        "one flash tier",
        "one cache box",
    ]
    # Cumulative share of the device's runs that each tier served, after each point.
    assert lines["zero context"]["y"] == [0, 0, 1 / 3, 1 / 4]
    assert lines["zero RAM tier"]["y"] == [0, 0, 0, 1 / 4]
    assert lines["zero cache box"]["y"] == [0, 1 / 2, 1 / 3, 1 / 4]
    assert lines["one RAM tier"]["y"] == [1 / 4] and lines["one cache box"]["y"] == [0]  # a bucket of 4 runs, 1 hit
    assert {
        lines[name]["line"]["dash"] for name in ("zero context", "zero RAM tier", "zero flash tier", "zero cache box")
    } == {"dot", "dash", "dashdot", "solid"}
    assert all(trace["line"]["color"] == "#111111" for name, trace in lines.items() if name.startswith("zero "))
    hit_ratio = sum(lines[f"zero {label}"]["y"][-1] for label in ("context", "RAM tier", "cache box"))
    assert hit_ratio == 3 / 4
    assert (
        figure["layout"]["title"]["text"]
        == "Cache hit ratio by tier: context (dotted), RAM tier (dashed), flash tier (dash-dotted), cache box (solid)"
    )
    assert tier_counts(points) == {
        "zero": {"runs": 4, "context": 1, "local": 1, "flash": 0, "cachebox": 1},
        "one": {"runs": 4, "context": 0, "local": 1, "flash": 0, "cachebox": 0},
    }


@pytest.mark.cachebox
@pytest.mark.django_db
@pytest.mark.parametrize("raw_limit", [2000, 3], ids=["one point per run", "averaged per bucket"])
def test_the_dashboard_splits_the_hit_ratio_by_tier_from_the_database(
    staff_client, control_plane, monkeypatch, raw_limit
):
    monkeypatch.setattr(chart_series, "RAW_LIMIT", raw_limit)
    zero, _ = register("zero")
    for minutes, case, tier in (
        (1, "full", "context"),
        (2, "partial", "local"),
        (3, "full", "cachebox"),
        (4, "full", None),
        (5, "miss", ""),
        (6, "partial", "local"),
    ):
        _run(zero, ago=timedelta(minutes=minutes), case=case, tier=tier)
    data = staff_client.get(reverse("home-charts"), {"range": "1h"}).json()
    assert data["tierCounts"] == {"zero": {"runs": 6, "context": 1, "local": 2, "flash": 0, "cachebox": 2}}
    assert data["hitCounts"] == {"zero": [5, 6]}
    assert [tier["tier"] for tier in data["hitTiers"]] == ["context", "local", "flash", "cachebox"]
    last = {trace["name"]: trace["y"][-1] for trace in data["hits"]["data"]}
    assert last == pytest.approx(
        {"zero context": 1 / 6, "zero RAM tier": 2 / 6, "zero flash tier": 0, "zero cache box": 2 / 6}
    )
    page = staff_client.get(reverse("home"), {"range": "1h"})
    assert page.context["chart_data"]["tierCounts"] == data["tierCounts"]
    assert "Cache hit ratio by tier" in page.content.decode()


@pytest.mark.cachebox
@pytest.mark.django_db
def test_a_live_run_names_the_tier_of_its_hit(control_plane):
    device, token = register()
    keys = enrolled(device, token)
    hit = actions.record_run(
        result_payload(
            device, keys, breakdown={"case": "partial", "matched_tokens": 256, "prompt_tokens": 300, "tier": "local"}
        )
    )
    miss = actions.record_run(result_payload(device, keys, breakdown={"case": "miss", "prompt_tokens": 300}))
    assert actions.run_json(hit)["hit_tier"] == "local" and actions.run_json(miss)["hit_tier"] == ""


# -- answers that explain themselves ------------------------------------------------------------------------
def test_an_mmlu_answer_says_right_or_wrong():
    assert explain.mmlu_verdict(" B. Paris", "B") == (True, "right: answered B")
    assert explain.mmlu_verdict(" C", "B") == (False, "wrong: answered C, the answer is B")
    assert explain.mmlu_verdict(" The answer", "B")[0] is None


def test_a_slow_hit_says_why_and_a_skipped_fetch_says_what_was_forecast():
    slow = {
        "case": "full",
        "tier": "cachebox",
        "fetch_ms": 3400.0,
        "ttft_ms": 3600.0,
        "fetched_bytes": 8_400_000,
        "link": "Wi-Fi 4 (20.9 Mbit/s, 4 ms)",
        "predicted_fetch_ms": 3300.0,
        "predicted_prefill_ms": 2500.0,
        "fetched_tokens": 456,
    }
    assert explain.why(slow) == [
        "A slow hit: the emulated Wi-Fi 4 (20.9 Mbit/s, 4 ms) link took 3.4 s for 8.4 MB (forecast 3.3 s), longer than the 2.5 s computing those 456 tokens here was forecast to take"
        " (94% of the time to first token)."
    ]
    assert explain.why({**slow, "fetch_ms": 30.0, "ttft_ms": 60.0}) == []  # fast: nothing to explain
    skipped = {
        "case": "miss",
        "decision": "policy-skip",
        "candidate_tokens": 256,
        "predicted_fetch_ms": 2100.0,
        "predicted_prefill_ms": 640.0,
    }
    assert explain.why(skipped) == [
        "Fetch skipped: for the cached 256 tokens the policy forecast 2.1 s to fetch and restore against 640 ms to prefill them here, so it prefilled."
    ]


@pytest.mark.cachebox
@pytest.mark.django_db
def test_a_recorded_mmlu_run_carries_its_verdict_to_the_page(
    staff_client, control_plane, django_capture_on_commit_callbacks
):
    device, token = register()
    keys = enrolled(device, token)
    meta = {"source": "mmlu", "title": "MMLU geography, 0-shot, question 1", "expected_answer": "B"}
    run = actions.record_run(result_payload(device, keys, text=" C", meta=meta))
    shown = actions.run_json(run)
    assert (
        shown["explanation"]["verdict"] == "wrong: answered C, the answer is B"
        and shown["explanation"]["right"] is False
    )
    page = staff_client.get(reverse("run-detail", args=[run.pk])).content.decode()
    assert 'id="run-verdict" class="verdict wrong"' in page and "wrong: answered C, the answer is B" in page


# -- cache entries people can read ----------------------------------------------------------------------------
class _Words:
    """A vocabulary of whole words (the real one is the model's: the cache page test uses it)."""

    def __init__(self, text: str):
        self.words = text.split()

    def tokenize(self, text, *, add_bos, special=False):
        return ([0] if add_bos else []) + list(range(1, len(text.split()) + 1))

    def detokenize(self, tokens):
        return " ".join(self.words[t - 1] for t in tokens if t)  # 0: the BOS token, no text


def test_an_entry_is_described_by_the_first_words_of_its_range_or_its_module():
    from dashboard.pages.entry_preview import describe

    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    words = _Words(prompt)
    assert describe(prompt, {"start": 0, "end": 4, "piece": ""}, vocabulary=words) == "one two three"
    assert describe(prompt, {"start": 2, "end": 17, "piece": ""}, vocabulary=words).startswith("…two three four")
    assert (
        describe('<prompt schema="travel"><miami/></prompt>', {"start": 5, "end": 40, "piece": "miami"})
        == "schema travel, miami"
    )


@pytest.mark.cachebox
@pytest.mark.django_db
@pytest.mark.model
def test_the_cache_page_and_admin_show_what_an_entry_holds(admin_client, control_plane):
    device, token = register()
    keys = enrolled(device, token)
    uploaded = [
        {
            "name": f"ec:e:default:00ff00ff00ff00ff:{{{'ab' * 16}}}",
            "namespace": "default",
            "model": "00ff00ff00ff00ff",
            "start": 0,
            "end": 20,
            "bytes": 800_000,
        }
    ]
    payload = result_payload(
        device,
        keys,
        prompt="The quick brown fox jumps over the lazy dog while the farmer sleeps in the barn.",
        uploaded=uploaded,
    )
    run = actions.record_run(payload)
    assert run is not None and run.breakdown["entries"]["stored"][0]["start"] == 0
    page = admin_client.get(reverse("cache")).content.decode()
    assert "The quick brown fox" in page
    assert "800.0 kB" in page  # human-readable sizes
    admin = admin_client.get(reverse("admin:dashboard_cacheentry_changelist")).content.decode()
    assert "The quick brown fox" in admin and "800.0 kB" in admin


@pytest.mark.cachebox
@pytest.mark.django_db
def test_unpin_asks_without_calling_itself_destructive(admin_client, control_plane):
    CacheEntry.objects.create(
        key="ec:e:default:00ff00ff00ff00ff:{" + "cd" * 16 + "}",
        model="00ff00ff00ff00ff",
        namespace="default",
        start=0,
        end=128,
        bytes=2_400_000,
        pinned=True,
    )
    entry = CacheEntry.objects.get()
    changelist = reverse("admin:dashboard_cacheentry_changelist")
    unpin = admin_client.post(changelist, {"action": "unpin", "_selected_action": [entry.pk]}).content.decode()
    assert (
        "Unpinning deletes nothing" in unpin and "cannot be undone" not in unpin and "confirm-destructive" not in unpin
    )
    assert "2.4 MB" in unpin
    evict = admin_client.post(changelist, {"action": "evict", "_selected_action": [entry.pk]}).content.decode()
    assert "cannot be undone" in evict and "confirm-destructive" in evict


# -- the Run page streams: stages and tokens over the runs' pub/sub channels; Cancel ------------------------------
@pytest.mark.cachebox
@pytest.mark.django_db(
    transaction=True, serialized_rollback=True
)  # leaves the migrated rows (content types) as it found them
def test_the_run_page_follows_its_run_as_the_board_streams_it(control_plane, sent_tasks, django_user_model):
    from django.test import AsyncClient

    device, token = register("zero")
    keys = enrolled(device, token)
    intruder, intruder_token = register("mallory")
    intruder_keys = enrolled(intruder, intruder_token)
    device.refresh_from_db()
    ring = device_ring(Device.objects.select_related("namespace").get(name="zero"))
    user = django_user_model.objects.create_user("alice", password="pw-alice-123", is_staff=True)
    client = AsyncClient()
    client.force_login(user)
    store = control_plane

    def published(event, signer=keys, sender="zero"):
        sealed = envelope.seal(
            event.compact(), kind=Kind.STREAM, sender=sender, to=event.request_id, signer=signer.signing, ring=ring
        )
        return json.dumps(sealed).encode()

    async def scenario():
        response = await client.post(
            reverse("run"),
            {"devices": [device.pk], "source": "text", "text": "Count: one, two,", "max_tokens": 4, "use_cache": "on"},
            headers={"Accept": "application/x-ndjson"},
        )
        assert response.status_code == 200 and response["Content-Type"] == "application/x-ndjson"
        lines = response.streaming_content.__aiter__()
        first = json.loads(await lines.__anext__())
        assert first["event"] == "dispatched" and first["dispatched"][0]["device"] == "zero"
        request_id = first["dispatched"][0]["request_id"]
        task = sent_tasks[-1]
        assert (
            task["queue"] == "device.zero"
            and task["args"][0]["request_id"] == request_id
            and task["args"][0]["stream"] is True
        )
        channel = stream_channel("zero", request_id)
        # Events the page must not show: unsigned (the old format), and signed by another board.
        forged = StreamEvent(
            type="token", request_id=request_id, device="zero", index=0, text="Pay to IBAN DE00 ATTACKER"
        )
        store.publish(channel, json.dumps(forged.compact()).encode())
        store.publish(channel, published(forged, intruder_keys, "mallory"))
        store.publish(channel, published(forged, intruder_keys, "zero"))
        # The board's events, as inference.board publishes them.
        for event in (
            StreamEvent(type="stage", request_id=request_id, device="zero", stage="started"),
            StreamEvent(type="token", request_id=request_id, device="zero", index=0, text=" three"),
            StreamEvent(type="token", request_id=request_id, device="zero", index=1, text=","),
            StreamEvent(
                type="done",
                request_id=request_id,
                device="zero",
                text=" three,",
                finish_reason="stop",
                breakdown={"ttft_ms": 42.0},
            ),
        ):
            store.publish(channel, published(event))
        seen = []
        async for raw in lines:
            seen.append(json.loads(raw))
        return request_id, seen

    request_id, seen = async_to_sync(scenario)()
    assert [(e["event"], e.get("stage") or e.get("text") or e.get("finish_reason") or "") for e in seen] == [
        ("stage", "started"),
        ("token", " three"),
        ("token", ","),
        ("done", " three,"),
        ("closed", ""),
    ]
    assert (
        seen[3]["finish_reason"] == "stop"
    )  # the done line carries the whole answer (the chat keeps it) and why it ended

    # Cancel: the run's flag is set for its board (which stops between two tokens).
    from django.test import Client

    sync_client = Client()
    sync_client.force_login(user)
    answer = sync_client.post(reverse("run-cancel"), {"request_id": [request_id, str(uuid.uuid4()), "not-a-uuid"]})
    assert answer.json() == {"cancelled": [request_id]}
    flag = json.loads(store.read_flag(cancel_key_name("zero", request_id)))
    body, _ = envelope.open_envelope(flag, kind=Kind.CANCEL, to="zero", signer_public_key=control_plane_public_key())
    assert body == {"request_id": request_id}


@pytest.mark.cachebox
@pytest.mark.django_db
def test_cancel_reaches_only_runs_the_user_may_see(control_plane, sent_tasks, django_user_model, client):
    device, _ = register("zero")
    sent = actions.dispatch_run(None, [device], actions.run_request(["Hi"]))
    outsider = django_user_model.objects.create_user("eve", password="pw-eve-12345")
    client.force_login(outsider)
    assert client.post(reverse("run-cancel"), {"request_id": sent[0]["request_id"]}).json() == {"cancelled": []}
    assert control_plane.read_flag(cancel_key_name("zero", sent[0]["request_id"])) is None


def test_stage_events_follow_the_message_contract():
    from cachebox.signing import control_plane_key, derive_keyring

    request_id = str(uuid.uuid4())
    board, ring = control_plane_key(b"b" * 32), derive_keyring(b"m" * 32, "default", 1)
    sealed = envelope.seal(
        StreamEvent(type="stage", request_id=request_id, stage="started").compact(),
        kind=Kind.STREAM,
        sender="zero",
        to=request_id,
        signer=board,
        ring=ring,
    )
    event = StreamEvent.open(
        json.dumps(sealed),
        request_id=request_id,
        signer_public_key=board.public_key().public_bytes_raw().hex(),
        ring_for=lambda _ns: ring,
    )
    assert event.type == "stage" and event.stage == "started"
    with pytest.raises(Exception):
        StreamEvent.parse({"type": "stage", "request_id": request_id, "stage": "dreaming"})

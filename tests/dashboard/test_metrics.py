"""The control plane's /metrics, the run rate limit and the JSON security log.

Metrics come from InferenceRun rows (exact values checked); the rate limit runs on a real
Valkey (the test session's own) through Django's cache, as several web processes share it.
"""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import uuid

import pytest
import redis
from channels.layers import channel_layers
from django.core.cache import caches
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from cachebox.events import LOGGER_NAME, JsonLineFormatter, security_event
from dashboard.celery import app as celery_app
from dashboard.models import Device, InferenceRun
from dashboard.ops import metrics
from dashboard.security import ratelimit
from tests.conftest import ROOT

pytestmark = pytest.mark.django_db

TOKEN = "metrics-token-" + "k" * 32


@pytest.fixture(autouse=True)
def metrics_settings(settings):
    settings.EDGECACHE_METRICS_TOKEN = TOKEN
    settings.EDGECACHE_METRICS_CACHE_SECONDS = 0
    metrics.RUNS.invalidate()
    yield settings
    metrics.RUNS.invalidate()


@pytest.fixture
def staff_client(client, django_user_model):
    client.force_login(django_user_model.objects.create_user("alice", password="pw-alice-123", is_staff=True))
    return client


@pytest.fixture
def plain_client(client, django_user_model):
    client.force_login(django_user_model.objects.create_user("bob", password="pw-bob-123"))
    return client


@pytest.fixture
def security_log():
    """What the configured ``edgecache.security`` handler writes, as parsed JSON lines."""
    handlers = [h for h in logging.getLogger(LOGGER_NAME).handlers if isinstance(h.formatter, JsonLineFormatter)]
    assert handlers, "settings.LOGGING gives edgecache.security a JSON-lines handler"
    stream = io.StringIO()
    previous = handlers[0].setStream(stream)

    def lines():
        text = stream.getvalue()
        assert text.endswith("\n") or not text
        return [json.loads(line) for line in text.splitlines()]

    yield lines
    handlers[0].setStream(previous)


def refused_count(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("edgecache_refused_requests_total", {"reason": reason}) or 0.0


def device(name: str) -> Device:
    return Device.objects.create(name=name, token_sha256="0" * 64)


def run(dev: Device, ttft_ms: float, prompt: int, matched: int, error: str = "", **breakdown) -> InferenceRun:
    case = "miss" if matched == 0 else ("full" if matched == prompt else "partial")
    full = {
        "case": case,
        "ttft_ms": ttft_ms,
        "prompt_tokens": prompt,
        "matched_tokens": matched,
        "cachebox": "ok",
        **breakdown,
    }
    return InferenceRun.objects.create(
        device=dev,
        error=error,
        breakdown={} if error else full,
        case="" if error else case,
        ttft_ms=0 if error else ttft_ms,
        prompt_tokens=prompt,
        matched_tokens=matched,
    )  # (save() fills the counters from the breakdown, as for a board's report)


def samples(body: str) -> dict:
    found = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def scrape(client) -> dict:
    response = client.get(reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    return samples(response.content.decode())


# -- metrics content -----------------------------------------------------------------------------
@pytest.fixture
def two_devices():
    zero, pi5 = device("zero"), device("pi5")
    device("idle")  # registered, never ran
    run(zero, 3.0, 100, 0, decision="catalog-miss", uploaded_bytes=1000)
    run(zero, 5.0, 100, 100, decision="fetch", fetched_bytes=5000)  # exactly on the 5 ms bound
    run(
        zero,
        40.0,
        200,
        64,
        decision="fetch",
        fetched_bytes=2000,
        uploaded_bytes=700,
        false_positives=2,
        rejected_entries=1,
    )
    run(zero, 1500.0, 50, 0, decision="no-cache", cachebox="off")
    run(zero, 45000.0, 80, 0, decision="cachebox-unavailable", cachebox="unavailable")  # over the last bound
    run(zero, 0.0, 0, 0, error="the prompt has 5000 tokens")
    run(pi5, 12.0, 300, 300, decision="fetch", fetched_bytes=9000, false_positives=1, rejected_entries=2)
    # No signing key: no lookup; nonsense numbers from a board count as nothing.
    run(pi5, 250.0, 300, 0, decision="no-signing-key", cachebox="no-key", uploaded_bytes="lots", false_positives=-3)


def test_counters_per_device_from_the_runs(client, two_devices):
    found = scrape(client)
    expected = {
        "edgecache_runs_total": {"zero": 6, "pi5": 2, "idle": 0},
        "edgecache_run_errors_total": {"zero": 1, "pi5": 0, "idle": 0},
        "edgecache_cache_lookups_total": {"zero": 4, "pi5": 1, "idle": 0},
        "edgecache_prompt_tokens_total": {"zero": 530, "pi5": 600, "idle": 0},
        "edgecache_fetched_bytes_total": {"zero": 7000, "pi5": 9000, "idle": 0},
        "edgecache_uploaded_bytes_total": {"zero": 1700, "pi5": 0, "idle": 0},
        "edgecache_catalog_false_positives_total": {"zero": 2, "pi5": 1, "idle": 0},
        "edgecache_integrity_failures_total": {"zero": 1, "pi5": 2, "idle": 0},
        "edgecache_cachebox_unavailable_runs_total": {"zero": 1, "pi5": 0, "idle": 0},
    }
    for name, per_device in expected.items():
        for dev, value in per_device.items():
            assert found[(name, (("device", dev), ("namespace", "default")))] == value, (name, dev)
    # Hit tokens by tier: these runs name no board-local tier, so the cache box served them.
    for dev, value in {"zero": 164, "pi5": 300, "idle": 0}.items():
        assert (
            found[("edgecache_hit_tokens_total", (("device", dev), ("namespace", "default"), ("tier", "cachebox")))]
            == value
        )
        assert (
            found[("edgecache_hit_tokens_total", (("device", dev), ("namespace", "default"), ("tier", "context")))] == 0
        )


def test_a_cancelled_run_is_counted_as_cancelled_not_as_an_error(client):
    from inference.contract.messages import CANCELLED

    zero = device("zero")
    run(zero, 30.0, 100, 0)
    run(zero, 0.0, 0, 0, error="the board failed: RuntimeError: boom")
    run(zero, 0.0, 0, 0, error=CANCELLED)
    found = scrape(client)
    labels = (("device", "zero"), ("namespace", "default"))
    assert found[("edgecache_runs_total", labels)] == 3
    assert found[("edgecache_run_errors_total", labels)] == 1 and found[("edgecache_runs_cancelled_total", labels)] == 1


def test_ttft_histogram_buckets_in_seconds(client, two_devices):
    found = scrape(client)

    def buckets(dev):
        return {
            le: value
            for (name, labels), value in found.items()
            if name == "edgecache_ttft_seconds_bucket"
            for key, le in labels
            if key == "le" and ("device", dev) in labels
        }

    # zero answered in 3 ms, 5 ms, 40 ms, 1.5 s and 45 s (the failed run is not a TTFT).
    assert buckets("zero") == {
        "0.005": 2,
        "0.01": 2,
        "0.025": 2,
        "0.05": 3,
        "0.1": 3,
        "0.25": 3,
        "0.5": 3,
        "1.0": 3,
        "2.5": 4,
        "5.0": 4,
        "10.0": 4,
        "20.0": 4,
        "30.0": 4,
        "+Inf": 5,
    }
    assert found[("edgecache_ttft_seconds_count", (("device", "zero"), ("namespace", "default")))] == 5
    assert found[("edgecache_ttft_seconds_sum", (("device", "zero"), ("namespace", "default")))] == pytest.approx(
        46.548
    )
    # pi5: 12 ms and 250 ms (on the 0.25 bound).
    assert buckets("pi5") == {
        "0.005": 0,
        "0.01": 0,
        "0.025": 1,
        "0.05": 1,
        "0.1": 1,
        "0.25": 2,
        "0.5": 2,
        "1.0": 2,
        "2.5": 2,
        "5.0": 2,
        "10.0": 2,
        "20.0": 2,
        "30.0": 2,
        "+Inf": 2,
    }
    assert found[("edgecache_ttft_seconds_sum", (("device", "pi5"), ("namespace", "default")))] == pytest.approx(0.262)
    assert buckets("idle")["+Inf"] == 0


def test_hit_tokens_say_their_tier_and_namespace_and_genai_names_are_exported(client):
    """Issue 28, B6: a context hit is not a cache-box hit, in /metrics too; OpenTelemetry's GenAI names."""
    from dashboard.models import Namespace

    Namespace.objects.get_or_create(name="tenant-b")
    zero = device("zero")
    bee = Device.objects.create(name="bee", token_sha256="0" * 64, namespace_id="tenant-b")
    run(
        zero, 20.0, 468, 468, decision="local", tier="context", context_tokens=468, generated_tokens=5, ttlt_ms=60.0
    )  # 10 ms/token
    run(
        zero,
        900.0,
        400,
        300,
        decision="fetch",
        tier="cachebox",
        context_tokens=100,
        fetched_tokens=200,
        fetched_bytes=4_000_000,
        generated_tokens=1,
        ttlt_ms=900.0,
    )
    run(
        bee, 30.0, 200, 128, decision="local", tier="local", local_tokens=128, generated_tokens=3, ttlt_ms=630.0
    )  # 300 ms/token
    found = scrape(client)
    hits = {
        (labels[0][1], labels[1][1], labels[2][1]): value
        for (name, labels), value in found.items()
        if name == "edgecache_hit_tokens_total"
    }
    assert (
        hits[("zero", "default", "context")] == 568
        and hits[("zero", "default", "cachebox")] == 200
        and hits[("zero", "default", "local")] == 0
    )
    assert hits[("bee", "tenant-b", "local")] == 128 and hits[("bee", "tenant-b", "cachebox")] == 0
    assert found[("gen_ai_usage_cache_read_input_tokens_total", (("device", "zero"), ("namespace", "default")))] == 768
    zero_labels = (("device", "zero"), ("namespace", "default"))
    assert found[("gen_ai_server_time_to_first_token_seconds_count", zero_labels)] == 2
    assert found[("gen_ai_server_time_to_first_token_seconds_sum", zero_labels)] == pytest.approx(0.92)
    # Time per output token after the first: only runs with two tokens or more.
    assert found[("gen_ai_server_time_per_output_token_seconds_count", zero_labels)] == 1
    assert found[("gen_ai_server_time_per_output_token_seconds_sum", zero_labels)] == pytest.approx(0.010)
    assert (
        found[
            ("gen_ai_server_time_per_output_token_seconds_bucket", (*zero_labels[:1], ("le", "0.01"), zero_labels[1]))
        ]
        == 1
    )
    bee_labels = (("device", "bee"), ("namespace", "tenant-b"))
    assert found[("gen_ai_server_time_per_output_token_seconds_sum", bee_labels)] == pytest.approx(0.300)


def test_collector_queries_do_not_grow_with_the_runs(two_devices, django_assert_max_num_queries):
    for _ in range(30):
        run(Device.objects.get(name="pi5"), 20.0, 10, 5, decision="fetch", fetched_bytes=1)
    with django_assert_max_num_queries(3):
        families = {family.name: family for family in metrics.RUNS.collect()}
    assert {s.labels["device"]: s.value for s in families["edgecache_runs"].samples}["pi5"] == 32


def test_collector_output_is_kept_for_the_configured_seconds(client, metrics_settings):
    zero = device("zero")
    run(zero, 10.0, 10, 0)
    metrics_settings.EDGECACHE_METRICS_CACHE_SECONDS = 60
    assert scrape(client)[("edgecache_runs_total", (("device", "zero"), ("namespace", "default")))] == 1
    run(zero, 10.0, 10, 0)
    assert scrape(client)[("edgecache_runs_total", (("device", "zero"), ("namespace", "default")))] == 1  # cached
    metrics_settings.EDGECACHE_METRICS_CACHE_SECONDS = 0
    assert scrape(client)[("edgecache_runs_total", (("device", "zero"), ("namespace", "default")))] == 2


# -- who may read them ------------------------------------------------------------------------------
def assert_refused(response, status: int):
    body = response.content.decode()
    assert response.status_code == status
    assert body.count("\n") == 1 and body.endswith("\n") and "edgecache_" not in body
    assert response["Content-Type"].startswith("text/plain")


def test_anonymous_requests_are_refused(client, two_devices, security_log):
    before = refused_count("login_required")
    response = client.get(reverse("metrics"))
    assert_refused(response, 401)
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert refused_count("login_required") == before + 1
    (line,) = security_log()
    assert (line["event"], line["reason"], line["status"], line["user"]) == (
        "metrics.refused",
        "login_required",
        401,
        None,
    )


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}x", "Bearer ", "Bearer", f"Basic {TOKEN}", TOKEN])
def test_wrong_tokens_are_refused(client, two_devices, security_log, header):
    before = refused_count("bad_metrics_token")
    assert_refused(client.get(reverse("metrics"), HTTP_AUTHORIZATION=header), 401)
    assert refused_count("bad_metrics_token") == before + 1
    assert [line["reason"] for line in security_log()] == ["bad_metrics_token"]


def test_a_token_is_refused_when_none_is_configured(client, metrics_settings):
    metrics_settings.EDGECACHE_METRICS_TOKEN = ""
    assert_refused(client.get(reverse("metrics"), HTTP_AUTHORIZATION="Bearer "), 401)
    assert_refused(client.get(reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}"), 401)


def test_a_wrong_token_is_refused_even_with_a_staff_session(staff_client):
    assert_refused(staff_client.get(reverse("metrics"), HTTP_AUTHORIZATION="Bearer nope"), 401)


def test_non_staff_users_are_refused(plain_client, two_devices, security_log):
    before = refused_count("staff_required")
    assert_refused(plain_client.get(reverse("metrics")), 403)
    assert refused_count("staff_required") == before + 1
    (line,) = security_log()
    assert (line["event"], line["reason"], line["user"]) == ("metrics.refused", "staff_required", "bob")


def test_the_token_gets_in(client, two_devices):
    response = client.get(reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]
    assert (
        samples(response.content.decode())[("edgecache_runs_total", (("device", "zero"), ("namespace", "default")))]
        == 6
    )
    openmetrics = client.get(
        reverse("metrics"),
        HTTP_AUTHORIZATION=f"Bearer {TOKEN}",
        HTTP_ACCEPT="application/openmetrics-text; version=1.0.0",
    )
    assert openmetrics["Content-Type"].startswith("application/openmetrics-text") and openmetrics.content.endswith(
        b"# EOF\n"
    )


def test_a_staff_login_gets_in(staff_client, two_devices):
    response = staff_client.get(reverse("metrics"))
    assert response.status_code == 200
    found = samples(response.content.decode())
    assert found[("edgecache_runs_total", (("device", "pi5"), ("namespace", "default")))] == 2
    assert ("edgecache_refused_requests_total", (("reason", "rate_limited"),)) in found


def test_metrics_are_read_only(staff_client):
    assert staff_client.post(reverse("metrics")).status_code == 405


def test_pages_count_the_logins_they_ask_for(client):
    before = refused_count("login_required")
    assert client.get(reverse("run")).status_code == 302
    assert refused_count("login_required") == before + 1


# -- the run rate limit ------------------------------------------------------------------------------
@pytest.fixture
def shared_cache(settings, valkey_url):
    """Django's cache on the session's Valkey, under a prefix of this test's own (removed after)."""
    prefix = f"edgecache-test-{uuid.uuid4().hex[:12]}"
    settings.CACHES = {
        "default": {
            "BACKEND": "dashboard.store.django_cache.CacheBoxRedisCache",
            "LOCATION": valkey_url,
            "KEY_PREFIX": prefix,
        }
    }
    settings.REDIS_URL = valkey_url
    settings.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [valkey_url]}}
    }
    channel_layers.backends.clear()
    server = redis.Redis.from_url(valkey_url)
    yield server, prefix
    caches["default"].clear()  # only this prefix
    assert not server.keys(f"{prefix}:*")
    channel_layers.backends.clear()


@pytest.fixture
def sent_tasks(monkeypatch):
    calls = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, args=None, queue=None, **kwargs: calls.append(queue))
    return calls


def run_form(dev: Device, text: str = "Hello there") -> dict:
    return {"devices": [dev.pk], "source": "text", "text": text, "max_tokens": 4, "use_cache": "on"}


@pytest.mark.cachebox
def test_the_run_after_the_limit_gets_429_and_dispatches_nothing(
    staff_client, settings, shared_cache, sent_tasks, security_log, monkeypatch
):
    server, prefix = shared_cache
    monkeypatch.setattr(ratelimit, "clock", lambda: 3_000_030.0)  # the four runs in one window, whenever the test runs
    settings.EDGECACHE_RUN_RATE = 3
    zero = device("zero")
    for _ in range(3):
        response = staff_client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json")
        assert response.status_code == 200
    before = (len(sent_tasks), InferenceRun.objects.count(), refused_count("rate_limited"))

    refused = staff_client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json")
    assert refused.status_code == 429
    wait = int(refused["Retry-After"])
    assert 1 <= wait <= 60 and refused.json()["retry_after"] == wait
    message = refused.json()["errors"]["__all__"][0]["message"]  # where the page's script shows form errors
    assert "at most 3 per minute" in message and f"try again in {wait} second" in message

    sent = run_form(zero, "Keep my words")
    del sent["use_cache"]  # unchecked
    page = staff_client.post(reverse("run"), sent)
    assert page.status_code == 429 and 1 <= int(page["Retry-After"]) <= 60
    html = page.content.decode()
    assert "at most 3 per minute" in html and "try again in" in html
    # The form as it was sent (not validated again).
    assert "Keep my words" in html and re.search(rf'name="devices" value="{zero.pk}"[^>]*checked', html)
    assert (
        page.context["form"].initial["text"] == "Keep my words" and page.context["form"].initial["use_cache"] is False
    )

    assert (len(sent_tasks), InferenceRun.objects.count()) == before[:2]  # nothing dispatched
    assert refused_count("rate_limited") == before[2] + 2
    # The counter lives in the shared server, where every web process sees it.
    (key,) = server.keys(f"{prefix}:*")
    assert b"ratelimit:run:" in key and int(server.get(key)) == 5
    lines = [line for line in security_log() if line["event"] == "run.rate_limited"]
    assert len(lines) == 2
    assert lines[0]["user"] == "alice" and lines[0]["limit_per_minute"] == 3 and lines[0]["requests"] == 4
    assert lines[0]["retry_after"] == wait and lines[0]["path"] == reverse("run") and lines[0]["time"].endswith("Z")


@pytest.mark.cachebox
def test_the_limit_is_per_user_and_per_minute(
    client, django_user_model, settings, shared_cache, sent_tasks, monkeypatch
):
    settings.EDGECACHE_RUN_RATE = 1
    zero = device("zero")
    alice = django_user_model.objects.create_user("alice", password="pw-alice-123")
    carol = django_user_model.objects.create_user("carol", password="pw-carol-123")
    from dashboard.models import Membership

    for user in (alice, carol):  # not staff: they may run on the boards of their namespaces
        Membership.objects.create(user=user, namespace_id="default")
    now = 1_800_000_000.0  # the start of a minute
    monkeypatch.setattr(ratelimit, "clock", lambda: now + 10)
    client.force_login(alice)
    assert client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json").status_code == 200
    refused = client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json")
    assert refused.status_code == 429 and refused["Retry-After"] == "50"
    client.force_login(carol)
    assert client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json").status_code == 200
    client.force_login(alice)
    monkeypatch.setattr(ratelimit, "clock", lambda: now + 60)  # the next minute
    assert client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json").status_code == 200
    assert len(sent_tasks) == 3


@pytest.mark.cachebox
def test_only_valid_submissions_count(staff_client, settings, shared_cache, sent_tasks):
    settings.EDGECACHE_RUN_RATE = 1
    zero = device("zero")
    for _ in range(3):  # refused by the form: nothing sent, nothing counted
        assert (
            staff_client.post(reverse("run"), run_form(zero, "   "), HTTP_ACCEPT="application/json").status_code == 400
        )
    assert staff_client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json").status_code == 200
    assert staff_client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json").status_code == 429
    assert sent_tasks == ["device.zero"]


def test_a_zero_rate_turns_the_limit_off(staff_client, settings, sent_tasks):
    settings.EDGECACHE_RUN_RATE = 0
    settings.EDGECACHE_QUEUE_PER_BOARD = 0  # no cache box here: no bounded queue to count in (admission fails closed)
    zero = device("zero")
    for _ in range(5):
        assert staff_client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json").status_code == 200
    assert len(sent_tasks) == 5


def test_an_unreachable_cache_still_limits_runs_in_this_process(staff_client, settings, sent_tasks):
    settings.CACHES = {
        "default": {
            "BACKEND": "dashboard.store.django_cache.CacheBoxRedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",
            "KEY_PREFIX": "t",
            "OPTIONS": {"socket_connect_timeout": 0.2},
        }
    }
    settings.EDGECACHE_RUN_RATE = 1
    settings.EDGECACHE_QUEUE_PER_BOARD = 0  # no cache box here: no bounded queue to count in (admission fails closed)
    zero = device("zero")
    assert staff_client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json").status_code == 200
    assert staff_client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json").status_code == 429
    assert sent_tasks == ["device.zero"]


@pytest.mark.cachebox
def test_clearing_the_django_cache_keeps_the_cache_box(shared_cache):
    server, prefix = shared_cache
    foreign = f"ec:test-foreign:{uuid.uuid4().hex}"
    server.set(foreign, b"entry", ex=60)
    caches["default"].set("something", 1)
    assert server.keys(f"{prefix}:*")
    caches["default"].clear()
    assert not server.keys(f"{prefix}:*") and server.get(foreign) == b"entry"
    server.delete(foreign)


def test_the_settings_put_djangos_cache_on_the_cache_box_server():
    from django.core.cache.backends.redis import RedisCache
    from django.utils.module_loading import import_string

    from dashboard import settings as configured  # the module: tests run with CACHES swapped (conftest)

    default = configured.CACHES["default"]
    assert default["LOCATION"] == configured.REDIS_URL and default["KEY_PREFIX"]
    assert issubclass(import_string(default["BACKEND"]), RedisCache)


# -- the JSON security log ------------------------------------------------------------------------------
def test_security_events_are_one_json_object_per_line(security_log):
    security_event(
        "entry.rejected",
        key="ec:e:x",
        reason='bad checksum\n{"event": "forged"}',
        time="user-given",
        size=12,
        blob=b"\x00",
    )
    (line,) = security_log()
    assert line["event"] == "entry.rejected" and line["level"] == "warning"
    assert line["reason"].startswith("bad checksum\n") and line["size"] == 12 and line["blob"] == "b'\\x00'"
    assert line["field_time"] == "user-given" and line["time"].endswith("Z") and line["time"] != "user-given"


def test_the_events_module_is_a_pure_library():
    code = (
        "import sys, cachebox.events\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'dashboard', 'inference'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- issue 42, item 10: a refusal names the setting, and says when metrics by token are off ----------
def test_a_refused_scraper_is_told_which_setting_holds_the_token(client, metrics_settings):
    for header in ({}, {"HTTP_AUTHORIZATION": "Bearer nope"}, {"HTTP_AUTHORIZATION": f"Basic {TOKEN}"}):
        answer = client.get(reverse("metrics"), **header).content.decode()
        assert "EDGECACHE_METRICS_TOKEN" in answer, header
    metrics_settings.EDGECACHE_METRICS_TOKEN = ""
    for header in ({}, {"HTTP_AUTHORIZATION": "Bearer anything"}):
        response = client.get(reverse("metrics"), **header)
        answer = response.content.decode()
        assert response.status_code == 401 and "Wrong metrics token" not in answer, header
        assert (
            answer.startswith("Metrics by token are off: EDGECACHE_METRICS_TOKEN is not set")
            and "To turn them on, set it" in answer
        )

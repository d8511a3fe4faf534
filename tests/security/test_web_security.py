"""Security of the control plane's web side: who sees which tenant (pages and live events), no
token characters after creation, login throttling, HTTPS settings, secret and database files,
a broker outage on the Run and encode pages, and the first admin's password.

Devices and runs are created straight in the database (no board needed); the live socket runs
on the test session's real Valkey; settings and files are checked in fresh processes.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from celery import Celery
from channels.testing import WebsocketCommunicator
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from kombu.exceptions import OperationalError

from dashboard.celery import app as celery_app
from dashboard.live.broadcast import broadcast
from dashboard.live.consumers import LiveConsumer
from dashboard.management.commands import run as run_command
from dashboard.models import Device, InferenceRun, Membership, Namespace
from inference.board.app import celery_settings
from tests.conftest import ROOT, run_manage
from tests.dashboard.test_dashboard import TRAVEL, control_plane, sent_tasks, staff_client  # noqa: F401  (fixtures)

DEAD_BROKER = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def device(name: str, namespace: str = "default", **fields) -> Device:
    Namespace.objects.get_or_create(name=namespace)
    return Device.objects.create(name=name, namespace_id=namespace, token_sha256="0" * 64, **fields)


def a_run(dev: Device, ttft_ms: float = 50.0) -> InferenceRun:
    breakdown = {
        "case": "full",
        "ttft_ms": ttft_ms,
        "ttlt_ms": ttft_ms + 10,
        "prompt_tokens": 100,
        "matched_tokens": 100,
        "prefill_ms": 0.0,
        "redis_ms": 5.0,
    }
    return InferenceRun.objects.create(
        device=dev,
        title=f"run on {dev.name}",
        breakdown=breakdown,
        case="full",
        ttft_ms=ttft_ms,
        prompt_tokens=100,
        matched_tokens=100,
    )


def member_of(django_user_model, username: str, *namespaces: str):
    user = django_user_model.objects.create_user(username, password=f"pw-{username}-123")
    for namespace in namespaces:
        Membership.objects.create(user=user, namespace=Namespace.objects.get_or_create(name=namespace)[0])
    return user


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def tenants(db):
    """Two tenants: acme (device acme-1, with a run) and globex (device globex-1, with a run)."""
    acme, globex = device("acme-1", "acme"), device("globex-1", "globex")
    a_run(acme, 40.0)
    a_run(globex, 70.0)
    return acme, globex


# -- 1. users see the namespaces they are members of; staff see all ------------------------------------
@pytest.mark.cachebox
@pytest.mark.django_db
def test_a_member_sees_only_the_devices_and_runs_of_their_namespaces(control_plane, tenants, django_user_model):
    bob = logged_in(member_of(django_user_model, "bob", "acme"))

    home = bob.get(reverse("home"))
    assert [s["device"].name for s in home.context["summaries"]] == ["acme-1"]
    assert [run.device.name for run in home.context["runs"]] == ["acme-1"]
    charts = home.context["chart_data"]
    assert charts["hitCounts"] == {"acme-1": [1, 1]}
    assert {trace["name"] for trace in charts["timeline"]["data"]} == {"acme-1 TTFT", "acme-1 TTLT"}
    assert "globex" not in home.content.decode()

    listing = bob.get(reverse("devices"))
    assert [s["device"].name for s in listing.context["summaries"]] == [
        "acme-1"
    ] and "globex" not in listing.content.decode()
    assert bob.get(reverse("device-detail", args=["acme-1"])).status_code == 200
    assert bob.get(reverse("device-detail", args=["globex-1"])).status_code == 404  # as if it did not exist
    assert bob.get(reverse("device-breakeven", args=["globex-1"])).status_code == 404

    run_page = bob.get(reverse("run"))
    assert [d.name for d in run_page.context["form"].fields["devices"].queryset] == ["acme-1"]
    assert [run.device.name for run in run_page.context["runs"]] == [
        "acme-1"
    ] and "globex" not in run_page.content.decode()


@pytest.mark.cachebox
@pytest.mark.django_db
def test_staff_see_every_namespace_and_a_user_without_membership_sees_none(
    control_plane, tenants, staff_client, django_user_model
):
    home = staff_client.get(reverse("home"))
    assert [s["device"].name for s in home.context["summaries"]] == ["acme-1", "globex-1"]
    assert staff_client.get(reverse("device-detail", args=["globex-1"])).status_code == 200

    nobody = logged_in(member_of(django_user_model, "nobody"))
    page = nobody.get(reverse("home"))
    assert page.context["summaries"] == [] and page.context["runs"] == []
    assert "a staff member adds you to a namespace" in page.content.decode()
    assert nobody.get(reverse("device-detail", args=["acme-1"])).status_code == 404


@pytest.mark.cachebox
@pytest.mark.django_db
def test_a_run_naming_another_tenants_device_is_refused_with_a_form_error(
    control_plane, tenants, sent_tasks, django_user_model
):
    acme, globex = tenants
    bob = logged_in(member_of(django_user_model, "bob", "acme"))
    form = {"source": "text", "text": "Hello", "max_tokens": 4, "use_cache": "on"}

    refused = bob.post(reverse("run"), {**form, "devices": [globex.pk]}, HTTP_ACCEPT="application/json")
    assert (
        refused.status_code == 400
        and "not one of the available choices" in refused.json()["errors"]["devices"][0]["message"]
    )
    page = bob.post(reverse("run"), {**form, "devices": [acme.pk, globex.pk]})
    assert page.status_code == 400 and "devices" in page.context["form"].errors
    other_namespace = bob.post(
        reverse("run"), {**form, "devices": [acme.pk], "namespace": "globex"}, HTTP_ACCEPT="application/json"
    )
    assert (
        other_namespace.status_code == 400
        and "not one of yours" in other_namespace.json()["errors"]["namespace"][0]["message"]
    )
    assert sent_tasks == []

    sent = bob.post(reverse("run"), {**form, "devices": [acme.pk]}, HTTP_ACCEPT="application/json")
    assert sent.status_code == 200 and [call["queue"] for call in sent_tasks] == ["device.acme-1"]


@pytest.mark.cachebox
@pytest.mark.django_db
def test_memberships_are_managed_in_the_user_admin(control_plane, staff_client, django_user_model):
    staff_client.user.is_superuser = True
    staff_client.user.save()
    bob = member_of(django_user_model, "bob", "acme")
    page = staff_client.get(reverse("admin:auth_user_change", args=[bob.pk]))
    assert (
        page.status_code == 200
        and "namespaces this user sees (staff see every namespace)" in page.content.decode().lower()
    )
    assert staff_client.get(reverse("admin:dashboard_membership_changelist")).status_code == 200


def _listen(user):
    communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/live/")
    communicator.scope["user"] = user
    return communicator


# Transactional: the consumer reads the database through database_sync_to_async, which closes the
# connection around each call; inside a plain django_db test's transaction that breaks the second
# call on PostgreSQL (a test artefact: pages have no surrounding transaction).
@pytest.mark.cachebox
@pytest.mark.django_db(transaction=True, serialized_rollback=True)
def test_live_events_reach_only_pages_that_may_see_their_device(control_plane, django_user_model):
    device("acme-1", "acme")
    globex = device("globex-1", "globex")
    bob = member_of(django_user_model, "bob", "acme")
    alice = django_user_model.objects.create_user("alice", password="pw-alice-123", is_staff=True)

    async def scenario():
        bob_page, alice_page = _listen(bob), _listen(alice)
        assert (await bob_page.connect())[0] and (await alice_page.connect())[0]
        await sync_to_async(broadcast)("run", {"device": "globex-1", "text": "globex secret"})
        await sync_to_async(broadcast)("encode.progress", {"device": "globex-1", "done": 1, "total": 2})
        await sync_to_async(broadcast)("device", {"name": "globex-1", "online": True})
        await sync_to_async(broadcast)("run", {"device": "acme-1", "text": "acme answer"})
        bob_got = await bob_page.receive_json_from(timeout=5)
        assert await bob_page.receive_nothing(timeout=0.3)
        alice_got = [await alice_page.receive_json_from(timeout=5) for _ in range(4)]

        # Moved into bob's namespace: the next device event refreshes what his page may see.
        await sync_to_async(Device.objects.filter(pk=globex.pk).update)(namespace_id="acme")
        await sync_to_async(broadcast)("device", {"name": "globex-1", "online": True})
        await sync_to_async(broadcast)("run", {"device": "globex-1", "text": "now acme's"})
        bob_after = [await bob_page.receive_json_from(timeout=5) for _ in range(2)]
        await bob_page.disconnect()
        await alice_page.disconnect()
        return bob_got, alice_got, bob_after

    bob_got, alice_got, bob_after = async_to_sync(scenario)()
    assert bob_got == {"event": "run", "data": {"device": "acme-1", "text": "acme answer"}}
    assert [event["event"] for event in alice_got] == ["run", "encode.progress", "device", "run"]
    assert [(event["event"], event["data"].get("device") or event["data"].get("name")) for event in bob_after] == [
        ("device", "globex-1"),
        ("run", "globex-1"),
    ]


# -- 2. no token characters after creation ------------------------------------------------------------
@pytest.mark.cachebox
@pytest.mark.django_db
def test_the_device_page_shows_no_token_characters_and_says_whether_the_board_enrolled(control_plane, staff_client):
    waiting = device("zero")
    page = staff_client.get(waiting.get_absolute_url()).content.decode()
    assert "not enrolled yet: start its board with the token shown at registration (or rotate the token)" in page
    assert "no signing keys" not in page and "…</code>" not in page  # the old token_hint, "abc123…"
    enrolled = device("pi5", enrolled_at=timezone.now())
    assert "not enrolled yet" not in staff_client.get(enrolled.get_absolute_url()).content.decode()


# -- 3. login throttling -------------------------------------------------------------------------------
@pytest.mark.django_db
def test_logins_lock_after_five_failures_and_say_when_to_retry(django_user_model, settings):
    assert (settings.AXES_FAILURE_LIMIT, settings.AXES_COOLOFF_TIME) == (5, timedelta(minutes=15))
    django_user_model.objects.create_user("carol", password="pw-carol-123")
    django_user_model.objects.create_user("dave", password="pw-dave-123")
    login = reverse("login")
    client = Client()
    statuses = [client.post(login, {"username": "carol", "password": f"wrong-{i}"}).status_code for i in range(6)]
    assert statuses == [200, 200, 200, 200, 429, 429]  # the fifth failure locks

    before = timezone.now()
    right = client.post(login, {"username": "carol", "password": "pw-carol-123"})
    assert right.status_code == 429 and "_auth_user_id" not in client.session
    html = right.content.decode()
    retry_at = right.context["retry_at"]
    assert before + timedelta(minutes=14, seconds=55) <= retry_at <= timezone.now() + timedelta(minutes=15)
    assert "Too many failed logins for <strong>carol</strong>" in html and "locked until" in html
    assert retry_at.strftime("%Y-%m-%d %H:%M:%S") in html
    assert 890 <= int(right["Retry-After"]) <= 900

    # Another user from the same address, and carol from another address, are not affected.
    assert client.post(login, {"username": "dave", "password": "pw-dave-123"}).status_code == 302
    elsewhere = Client(REMOTE_ADDR="10.1.2.3")
    assert elsewhere.post(login, {"username": "carol", "password": "pw-carol-123"}).status_code == 302


@pytest.mark.django_db
def test_a_successful_login_resets_the_failure_count(django_user_model):
    django_user_model.objects.create_user("carol", password="pw-carol-123")
    login, client = reverse("login"), Client()
    for i in range(4):
        client.post(login, {"username": "carol", "password": f"wrong-{i}"})
    assert client.post(login, {"username": "carol", "password": "pw-carol-123"}).status_code == 302
    client.logout()
    for i in range(4):  # four more failures: still under the limit, as the success reset the count
        assert client.post(login, {"username": "carol", "password": f"wrong-again-{i}"}).status_code == 200
    assert client.post(login, {"username": "carol", "password": "pw-carol-123"}).status_code == 302


# -- 4. HTTPS settings ---------------------------------------------------------------------------------
def _production_env(tmp_path, **extra) -> dict:
    return {
        "EDGECACHE_HOME": str(tmp_path / "home"),
        "DJANGO_SECRET_KEY": "s" * 20 + uuid.uuid4().hex + "k" * 20,
        "DJANGO_ALLOWED_HOSTS": "edgecache.example.com",
        **extra,
    }


HTTPS_WARNINGS = ("security.W004", "security.W008", "security.W012", "security.W016")


@pytest.mark.processes
def test_https_settings_pass_the_deploy_check(tmp_path):
    plain = run_manage("check", "--deploy", env=_production_env(tmp_path), unset=("DJANGO_DEBUG", "EDGECACHE_HTTPS"))
    assert all(
        code in plain.stderr.decode() + plain.stdout.decode() for code in HTTPS_WARNINGS
    )  # the default: plain HTTP

    https = run_manage("check", "--deploy", env=_production_env(tmp_path, EDGECACHE_HTTPS="1"), unset=("DJANGO_DEBUG",))
    output = https.stderr.decode() + https.stdout.decode()
    assert https.returncode == 0, output
    assert not [code for code in HTTPS_WARNINGS if code in output], output


def test_behind_a_proxy_the_forwarded_scheme_is_trusted(tmp_path):
    code = "from django.conf import settings as s; print(s.SECURE_PROXY_SSL_HEADER, s.SECURE_HSTS_SECONDS, s.SECURE_SSL_REDIRECT)"
    shown = run_manage(
        "shell",
        "-c",
        code,
        env=_production_env(tmp_path, EDGECACHE_HTTPS="1", EDGECACHE_BEHIND_PROXY="1", EDGECACHE_HSTS_SECONDS="600"),
    )
    assert shown.stdout.decode().splitlines()[-1] == "('HTTP_X_FORWARDED_PROTO', 'https') 600 True", (
        shown.stderr.decode()
    )


# -- 5. secret files appear whole ----------------------------------------------------------------------
SECRET_PROBE = """
import hashlib, importlib, os, sys, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
import dj_database_url, cachebox.embedded, inference.board.config, inference.board.app, dashboard  # the slow imports, before the start line
start, homes, rounds = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
settings = None
for round in range(rounds):  # each round: every process loads the settings at the same moment, on a new folder
    os.environ["EDGECACHE_HOME"] = os.path.join(homes, str(round))
    while time.time() < start + 0.5 * round:
        time.sleep(0.0005)
    settings = importlib.import_module("dashboard.settings") if settings is None else importlib.reload(settings)
    print(round, hashlib.sha256(settings.EDGECACHE_SIGNING_SECRET).hexdigest(), hashlib.sha256(settings.SECRET_KEY.encode()).hexdigest(), flush=True)
"""
ROUNDS = 4


@pytest.mark.processes
def test_processes_starting_together_read_the_same_complete_secrets(tmp_path):
    """40 processes create the secrets at the same moment, on 4 fresh folders in turn: every
    process must read the same, complete secrets (touch-then-write let some read an empty one)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DJANGO_SECRET_KEY", "EDGECACHE_SIGNING_SECRET", "DATABASE_URL")
    }
    start = time.time() + 12  # every process has imported what it needs by then, and they race
    command = [sys.executable, "-c", SECRET_PROBE, str(start), str(tmp_path), str(ROUNDS)]
    processes = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(40)
    ]
    results = [process.communicate(timeout=180) for process in processes]
    failures = [err.decode()[-300:] for process, (_, err) in zip(processes, results) if process.returncode != 0]
    assert not failures, failures
    empty = hashlib.sha256(b"").hexdigest()
    for round in range(ROUNDS):
        printed = {line for out, _ in results for line in out.decode().splitlines() if line.split()[0] == str(round)}
        assert len(printed) == 1 and empty not in printed.pop(), (round, printed)
        home = tmp_path / f"{round}-secrets"  # the secrets folder, beside the state folder
        for name in ("signing_secret", "secret_key"):
            assert stat.S_IMODE((home / name).stat().st_mode) == 0o600 and len((home / name).read_text()) > 40
        assert not (tmp_path / str(round) / "signing_secret").exists()  # nothing of them in the state folder
        assert not [path.name for path in home.iterdir() if path.name.startswith(".")]  # no temporary file left


# -- 6. database file 0600, .edgecache/ 0700 -----------------------------------------------------------
def _manage_with_umask(*args: str, home) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}  # the SQLite default
    env["EDGECACHE_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=180,
        preexec_fn=lambda: os.umask(0o022),
    )


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.processes
def test_a_new_sqlite_database_and_its_folder_are_private(tmp_path):
    home = tmp_path / "fresh" / ".edgecache"
    done = _manage_with_umask("migrate", "--noinput", home=home)
    assert done.returncode == 0, done.stderr.decode()[-1000:]
    database = home / "db.sqlite3"
    assert database.stat().st_size > 0  # migrated: a real database
    assert (_mode(database), _mode(home)) == (0o600, 0o700)


@pytest.mark.processes
def test_an_existing_more_open_database_and_folder_are_closed_down(tmp_path):
    home = tmp_path / ".edgecache"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    database = home / "db.sqlite3"
    database.touch()
    database.chmod(0o644)
    done = _manage_with_umask("check", home=home)
    assert done.returncode == 0, done.stderr.decode()[-1000:]
    assert (_mode(database), _mode(home)) == (0o600, 0o700)


# -- 7. the broker down: 503 with what to do, never a 500 ----------------------------------------------
@pytest.fixture
def dead_broker(monkeypatch):
    """The control plane's Celery app pointed at a port nothing listens on (kombu raises OperationalError)."""
    from dashboard import outbox

    app = Celery("dead-broker", set_as_current=False)
    app.conf.update(celery_settings(DEAD_BROKER))
    monkeypatch.setattr(outbox, "app", app)
    return app


def run_form(*devices: Device) -> dict:
    return {
        "devices": [d.pk for d in devices],
        "source": "text",
        "text": "Hello there",
        "max_tokens": 4,
        "use_cache": "on",
    }


@pytest.mark.cachebox
@pytest.mark.django_db
def test_a_run_while_the_broker_is_down_answers_503_json_with_what_to_do(control_plane, staff_client, dead_broker):
    zero = device("zero")
    response = staff_client.post(reverse("run"), run_form(zero), HTTP_ACCEPT="application/json")
    assert response.status_code == 503 and response["Content-Type"] == "application/json"
    assert int(response["Retry-After"]) > 0 and response.json()["retry_after"] == int(response["Retry-After"])
    message = response.json()["errors"]["__all__"][0]["message"]  # where the page's script shows errors
    assert (
        "message broker" in message and "not reachable" in message and "make run" in message and "REDIS_URL" in message
    )
    assert "nothing was sent" in message and control_plane.safe_url in message
    assert response.json()["dispatched"] == []


@pytest.mark.cachebox
@pytest.mark.django_db
def test_a_run_while_the_broker_is_down_answers_503_html_with_the_form_as_sent(
    control_plane, staff_client, dead_broker
):
    zero = device("zero")
    page = staff_client.post(reverse("run"), run_form(zero))
    assert page.status_code == 503 and page["Retry-After"]
    html = page.content.decode()
    assert "not reachable" in html and "nothing was sent" in html and "Hello there" in html


@pytest.mark.cachebox
@pytest.mark.django_db
def test_a_broker_failing_midway_says_which_devices_got_the_run(control_plane, staff_client, monkeypatch):
    zero, pi5 = device("zero"), device("pi5")
    queues = []

    def send_once(name, args=None, queue=None, **kwargs):
        if queues:
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        queues.append(queue)

    monkeypatch.setattr(celery_app, "send_task", send_once)
    response = staff_client.post(reverse("run"), run_form(pi5, zero), HTTP_ACCEPT="application/json")
    assert response.status_code == 503
    first, second = [
        d.name for d in Device.objects.filter(pk__in=[zero.pk, pi5.pk]).order_by("name")
    ]  # the form's order
    assert f"sent to {first} only; not sent to {second}" in response.json()["errors"]["__all__"][0]["message"]
    assert [item["device"] for item in response.json()["dispatched"]] == [first]


@pytest.mark.cachebox
@pytest.mark.django_db
def test_encoding_while_the_broker_is_down_answers_503(control_plane, staff_client, dead_broker):
    from dashboard.models import Schema
    from inference.serving.pml import parse_schema

    zero = device("zero")
    schema = Schema.objects.create(name="travel", source=TRAVEL, digest=parse_schema(TRAVEL).digest)
    url = reverse("schema-encode", args=[schema.pk])
    as_json = staff_client.post(url, {"devices": [zero.pk]}, HTTP_ACCEPT="application/json")
    assert as_json.status_code == 503 and as_json["Retry-After"]
    assert "nothing was sent" in as_json.json()["errors"]["__all__"][0]["message"]
    page = staff_client.post(url, {"devices": [zero.pk]})
    assert (
        page.status_code == 503
        and "not reachable" in page.content.decode()
        and schema.get_absolute_url() in page.content.decode()
    )


# -- 8. the first admin's password ---------------------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.parametrize(
    "weak, reason",
    [("abc12", "too short"), ("password123", "too common"), ("admin2024", "too similar to the username")],
)
def test_a_weak_admin_password_is_refused_with_the_validators_messages(weak, reason):
    with pytest.raises(CommandError, match=reason) as refused:
        run_command.checked_admin_password(weak)
    assert "EDGECACHE_ADMIN_PASSWORD" in str(refused.value) and "unset it" in str(refused.value)


def test_a_strong_or_unset_admin_password_passes():
    assert run_command.checked_admin_password("correct horse battery staple 7") == "correct horse battery staple 7"
    assert run_command.checked_admin_password(None) is None and run_command.checked_admin_password("") is None


@pytest.mark.django_db
def test_run_stops_on_a_weak_admin_password_before_starting_anything(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("the cache box was started")

    monkeypatch.setattr(run_command.actions, "start_cachebox", started)
    monkeypatch.setenv("EDGECACHE_ADMIN_PASSWORD", "12345678")
    with pytest.raises(CommandError, match="EDGECACHE_ADMIN_PASSWORD is refused"):
        call_command("run", "--no-boards", "--port", "1")


def test_static_files_are_served_on_the_async_path_without_a_thread_hop_per_request():
    """WhiteNoise's own middleware is sync only: Django then ran every request, the API's too,
    through a worker thread and back. Ours is called on the event loop for async requests."""
    import asyncio

    from asgiref.sync import iscoroutinefunction
    from django.http import HttpResponse
    from django.test import RequestFactory

    from dashboard.middleware import AsyncWhiteNoiseMiddleware

    async def view(request):
        return HttpResponse(b"the view")

    middleware = AsyncWhiteNoiseMiddleware(view)
    assert iscoroutinefunction(middleware)  # Django puts no sync adapter around it
    static = asyncio.run(middleware(RequestFactory().get("/static/css/edgecache.css")))
    assert static.status_code == 200 and static["Content-Type"].startswith("text/css")
    passed_on = asyncio.run(middleware(RequestFactory().get("/v1/models")))
    assert passed_on.content == b"the view"
    assert (
        AsyncWhiteNoiseMiddleware(lambda request: HttpResponse(b"sync view"))(RequestFactory().get("/")).content
        == b"sync view"
    )

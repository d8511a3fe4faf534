"""The pages an operator lives in, second walk (issue 42): what a page says and which defaults it
takes, server side. Real Valkey (cache box and broker); Celery's send_task is captured where no
broker queue is read. What the browser shows is in tests/browser/test_browser_walk.py.

Each test names the item of the issue it checks; each fails on the pages before it.
"""

from __future__ import annotations

import re

import pytest
from celery import Celery
from django.urls import reverse

from dashboard import actions
from dashboard.models import Device, Dispatch, Membership, Namespace
from dashboard.store.mirror import reconcile
from tests.dashboard.test_dashboard import (  # noqa: F401 (fixtures)
    TRAVEL,
    control_plane,
    enrolled,
    heartbeat,
    register,
    sent_tasks,
    staff_client,
    store_entry,
)

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]

FINGERPRINT = "00ff00ff00ff00ff"


def tenant(name: str) -> Namespace:
    namespace = Namespace(name=name)
    actions.save_namespace(None, namespace)
    return namespace


def member_client(client, django_user_model, *namespaces: str, name: str = "walker"):
    user = django_user_model.objects.create_user(name, password=f"pw-{name}-123")
    for namespace in namespaces:
        Membership.objects.create(user=user, namespace_id=namespace)
    client.force_login(user)
    return client


def online(device: Device, token: str) -> Device:
    keys = enrolled(device, token)
    status = {"model": "gemma-3-270m.gguf", "fingerprint": FINGERPRINT, "catalogs": {}}
    assert actions.record_heartbeat(heartbeat(keys, status, device=device.name)) is not None
    device.refresh_from_db()
    return device


# -- 7. the Run page's options ---------------------------------------------------------------------
def test_an_unknown_namespace_is_a_form_error_and_nothing_is_sent(staff_client, control_plane, sent_tasks):
    device, _ = register("zero")
    data = {"devices": [device.pk], "source": "text", "text": "Hello", "max_tokens": 4, "namespace": "defualt"}
    response = staff_client.post(reverse("run"), data, HTTP_ACCEPT="application/json")
    assert response.status_code == 400
    (error,) = response.json()["errors"]["namespace"]
    assert error["message"].startswith("There is no namespace 'defualt'") and "leave it empty" in error["message"]
    assert sent_tasks == [] and not Dispatch.objects.exists()


def test_a_namespace_the_ticked_board_does_not_serve_is_a_form_error(staff_client, control_plane, sent_tasks):
    tenant("walk-t2")
    device, _ = register("zero")
    data = {"devices": [device.pk], "source": "text", "text": "Hello", "max_tokens": 4, "namespace": "walk-t2"}
    response = staff_client.post(reverse("run"), data, HTTP_ACCEPT="application/json")
    assert response.status_code == 400
    assert (
        "zero serves another namespace and would refuse a run of 'walk-t2'"
        in response.json()["errors"]["namespace"][0]["message"]
    )
    assert sent_tasks == []


def test_greedy_is_said_beside_temperature_and_the_namespace_box_has_help(staff_client, control_plane):
    page = staff_client.get(reverse("run")).content.decode()
    temperature, greedy, top_p, seed = (
        page.index(marker) for marker in ('id="id_temperature"', "0: greedy", 'id="id_top_p"', 'id="id_seed"')
    )
    assert temperature < greedy < top_p < seed  # the help follows Temperature, not Seed
    namespace_box = page.index('id="id_namespace"')
    assert "A board serves its own namespace only" in page[namespace_box : namespace_box + 1200]


def test_any_board_for_a_user_of_no_namespace_is_a_form_error(client, django_user_model, control_plane, sent_tasks):
    register("zero")
    stranger = member_client(client, django_user_model)  # a member of nothing
    response = stranger.post(
        reverse("run"),
        {"any_board": "on", "source": "text", "text": "Hello", "max_tokens": 4},
        HTTP_ACCEPT="application/json",
    )
    assert (
        response.status_code == 400 and "member of no namespace" in response.json()["errors"]["any_board"][0]["message"]
    )
    assert sent_tasks == []


# -- 6. the Cache page's flush form ------------------------------------------------------------------
def selected_namespace(page: str) -> str:
    form = page[page.index('id="flush-form"') :]
    select = form[form.index('name="namespace"') : form.index("</select>")]
    return re.search(r'<option value="([^"]*)"[^>]*selected', select).group(1)


def test_the_flush_form_opens_on_the_current_namespace_and_every_namespace_takes_typed_words(
    staff_client, control_plane, namespace
):
    tenant(namespace)
    other = tenant("walk-t2")
    ours, theirs = store_entry(control_plane, namespace)[0], store_entry(control_plane, other.name)[0]
    reconcile(control_plane)
    page = staff_client.get(reverse("cache")).content.decode()
    assert selected_namespace(page) == "default"  # the staff's current namespace, not every namespace
    assert (
        selected_namespace(staff_client.get(reverse("cache") + f"?namespace={namespace}").content.decode()) == namespace
    )
    assert selected_namespace(staff_client.get(reverse("cache")).content.decode()) == namespace  # remembered

    model = FINGERPRINT
    ticked_only = staff_client.post(
        reverse("cache-flush"), {"namespace": "*", "model": model, "confirm": "on"}, follow=True
    ).content.decode()
    assert "type “every namespace” to confirm" in ticked_only
    assert control_plane.redis.exists(ours) and control_plane.redis.exists(theirs)  # a tick alone deletes nothing

    # One namespace: flushed, and the page comes back on it.
    response = staff_client.post(reverse("cache-flush"), {"namespace": namespace, "confirm": "on"})
    assert response.status_code == 302 and response["Location"].endswith(f"?namespace={namespace}")
    assert not control_plane.redis.exists(ours) and control_plane.redis.exists(theirs)

    # Every namespace, typed: flushed, and the page comes back on the current namespace.
    response = staff_client.post(
        reverse("cache-flush"), {"namespace": "*", "model": model, "confirm": "on", "confirm_every": "Every namespace"}
    )
    assert response.status_code == 302 and not control_plane.redis.exists(theirs)
    assert selected_namespace(staff_client.get(response["Location"]).content.decode()) == namespace
    control_plane.flush("walk-t2")


# -- 8. a member who is not staff ---------------------------------------------------------------------
def test_a_member_of_a_namespace_without_boards_is_told_who_registers_them(client, django_user_model, control_plane):
    tenant("walk-t2")
    register("zero")  # a board of default: not theirs
    member = member_client(client, django_user_model, "walk-t2")
    for name in ("home", "devices", "run"):
        page = member.get(reverse(name)).content.decode()
        assert "Your namespace walk-t2 has no boards yet." in page, name
        assert "Only staff register boards: ask a staff member" in page, name
        assert "adds you to a namespace" not in page, name


def test_a_member_is_not_told_to_start_a_board_with_a_token_they_do_not_hold(client, django_user_model, control_plane):
    tenant("walk-t2")
    register("walk-t2b", namespace_id="walk-t2")  # registered by staff, never started
    member = member_client(client, django_user_model, "walk-t2")
    page = member.get(reverse("device-detail", args=["walk-t2b"])).content.decode()
    assert "a staff member starts its board (they hold its token)" in page
    assert "token shown at registration" not in page, [
        line for line in page.splitlines() if "token shown at registration" in line
    ]


def test_staff_pages_give_a_member_a_clear_403_and_a_stranger_the_login(client, django_user_model, control_plane):
    tenant("walk-t2")
    assert client.get(reverse("schema-new"))["Location"].startswith(reverse("login") + "?next=/schemas/new/")
    member = member_client(client, django_user_model, "walk-t2")
    for path in (reverse("schema-new"), reverse("device-register"), reverse("cache")):
        response = member.get(path)
        assert response.status_code == 403, path
        page = response.content.decode()
        assert (
            "For staff only" in page
            and "only staff register boards, write and encode schemas" in page
            and "a member of walk-t2" in page
        )
        assert "/admin/login/" not in page


# -- 3. the schema page's cache status is said for the namespace it is for ---------------------------------
@pytest.mark.model
def test_the_schema_page_shows_the_boards_of_one_namespace_and_says_which(staff_client, control_plane):
    tenant("walk-t2")
    staff_client.post(reverse("schema-new"), {"source": TRAVEL})
    from dashboard.models import Schema

    schema = Schema.objects.get()
    for name, namespace in (("zero", "default"), ("walk-t2b", "walk-t2")):
        device, _ = register(name, namespace_id=namespace)
        Device.objects.filter(pk=device.pk).update(status={"model": "gemma-3-270m.gguf", "fingerprint": FINGERPRINT})
    page = staff_client.get(schema.get_absolute_url())
    assert [device.name for device in page.context["devices"]] == ["zero"]
    text = page.content.decode()
    assert "cached on walk-t2b" not in text and "for each board of namespace <strong>default</strong>" in text
    assert "in the default namespace" not in text
    other = staff_client.get(schema.get_absolute_url() + "?namespace=walk-t2")
    assert [device.name for device in other.context["devices"]] == ["walk-t2b"]
    assert "for each board of namespace <strong>walk-t2</strong>" in other.content.decode()


# -- 10. the Queue page, Revoke, the login page ---------------------------------------------------------
def test_the_queue_page_shows_each_runs_real_state(staff_client, control_plane, sent_tasks, valkey_url, settings):
    """Three runs to one board: the board took the first (running), the others wait in its queue."""
    settings.REDIS_URL = valkey_url  # the broker the page reads
    device = online(*register("zero"))
    sent = [
        actions.dispatch_run(
            None, [device], actions.run_request(segments=[f"Prompt {n}"], max_tokens=2, title=f"run {n}")
        )[0]
        for n in range(3)
    ]
    assert [task["task_id"] for task in sent_tasks] == [
        item["request_id"] for item in sent
    ]  # a run's task id is its request id
    broker = Celery("walk", broker=valkey_url)
    control_plane.redis.delete("device.zero")
    for task in sent_tasks:  # onto the real broker, as the control plane sends them
        broker.send_task(task["name"], args=[task["envelope"]], queue=task["queue"], task_id=task["task_id"])
    assert control_plane.redis.brpop("device.zero", timeout=5) is not None  # the board takes the first
    try:
        page = staff_client.get(reverse("queue")).content.decode()
        states = {
            item["request_id"]: re.search(
                rf'data-request="{item["request_id"]}".*?<td class="state">([^<]*)</td>', page, re.S
            ).group(1)
            for item in sent
        }
        assert [states[item["request_id"]] for item in sent] == [
            "running on its board",
            "queued on its board: next in its queue",
            "queued on its board: 1 run ahead of it",
        ]
        assert "queued or running" not in page
    finally:
        control_plane.redis.delete("device.zero")


def test_revoke_asks_first_then_takes_the_run_back(staff_client, control_plane, sent_tasks):
    device, _ = register("ghost")
    (sent,) = actions.dispatch_run(
        None, [device], actions.run_request(segments=["Anyone home?"], max_tokens=2, title="asked first")
    )
    asked = staff_client.post(reverse("queue-revoke"), {"request_id": sent["request_id"]})
    assert (
        asked.status_code == 200
        and "Revoke the run on ghost?" in asked.content.decode()
        and "asked first" in asked.content.decode()
    )
    assert Dispatch.objects.get(request_id=sent["request_id"]).outcome == ""  # nothing revoked yet
    unticked = staff_client.post(reverse("queue-revoke"), {"request_id": sent["request_id"], "confirming": "1"})
    assert unticked.status_code == 200 and Dispatch.objects.get(request_id=sent["request_id"]).outcome == ""
    done = staff_client.post(
        reverse("queue-revoke"), {"request_id": sent["request_id"], "confirming": "1", "confirm": "on"}, follow=True
    )
    assert (
        "Revoked the run" in done.content.decode()
        and Dispatch.objects.get(request_id=sent["request_id"]).outcome == "revoked"
    )


def test_a_refused_login_says_so_once(client, django_user_model):
    django_user_model.objects.create_user("carol", password="pw-carol-123")
    page = client.post(reverse("login"), {"username": "carol", "password": "wrong"}).content.decode()
    errors = re.findall(r'class="[^"]*\berror(?:list)?\b[^"]*"[^>]*>(.*?)</', page, re.S)
    assert errors == ["Wrong username or password (both are case-sensitive): try again."]

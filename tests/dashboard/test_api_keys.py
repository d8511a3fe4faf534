"""The API keys page (issue 42, item 9): create, list with last use, revoke with confirmation, per
namespace; staff for every namespace, a member for their own where the namespace lets its members
(``Namespace.members_manage_api_keys``). The key is shown once. Django's test client on the real
views and database; the browser test (tests/browser/test_browser_keys.py) copies a key at 390 px and
checks that the official `openai` client is refused once it is revoked."""

from __future__ import annotations

import json
import re
import shlex
from html import unescape

import pytest
from django.test import Client
from django.urls import reverse

from dashboard.actions.api_keys import KeyRefused, create_key, hash_key, revoke_key
from dashboard.api.keys import authenticate
from dashboard.models import ApiKey, AuditEvent, Membership, Namespace

pytestmark = pytest.mark.django_db

KEY = re.compile(r'<pre id="api-key" class="command key">(ec-[A-Za-z0-9_-]+)</pre>')


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def tenants(django_user_model):
    """Two tenants, a member of each, and a staff member; tenant A lets its members manage keys."""
    a = Namespace.objects.create(name="tenant-a", members_manage_api_keys=True)
    b = Namespace.objects.create(name="tenant-b")
    ann = django_user_model.objects.create_user("ann", password="pw-ann-12345")
    ben = django_user_model.objects.create_user("ben", password="pw-ben-12345")
    Membership.objects.create(user=ann, namespace=a)
    Membership.objects.create(user=ben, namespace=b)
    staff = django_user_model.objects.create_user("sue", password="pw-sue-12345", is_staff=True)
    return {"a": a, "b": b, "ann": ann, "ben": ben, "staff": staff}


def _create(client: Client, namespace: str, name: str = "app"):
    return client.post(reverse("api-keys"), {"namespace": namespace, "name": name, "rate_per_minute": ""})


def test_staff_create_a_key_in_any_namespace_and_see_it_once(tenants):
    client = _client(tenants["staff"])
    response = _create(client, "tenant-b", "reports")
    assert response.status_code == 302 and response["Location"] == reverse("api-key-created")
    page = client.get(reverse("api-key-created"))
    assert "no-store" in page["Cache-Control"]
    html = page.content.decode()
    key = KEY.search(html).group(1)
    assert html.count("<h1") == 1 and html.count("API key created") == 1  # the heading, once
    assert 'data-copy aria-label="Copy the API key"' in html
    shown = re.search(r'<pre id="api-key-curl" class="command">(.*?)</pre>', html, re.S).group(1)
    curl = shlex.split(unescape(re.sub(r"<[^>]+>", "", shown)))
    assert (
        curl[:2] == ["curl", "-N"] and f"Authorization: Bearer {key}" in curl and json.loads(curl[-1])["stream"] is True
    )
    row = ApiKey.objects.get(name="reports")
    assert row.namespace_id == "tenant-b" and row.key_sha256 == hash_key(key) and row.created_by == tenants["staff"]
    again = client.get(reverse("api-key-created"))  # shown once: a reload shows it no more
    assert again.status_code == 302 and key not in client.get(reverse("api-keys")).content.decode()
    assert (
        AuditEvent.objects.filter(action="apikey.create", user=tenants["staff"], detail="namespace=tenant-b").count()
        == 1
    )


def test_a_member_lists_only_their_namespaces_keys_with_last_use(tenants):
    mine, _ = create_key(None, "tenant-a", name="mine")
    theirs, _ = create_key(None, "tenant-b", name="theirs")
    ApiKey.objects.filter(pk=mine.pk).update(last_used="2026-11-20T10:30:00Z")
    html = _client(tenants["ann"]).get(reverse("api-keys")).content.decode()
    assert f'data-key="{mine.pk}"' in html and mine.key_prefix in html and "2026-11-20" in html
    assert f'data-key="{theirs.pk}"' not in html and theirs.key_prefix not in html
    staff_html = _client(tenants["staff"]).get(reverse("api-keys")).content.decode()
    assert f'data-key="{mine.pk}"' in staff_html and f'data-key="{theirs.pk}"' in staff_html


def test_a_member_of_tenant_b_can_neither_see_nor_revoke_tenant_as_keys(tenants):
    row, key = create_key(None, "tenant-a", name="a-app")
    ben = _client(tenants["ben"])
    assert ben.get(reverse("api-key-revoke", args=[row.pk])).status_code == 404
    assert ben.post(reverse("api-key-revoke", args=[row.pk]), {"confirm": "on"}).status_code == 404
    row.refresh_from_db()
    assert row.revoked_at is None and authenticate(f"Bearer {key}") is not None
    with pytest.raises(KeyRefused):
        revoke_key(tenants["ben"], row)
    assert ApiKey.objects.get(pk=row.pk).revoked_at is None


def test_a_member_cannot_create_keys_where_the_namespace_does_not_allow_it(tenants):
    ben = _client(tenants["ben"])
    page = ben.get(reverse("api-keys")).content.decode()
    assert 'id="api-key-form"' not in page and "Only staff make and revoke the keys of tenant-b" in page
    refused = _create(ben, "tenant-b")
    assert refused.status_code == 403 and "only staff make API keys" in refused.content.decode()
    assert _create(ben, "tenant-a").status_code == 403  # not even in a namespace that allows its own members
    assert not ApiKey.objects.exists()
    with pytest.raises(KeyRefused):
        create_key(tenants["ben"], "tenant-b")


def test_a_member_manages_keys_where_the_namespace_allows_it_and_only_there(tenants, django_user_model):
    ann = _client(tenants["ann"])
    assert _create(ann, "tenant-a", "own").status_code == 302
    assert ApiKey.objects.get(name="own").namespace_id == "tenant-a"
    other = _create(ann, "tenant-b", "not-mine")  # not a namespace of hers: not a choice
    assert other.status_code == 400 and not ApiKey.objects.filter(name="not-mine").exists()
    # A member of two namespaces, one that allows it: revokes there, not in the other one.
    Membership.objects.create(user=tenants["ann"], namespace=tenants["b"])
    b_key, _ = create_key(None, "tenant-b", name="b-key")
    html = ann.get(reverse("api-keys")).content.decode()
    assert (
        reverse("api-key-revoke", args=[b_key.pk]) not in html
        and "Only staff make and revoke the keys of tenant-b" in html
    )
    assert ann.post(reverse("api-key-revoke", args=[b_key.pk]), {"confirm": "on"}).status_code == 403
    assert ApiKey.objects.get(pk=b_key.pk).revoked_at is None


def test_revoking_asks_first_then_refuses_the_key_and_is_audited(tenants):
    row, key = create_key(None, "tenant-a", name="to-revoke")
    ann = _client(tenants["ann"])
    asked = ann.get(reverse("api-key-revoke", args=[row.pk]))
    assert (
        asked.status_code == 200
        and "Revoke the API key" in asked.content.decode()
        and 'name="confirm"' in asked.content.decode()
    )
    unconfirmed = ann.post(reverse("api-key-revoke", args=[row.pk]), {})
    assert unconfirmed.status_code == 200 and ApiKey.objects.get(pk=row.pk).revoked_at is None
    done = ann.post(reverse("api-key-revoke", args=[row.pk]), {"confirm": "on"})
    assert done.status_code == 302
    assert ApiKey.objects.get(pk=row.pk).revoked_at is not None and authenticate(f"Bearer {key}") is None
    assert AuditEvent.objects.filter(action="apikey.revoke", user=tenants["ann"]).count() == 1
    listed = ann.get(reverse("api-keys")).content.decode()
    assert re.search(rf'data-key="{row.pk}" class="revoked">.*?revoked \d{{4}}-', listed, re.S)


def test_the_admins_add_shows_the_key_once_on_the_dashboards_page(tenants):
    staff = tenants["staff"]
    staff.is_superuser = True
    staff.save()
    client = _client(staff)
    fields = {"name": "ci", "namespace": "tenant-a", "rate_per_minute": 60}
    response = client.post(reverse("admin:dashboard_apikey_add"), fields, follow=True)
    html = response.content.decode()
    assert response.redirect_chain[-1][0] == reverse("api-key-created")
    assert html.count("API key created") == 1 and KEY.search(html)


def test_manage_py_apikey_is_audited_as_the_control_plane():
    Namespace.objects.get_or_create(name="default")
    row, _ = create_key(None, "default", name="cli")
    assert revoke_key(None, row) is True and revoke_key(None, row) is False  # once
    assert AuditEvent.objects.filter(action="apikey.revoke").count() == 1

"""API keys: the keys of each namespace with their last use, create (the key shown once, with a
copy button), revoke (confirmed). The verbs and who may use them: ``actions/api_keys.py``."""

from __future__ import annotations

import json
import shlex

from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache

from dashboard.api.board_choice import example_model

from ..actions.api_keys import (
    KeyRefused,
    create_key,
    key_namespaces,
    managed_namespaces,
    may_manage,
    revoke_key,
    visible_keys,
)
from ..forms import ApiKeyForm, ConfirmForm
from .auth import login_required

KEY_SESSION_KEY = "edgecache_api_key_once"
KEYS_SHOWN = 500  # the newest keys listed (a namespace filter finds older ones)


def _list_url(namespace: str = "") -> str:
    return reverse("api-keys") + (f"?namespace={namespace}" if namespace else "")


def _page(request, form: ApiKeyForm, *, status: int = 200, refusal: str = ""):
    user = request.user
    namespaces = key_namespaces(user)
    chosen = request.GET.get("namespace", "").strip()[:40]
    keys = visible_keys(user).order_by("-created", "-pk")
    if chosen:
        keys = keys.filter(namespace_id=chosen)
    managed = set(managed_namespaces(user).values_list("name", flat=True))
    rows = [{"key": key, "may_revoke": key.namespace_id in managed} for key in keys[:KEYS_SHOWN]]
    not_managed = [namespace.name for namespace in namespaces if namespace.name not in managed]
    context = {
        "form": form,
        "rows": rows,
        "namespaces": namespaces,
        "chosen": chosen,
        "may_create": bool(managed),
        "not_managed": not_managed,
        "refusal": refusal,
    }
    return render(request, "dashboard/api_keys.html", context, status=status)


@login_required
def api_key_list(request):
    """The keys the user may see; a POST makes a key in a namespace they may manage."""
    managed = managed_namespaces(request.user)
    chosen = request.GET.get("namespace", "").strip()[:40]
    form = ApiKeyForm(request.POST or None, namespaces=managed, initial={"namespace": chosen} if chosen else None)
    if request.method != "POST":
        return _page(request, form)
    if not managed.exists():
        refusal = "only staff make API keys of your namespaces: ask a staff member for a key, or to let your namespace's members make them"
        return _page(request, form, status=403, refusal=refusal)
    if not form.is_valid():
        return _page(request, form, status=400)
    data = form.cleaned_data
    try:
        row, key = create_key(
            request.user, data["namespace"], name=data["name"], rate_per_minute=data["rate_per_minute"]
        )
    except KeyRefused as exc:
        return _page(request, form, status=403, refusal=str(exc))
    # POST, redirect, GET: a reload neither posts again nor shows the key twice (it waits in the
    # session for that one GET, which takes it out).
    request.session[KEY_SESSION_KEY] = {"id": row.pk, "key": key}
    return redirect("api-key-created")


@login_required
@never_cache
def api_key_created(request):
    """The new key, this once."""
    shown = request.session.pop(KEY_SESSION_KEY, None)
    row = visible_keys(request.user).filter(pk=shown["id"]).first() if shown else None
    if row is None:
        messages.info(
            request,
            "An API key is shown once, when it is made (only its SHA-256 is kept): make a new one, revoke the lost one.",
        )
        return redirect("api-keys")
    base = request.build_absolute_uri("/").rstrip("/")
    body = json.dumps(
        {"model": example_model(row.namespace_id), "stream": True, "messages": [{"role": "user", "content": "Hello"}]}
    )
    curl = (
        f'curl -N {base}/v1/chat/completions -H "Authorization: Bearer {shown["key"]}" -H "Content-Type: application/json" '
        f"-d {shlex.quote(body)}"
    )
    context = {"row": row, "key": shown["key"], "base": base, "curl": curl}
    return render(request, "dashboard/api_key_created.html", context)  # never cached: the key must not stay in a cache


@login_required
def api_key_revoke(request, pk: int):
    """Revoke a key, once confirmed: its next request is a 401."""
    row = get_object_or_404(visible_keys(request.user), pk=pk)  # another tenant's: 404, as if absent
    back = _list_url(row.namespace_id)
    if not may_manage(request.user, row.namespace):
        form = ApiKeyForm(namespaces=managed_namespaces(request.user))
        return _page(
            request, form, status=403, refusal=f"only staff revoke the API keys of namespace {row.namespace_id!r}"
        )
    if row.revoked_at is not None:
        messages.info(request, f"{row} was revoked already, at {row.revoked_at:%Y-%m-%d %H:%M}.")
        return redirect(back)
    form = ConfirmForm(request.POST or None)
    if request.method != "POST" or not form.is_valid():
        question = f"Revoke the API key {row.key_prefix}…{' (' + row.name + ')' if row.name else ''}?"
        consequence = (
            f"Requests with it to namespace {row.namespace_id}'s boards are refused (401) from now on. "
            "This cannot be undone: make a new key instead."
        )
        context = {"form": form, "question": question, "consequence": consequence, "cancel_url": back}
        return render(request, "dashboard/confirm.html", context)
    revoke_key(request.user, row)
    messages.success(request, f"Revoked {row}: its next request is refused (401).")
    return redirect(back)

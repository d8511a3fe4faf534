"""The Queue page: what the boards' queues hold, per board and per namespace, what ended
unanswered, and Revoke for a run under way (``dashboard.pages.queue``, ``actions.runs.revoke``)."""

from __future__ import annotations

import uuid

from django.contrib import messages
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from dashboard.pages.queue import queue_view, revocable

from ..actions.runs import revoke
from ..forms import ConfirmForm
from .auth import login_required


@login_required
def queue_page(request):
    return render(request, "dashboard/queue.html", {"queue": queue_view(request.user)})


@login_required
@require_POST
def queue_revoke(request):
    """Revoke one run under way that the user may see, once confirmed (the Revoke button asks
    first: a page that says what is taken back); anything else changes nothing."""
    try:
        request_id = uuid.UUID(request.POST.get("request_id", ""))
    except ValueError:
        request_id = None
    dispatch = revocable(request.user, request_id) if request_id else None
    if dispatch is None:
        messages.error(
            request,
            "Nothing revoked: that run is not under way (it was answered, lost or revoked meanwhile), or not yours to see.",
        )
        return redirect("queue")
    form = ConfirmForm(request.POST if "confirm" in request.POST or "confirming" in request.POST else None)
    if not form.is_bound or not form.is_valid():
        title = (
            str(((dispatch.request or {}).get("meta") or {}).get("title", ""))
            if isinstance(dispatch.request, dict)
            else ""
        )
        board = dispatch.device.name if dispatch.device else f"any board of {dispatch.namespace}"
        return render(
            request,
            "dashboard/confirm.html",
            {
                "form": form,
                "question": f"Revoke the run on {board}?",
                "consequence": f"“{title or request_id}”, sent {timezone.localtime(dispatch.created):%Y-%m-%d %H:%M:%S}, is taken back: "
                "its board drops it (or stops it between two tokens), and it ends as a failed run that says you revoked it. "
                "Nothing is answered.",
                "cancel_url": reverse("queue"),
                "hidden": {"request_id": str(request_id), "confirming": "1"},
                "confirm_label": "Revoke",
            },
        )
    if revoke(request.user, dispatch):
        messages.success(
            request,
            f"Revoked the run {request_id} on {dispatch.device.name if dispatch.device else 'any board'}: its board drops it; the Runs page lists it as failed.",
        )
    else:
        messages.error(request, "Nothing revoked: the run ended meanwhile.")
    return redirect("queue")

"""Who may see a page: login and staff checks that count what they refuse, and the login lockout page."""

from __future__ import annotations

import functools
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.decorators import login_required as _login_required
from django.contrib.auth.views import redirect_to_login
from django.http import HttpResponse
from django.shortcuts import render
from django.utils import timezone

from cachebox.events import security_event
from dashboard.ops import metrics
from dashboard.pages.stats import visible_namespaces


# -- refused requests: counted (metrics.refused) and, for the serious ones, logged -------------
def _who(request) -> dict:
    """Who sent a refused request, for the security log."""
    user = getattr(request, "user", None)
    return {
        "user": user.get_username() if user is not None and user.is_authenticated else None,
        "remote_addr": request.META.get("REMOTE_ADDR", ""),
        "path": request.path,
    }


def login_required(view):
    """Django's login_required, counting the requests it sends to the login page."""
    protected = _login_required(view)

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_authenticated:
            metrics.refused("login_required")
        return protected(request, *args, **kwargs)

    return wrapper


def staff_member_required(view):
    """A page for staff: anyone not logged in goes to the dashboard's login page, a logged-in user
    who is not staff gets a 403 page that says who may do this and what to do (never Django's
    admin login, which asked a member for a staff password); each refusal is counted."""

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        user = request.user
        if not user.is_authenticated:
            metrics.refused("login_required")
            return redirect_to_login(request.get_full_path())
        if not (user.is_active and user.is_staff):
            metrics.refused("staff_required")

            return render(
                request, "dashboard/staff_only.html", {"namespaces": sorted(visible_namespaces(user) or [])}, status=403
            )
        return view(request, *args, **kwargs)

    return wrapper


# -- login throttling (django-axes calls this when a username + address is locked out) ------------
def login_locked_out(request, original_response=None, credentials=None) -> HttpResponse:
    """429: the page that says the login is locked and when to try again (AXES_LOCKOUT_CALLABLE).

    Axes records every refused attempt, a locked-out one too, so the lockout ends one cool-off
    after the latest attempt: this one.
    """
    cool_off: timedelta = settings.AXES_COOLOFF_TIME
    attempted = getattr(request, "axes_attempt_time", None) or timezone.now()
    retry_at = attempted + cool_off
    credentials = getattr(request, "axes_credentials", None) or (credentials if isinstance(credentials, dict) else {})
    username = (credentials or {}).get("username") or request.POST.get("username", "")
    wait_seconds = max(1, int((retry_at - timezone.now()).total_seconds()))
    metrics.refused("login_locked_out")
    security_event(
        "login.locked_out",
        username=username[:150],
        retry_at=retry_at.isoformat(),
        failure_limit=settings.AXES_FAILURE_LIMIT,
        **_who(request),
    )
    response = render(
        request,
        "dashboard/locked_out.html",
        {
            "username": username,
            "retry_at": retry_at,
            "minutes": max(1, round(wait_seconds / 60)),
            "failure_limit": settings.AXES_FAILURE_LIMIT,
        },
        status=429,
    )
    response["Retry-After"] = str(wait_seconds)
    return response

"""``/health`` and ``/ready`` for load balancers: no login, nothing a tenant owns (no board names)."""

from __future__ import annotations

from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from dashboard.ops.health import health, readiness


@require_safe
@never_cache
def health_view(request):
    """200 ``{"status": "ok"}`` when this process can serve; 503 with what it waits for while it starts."""
    waiting = health()
    if waiting:
        return JsonResponse({"status": "starting", "waiting_for": waiting}, status=503)
    return JsonResponse({"status": "ok"})


@require_safe
@never_cache
def ready_view(request):
    """Whether any board of each model is online: 200 when one of some model is, else 503 (nothing
    to route a completion to); the body says it per model."""
    models = readiness()
    ready = any(entry["ready"] for entry in models.values())
    return JsonResponse(
        {"status": "ready" if ready else "no board online", "models": models},
        status=200 if ready else 503,
    )

"""/metrics for Prometheus: a bearer token or a staff login."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse
from django.utils.crypto import constant_time_compare
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from prometheus_client.exposition import choose_encoder

from cachebox.events import security_event

from .. import metrics
from .auth import _who


# -- metrics -------------------------------------------------------------------------------------
def _metrics_refusal(request) -> tuple[int, str, str, str] | None:
    """None when the request may read the metrics, else (status, reason, detail for the log, answer)."""
    header = request.headers.get("Authorization", "")
    if header:  # a token was presented: it decides, whoever is logged in
        scheme, _, presented = header.strip().partition(" ")
        token = settings.EDGECACHE_METRICS_TOKEN
        if scheme.lower() != "bearer":
            return 401, "bad_metrics_token", f"{scheme[:20]} authorization", "Metrics take Authorization: Bearer <token>."
        if not token:
            return 401, "bad_metrics_token", "EDGECACHE_METRICS_TOKEN is not set", "Wrong metrics token."
        if not constant_time_compare(presented.strip(), token):
            return 401, "bad_metrics_token", "wrong token", "Wrong metrics token."
        return None
    user = request.user
    if not user.is_authenticated:
        return 401, "login_required", "no credentials", "Metrics need Authorization: Bearer <token> or a staff login."
    if not (user.is_active and user.is_staff):
        return 403, "staff_required", "not staff", "Metrics are for staff accounts (or the metrics token)."
    return None


@require_safe
@never_cache
def metrics_view(request):
    """Prometheus metrics: the runs of every board (from the database) and this process's refusals."""
    refusal = _metrics_refusal(request)
    if refusal is not None:
        status, reason, detail, answer = refusal
        metrics.refused(reason)
        security_event("metrics.refused", reason=reason, detail=detail, status=status, **_who(request))
        response = HttpResponse(answer + "\n", status=status, content_type="text/plain; charset=utf-8")
        if status == 401:
            response["WWW-Authenticate"] = 'Bearer realm="edgecache metrics"'
        return response
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))  # text format, or OpenMetrics when asked
    return HttpResponse(encode(metrics.REGISTRY), content_type=content_type)

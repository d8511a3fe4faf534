"""/metrics for Prometheus: a bearer token or a staff login."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse
from django.utils.crypto import constant_time_compare
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from prometheus_client.exposition import choose_encoder

from cachebox.events import security_event
from dashboard.ops import metrics

from .auth import _who

# -- metrics -------------------------------------------------------------------------------------
# What a refused scraper is told: the setting that holds the token, or how to turn metrics by token on.
SEND_TOKEN = "send Authorization: Bearer <the value of EDGECACHE_METRICS_TOKEN>, or log in as staff"
TOKEN_OFF = (
    "Metrics by token are off: EDGECACHE_METRICS_TOKEN is not set on this server. To turn them on, set it in the "
    "control plane's environment (a long random string), restart, and send Authorization: Bearer <that value>; "
    "a staff login reads them meanwhile."
)


def _metrics_refusal(request) -> tuple[int, str, str, str] | None:
    """None when the request may read the metrics, else (status, reason, detail for the log, answer)."""
    header = request.headers.get("Authorization", "")
    token = settings.EDGECACHE_METRICS_TOKEN
    if header:  # a token was presented: it decides, whoever is logged in
        scheme, _, presented = header.strip().partition(" ")
        if not token:
            return 401, "bad_metrics_token", "EDGECACHE_METRICS_TOKEN is not set", TOKEN_OFF
        if scheme.lower() != "bearer":
            return (
                401,
                "bad_metrics_token",
                f"{scheme[:20]} authorization",
                f"Metrics take a bearer token: {SEND_TOKEN}.",
            )
        if not constant_time_compare(presented.strip(), token):
            return 401, "bad_metrics_token", "wrong token", f"Wrong metrics token: {SEND_TOKEN}."
        return None
    user = request.user
    if not user.is_authenticated:
        return (
            401,
            "login_required",
            "no credentials",
            f"Metrics need a token or a staff login: {SEND_TOKEN}." if token else TOKEN_OFF,
        )
    if not (user.is_active and user.is_staff):
        answer = "Metrics are for staff accounts, or a scraper that sends Authorization: Bearer <the value of EDGECACHE_METRICS_TOKEN>."
        return 403, "staff_required", "not staff", answer
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

"""ASGI entry point: HTTP through Django, WebSockets through Channels (session-authenticated)."""

import os
import threading

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs the apps loaded)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.urls import path  # noqa: E402

from .consumers import LiveConsumer  # noqa: E402

websocket_urlpatterns = [path("ws/live/", LiveConsumer.as_asgi())]

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)


def _warm_router() -> None:
    """Load the model's vocabulary (the router tokenizes every prompt sent to any board) while the
    server starts: loaded by the first request instead, it held the first requests 5.7 s on a
    loaded 2-core machine (bench api's p50 api_ms)."""
    from .actions import run_request
    from .routing import prompt_tokens

    prompt_tokens(run_request(["warm"]))


threading.Thread(target=_warm_router, name="edgecache-warm-router", daemon=True).start()

"""ASGI entry point: HTTP through Django (the API, ``/v1/``, through a handler of its own), WebSockets
through Channels (session-authenticated)."""

import os
import threading

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

django_asgi_app = get_asgi_application()

from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.core.handlers.exception import convert_exception_to_response  # noqa: E402


class ApiHandler(ASGIHandler):
    """Django for the OpenAI-compatible API (``/v1/``): the same views, behind ``API_MIDDLEWARE``
    (run on the event loop) instead of the pages' stack, whose session, CSRF, authentication,
    messages and lockout middlewares do nothing for a request that carries an API key, but cost
    a thread hop each, twice, on the way to its first chunk."""

    def load_middleware(self, is_async=False):
        from .middleware import API_MIDDLEWARE

        self._view_middleware, self._template_response_middleware, self._exception_middleware = [], [], []
        handler = convert_exception_to_response(self._get_response_async)
        for middleware in reversed(API_MIDDLEWARE):
            handler = convert_exception_to_response(middleware(handler))
        self._middleware_chain = handler


API_PREFIX = "/v1/"
api_asgi_app = ApiHandler()


async def http_app(scope, receive, send):
    """HTTP: the API through its own handler, everything else through Django's."""
    app = api_asgi_app if scope["path"].startswith(API_PREFIX) else django_asgi_app
    await app(scope, receive, send)

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs the apps loaded)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.urls import path  # noqa: E402

from .consumers import LiveConsumer  # noqa: E402

websocket_urlpatterns = [path("ws/live/", LiveConsumer.as_asgi())]

application = ProtocolTypeRouter(
    {
        "http": http_app,
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

"""ASGI entry point: HTTP through Django (the API, ``/v1/``, through a handler of its own), WebSockets
through Channels (session-authenticated)."""

import asyncio
import gc
import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext
from django.core.asgi import get_asgi_application
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.exception import convert_exception_to_response
from django.urls import set_script_prefix

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

django_asgi_app = get_asgi_application()

from .middleware import API_MIDDLEWARE  # noqa: E402  (ApiHandler() below loads it)


class ApiHandler(ASGIHandler):
    """Django for the OpenAI-compatible API (``/v1/``): the same views, behind ``API_MIDDLEWARE``
    (run on the event loop) instead of the pages' stack, whose session, CSRF, authentication,
    messages and lockout middlewares do nothing for a request that carries an API key, but cost
    a thread hop each, twice, on the way to its first chunk; and without Django's request signals
    (``handle``). Django's thread-sensitive work, if any, runs on a few threads kept from request
    to request, each request on one of them in turn, where Django's handler starts and joins a
    thread per request (3.5 ms of the web process per request in a burst of eight, with the new
    database connection that thread opened); not on one thread for every request, where each
    request's way in waited behind every other's. The API's own work (key, routing, bounded
    queues, dispatch) runs on threads of its own (``dashboard.api.views``), which tell the API's
    requests by the context set here."""

    _sync_threads = tuple(
        ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"edgecache-api-django-{number}") for number in range(4)
    )
    _turn = itertools.count()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        # One thread per request (thread-sensitive work runs one call at a time, on one thread), in turn.
        executor = self._sync_threads[next(self._turn) % len(self._sync_threads)]
        async with ThreadSensitiveContext(executor=executor):
            await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        """One API request as Django's ASGI handler serves it (body, request, middleware, view, the
        response streamed, a client that leaves cancels the view) without its request signals:
        their receivers close the database connections of the thread Django runs sync code on,
        which the API never uses (its work runs on threads of its own that do it themselves,
        ``dashboard.api.views``), and each send was one more hop to that thread and back (0.5 ms
        of each request's way in on a quiet machine, more under load)."""
        try:
            body = await self.read_body(receive)
        except RequestAborted:
            return
        try:
            set_script_prefix(get_script_prefix(scope))
            request, refused = self.create_request(scope, body)
            if request is None:
                await self.send_response(refused, send)
                return
            answering = asyncio.ensure_future(self._respond(request, send))
            leaving = asyncio.ensure_future(self.listen_for_disconnect(receive))
            await asyncio.wait({answering, leaving}, return_when=asyncio.FIRST_COMPLETED)
            for task in (leaving, answering):  # the client left: the view is cancelled (its run too)
                if not task.done():
                    task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, RequestAborted):
                    pass
        finally:
            body.close()

    async def _respond(self, request, send) -> None:
        response = await self.get_response_async(request)
        try:
            await self.send_response(response, send)
        except asyncio.CancelledError:  # the client went away while it was sent
            pass

    def load_middleware(self, is_async=False):
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

from dashboard.live.consumers import LiveConsumer  # noqa: E402
from dashboard.router import CANDIDATES, STATE, prompt_tokens  # noqa: E402
from inference.contract.messages import Queue  # noqa: E402

from .actions import run_request  # noqa: E402
from .models import Namespace  # noqa: E402
from .outbox import app as celery_app  # noqa: E402

log = logging.getLogger(__name__)

websocket_urlpatterns = [path("ws/live/", LiveConsumer.as_asgi())]

application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)


def _warm_router() -> None:
    """While the server starts, what the first routed request would otherwise wait for: the model's
    vocabulary (the router tokenizes every prompt sent to any board: loaded by the first request, it
    held the first requests 5.7 s on a loaded 2-core machine), the routing state built from the
    database and each namespace's devices read (70 ms of a fresh server's first request on make run),
    and Celery's sending machinery, its broker connection and the boards' queues declared on it
    (31 ms)."""
    from django.conf import settings
    from django.db import connection

    try:
        prompt_tokens(run_request(["warm"]))
        prompt_tokens(
            run_request(messages=[("user", "warm")])
        )  # a chat's template pieces (and inference.engine.chat, imported then)
        STATE.current()
        STATE.follow_in_background(settings.EDGECACHE_ROUTING_FOLLOW_SECONDS)
        CANDIDATES.refresh_in_background()
        devices = [
            device
            for namespace in Namespace.objects.values_list("name", flat=True)
            for device in CANDIDATES.roster(namespace).devices
        ]
        amqp = celery_app.amqp
        (
            amqp.router,
            amqp.producer_pool,
            amqp.send_task_message,
            celery_app.backend,
        )  # built by the first send_task otherwise (24 ms)
        with celery_app.producer_or_acquire() as producer:
            producer.connection.ensure_connection(max_retries=1)
            for device in devices:  # each board's queue as Celery sends to it, declared once per connection (7 ms)
                producer.maybe_declare(amqp.queues[Queue.device(device.name)])
    except Exception as exc:  # a database or broker not there yet: the first request does it, as before
        log.info("routing not warmed at start: %s", exc)
    finally:
        connection.close()
        # What start-up built lives as long as the process (Django, the modules, the vocabulary,
        # the warmed state): out of the collector's sight from now on. A full collection rescanned
        # it all, 84-100 ms every ~13 s in a web process routing over 1,000 boards, holding every
        # thread (the API's streams too).
        gc.collect()
        gc.freeze()


threading.Thread(target=_warm_router, name="edgecache-warm-router", daemon=True).start()

"""Middleware callable from Django's async request path without thread hops.

WhiteNoise's middleware is synchronous only, so Django ran every request (the API's too) through
it on a worker thread and the rest of the stack back on the event loop: two thread hops each way
per request. ``AsyncWhiteNoiseMiddleware`` answers async requests on the event loop (a static file
is looked up in a dict built at start; serving one opens the file, on a thread), and sync ones as
WhiteNoise does. The API's own stack (``API_MIDDLEWARE``, ``dashboard.asgi``) runs Django's header
middlewares on the event loop too.
"""

from __future__ import annotations

import logging

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.core.exceptions import DisallowedHost
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.security import SecurityMiddleware
from django.utils.deprecation import MiddlewareMixin
from whitenoise.middleware import WhiteNoiseMiddleware

from .api.errors import ApiError


class AsyncWhiteNoiseMiddleware(WhiteNoiseMiddleware):
    sync_capable = True
    async_capable = True

    def __init__(self, get_response=None):
        super().__init__(get_response)
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self._async:
            return self.__acall__(request)
        return super().__call__(request)

    async def __acall__(self, request):
        static_file = (
            await sync_to_async(self.find_file)(request.path_info)
            if self.autorefresh
            else self.files.get(request.path_info)
        )
        if static_file is not None:
            return await sync_to_async(self.serve)(static_file, request)
        return await self.get_response(request)


class OnTheLoop:
    """A Django middleware whose hooks read only settings and the request and set headers, called on
    the event loop: ``MiddlewareMixin`` runs each hook through a thread under ASGI (two hops per
    middleware and request), which the API's first chunk paid a dozen times."""

    async def __acall__(self, request):
        response = self.process_request(request) if hasattr(self, "process_request") else None
        response = response or await self.get_response(request)
        return self.process_response(request, response) if hasattr(self, "process_response") else response


class ApiSecurityMiddleware(OnTheLoop, SecurityMiddleware):
    """Django's SecurityMiddleware (HTTPS redirect, HSTS, nosniff, referrer and opener policies)."""


class ApiXFrameOptionsMiddleware(OnTheLoop, XFrameOptionsMiddleware):
    """Django's X-Frame-Options header."""


class ApiAllowedHostsMiddleware(OnTheLoop, MiddlewareMixin):
    """The Host header checked against ``ALLOWED_HOSTS`` (the pages' ``CommonMiddleware`` does it for
    them), refused in OpenAI's error shape: a request naming another host is a DNS-rebinding
    attempt or a misconfigured proxy, and gets nothing of the API."""

    def process_request(self, request):
        try:
            request.get_host()
        except DisallowedHost as exc:
            logging.getLogger("django.security.DisallowedHost").warning(
                "API request refused: %s", exc
            )  # where Django logs it for the pages
            return ApiError(
                400, f"{exc} Call the API by a name in DJANGO_ALLOWED_HOSTS.", code="disallowed_host"
            ).response()
        return None


# The OpenAI-compatible API's middleware (``ApiHandler``): a key in the Authorization header is its
# only credential (no session, no CSRF cookie, no login lockout, no messages), so only the Host
# check, the response's security headers and the HTTPS redirect apply.
API_MIDDLEWARE = (ApiSecurityMiddleware, ApiAllowedHostsMiddleware, ApiXFrameOptionsMiddleware)

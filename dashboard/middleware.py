"""WhiteNoise, callable from Django's async request path.

WhiteNoise's middleware is synchronous only, so Django ran every request (the API's too) through
it on a worker thread and the rest of the stack back on the event loop: two thread hops each way
per request. This one answers async requests on the event loop (a static file is looked up in a
dict built at start; serving one opens the file, on a thread), and sync ones as WhiteNoise does.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from whitenoise.middleware import WhiteNoiseMiddleware


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
        static_file = await sync_to_async(self.find_file)(request.path_info) if self.autorefresh else self.files.get(request.path_info)
        if static_file is not None:
            return await sync_to_async(self.serve)(static_file, request)
        return await self.get_response(request)

"""The API's synchronous work under concurrent requests (issue 41, item 5): each request's key,
routing, bounded queues and dispatch run on the API's own threads, never waiting for another
request's turn on a thread where Django runs its thread-sensitive work; and a web process
reads its devices again beside the requests, not inside one of them. The real views and router,
driven as the API's ASGI handler drives them; no server, no board."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from asgiref.sync import ThreadSensitiveContext, async_to_sync
from django.test import AsyncRequestFactory

from dashboard import router
from dashboard.api import keys, views
from dashboard.models import Device, Namespace


def test_two_api_requests_do_their_synchronous_work_at_once_not_in_turn(monkeypatch):
    """Two requests whose key checks each wait for the other's meet only if both run at once: on
    one shared thread the first would wait for the second, which waits behind it, until the
    meeting gives up (and the request fails)."""
    meeting = threading.Barrier(2, timeout=20)
    met_on: list[str] = []

    def check(header: str):
        meeting.wait()
        met_on.append(threading.current_thread().name)
        return keys.Checked(None, None)  # no such key: 401, after both met

    monkeypatch.setattr(keys, "check", check)
    monkeypatch.setattr(keys, "check_unanswered", lambda header: (None, lambda: check(header)))
    factory = AsyncRequestFactory()
    # As dashboard.asgi.ApiHandler runs each request: in a context of its own whose thread-sensitive
    # work (Django's) goes to a thread it shares with other requests (here both: the worst case).
    django_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="django-sync")

    async def one(view, request):
        async with ThreadSensitiveContext(executor=django_thread):
            return await view(request)

    async def both(view, make):
        return await asyncio.gather(one(view, make()), one(view, make()))

    chat = json.dumps({"model": "m.gguf", "messages": [{"role": "user", "content": "hi"}]})
    requests = {
        "chat": (
            views.chat_completions,
            lambda: factory.post(
                "/v1/chat/completions",
                data=chat,
                content_type="application/json",
                headers={"Authorization": "Bearer ec-x"},
            ),
        ),
        "completion": (
            views.completions,
            lambda: factory.post(
                "/v1/completions", data=json.dumps({"model": "m.gguf", "prompt": "hi"}), content_type="application/json"
            ),
        ),
        "models": (views.models, lambda: factory.get("/v1/models", headers={"Authorization": "Bearer ec-x"})),
        "model": (views.model_detail, lambda: factory.get("/v1/models/m.gguf")),
    }
    try:
        for name, (view, make) in requests.items():
            meeting.reset()
            met_on.clear()
            if name == "model":
                view = lambda request, view=view: view(request, "m.gguf")  # noqa: E731
            responses = async_to_sync(both)(view, make)
            assert [response.status_code for response in responses] == [401, 401], name
            assert json.loads(responses[0].content)["error"]["code"] == "invalid_api_key"
            assert len(set(met_on)) == 2 and not any(thread.startswith("django-sync") for thread in met_on), (
                name,
                met_on,
            )
    finally:
        django_thread.shutdown()


@pytest.mark.django_db(
    transaction=True, serialized_rollback=True
)  # committed: the refresher reads on a connection of its own; migrated rows left as found
def test_a_web_process_reads_its_devices_again_beside_the_requests_not_inside_one(monkeypatch):
    """A request that finds the devices read too long ago routes on that read while a thread reads
    them again; once the read is older than STALE_S (the refresher stopped or fell behind) the
    request reads them itself, as before."""
    Namespace.objects.get_or_create(name="default")
    Device.objects.create(name="first-board", token_sha256="0" * 64)
    candidates = router.Candidates()
    candidates.refresh_in_background()
    try:
        _reads_beside_the_requests(candidates, monkeypatch)
    finally:
        candidates.stop_background()
    assert not candidates._refresher.is_alive()  # stopped: its connection closed


def _reads_beside_the_requests(candidates, monkeypatch) -> None:
    first = candidates.roster("default")  # nothing read yet: read now
    assert [device.name for device in first.devices] == ["first-board"]

    Device.objects.create(name="second-board", token_sha256="0" * 64)
    monkeypatch.setattr(router.Candidates, "TTL_S", 0.0)  # every read is old from now on
    assert candidates.roster("default") is first  # answered from the read it has, not from a read of its own

    deadline = time.monotonic() + 30
    while {device.name for device in candidates.roster("default").devices} != {"first-board", "second-board"}:
        assert time.monotonic() < deadline, "the refresher did not read the devices again within 30 s"
        time.sleep(0.01)

    Device.objects.create(name="third-board", token_sha256="0" * 64)
    monkeypatch.setattr(router.Candidates, "STALE_S", 0.0)  # too old to route on: read now
    assert {device.name for device in candidates.roster("default").devices} == {
        "first-board",
        "second-board",
        "third-board",
    }


def test_a_roster_the_refresher_is_reading_again_is_judged_when_it_was_read_not_now():
    """A roster read a few seconds ago (while the refresher reads it again) judges liveness a moment
    after its read: judged at now, a board beating every second looked offline in it (the API
    answered "no board online" with the board up)."""
    from dashboard.router import Candidates, Roster

    roster = Roster([], read_at=1_000.0)
    assert roster.judged_at(1_000.4) == 1_000.4  # fresh: now
    assert roster.judged_at(1_004.0) == 1_000.0 + Candidates.TTL_S  # stale: TTL_S after its read

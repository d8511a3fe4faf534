"""Following runs' channels (``dashboard.live.streams``) against a real Valkey: the runs a web process
follows at once share one pub/sub connection, each hears only its own channel, and a lost
connection is heard by every follower (nothing is silently missed) and replaced by the next one."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from cachebox.errors import CacheBoxUnavailable
from cachebox.store import CacheBox
from dashboard.live import streams

pytestmark = pytest.mark.cachebox


def _pubsub_connections(client: redis.Redis) -> int:
    return sum(
        1 for entry in client.client_list() if int(entry.get("sub", 0)) > 0 or "subscribe" in entry.get("cmd", "")
    )


def test_runs_followed_at_once_share_one_connection_and_each_hears_only_its_own_channel(valkey_url):
    admin = redis.Redis.from_url(valkey_url)
    store = CacheBox(valkey_url)
    channels = [f"test.streams.shared.{index}" for index in range(20)]

    async def follow_all():
        subscriptions = [streams.subscribe(valkey_url, channel) for channel in channels]
        await asyncio.gather(*(subscription.open() for subscription in subscriptions))
        connections = await asyncio.to_thread(_pubsub_connections, admin)
        for channel in channels:  # published only once every subscription is open: none may be missed
            await asyncio.to_thread(store.publish, channel, channel.encode())
        heard = [await subscription.get(5.0) for subscription in subscriptions]
        extra = [await subscription.get(0.2) for subscription in subscriptions]
        for subscription in subscriptions:
            await subscription.close()
        return connections, heard, extra

    connections, heard, extra = asyncio.run(follow_all())
    assert connections == 1
    assert heard == [channel.encode() for channel in channels]
    assert extra == [None] * len(channels)


def test_a_closed_subscription_leaves_its_channel_on_the_server(valkey_url):
    admin = redis.Redis.from_url(valkey_url)
    channel = "test.streams.closed"

    async def open_then_close():
        subscription = await streams.subscribe(valkey_url, channel).open()
        during = admin.pubsub_numsub(channel)[0][1]
        await subscription.close()
        deadline = time.monotonic() + 5
        while admin.pubsub_numsub(channel)[0][1] and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return during, admin.pubsub_numsub(channel)[0][1]

    assert asyncio.run(open_then_close()) == (1, 0)


def test_a_lost_connection_is_heard_by_every_follower_and_the_next_one_connects_again(valkey_url):
    admin = redis.Redis.from_url(valkey_url)
    store = CacheBox(valkey_url)

    async def lose_and_return():
        first = await streams.subscribe(valkey_url, "test.streams.lost.a").open()
        second = await streams.subscribe(valkey_url, "test.streams.lost.b").open()
        await asyncio.to_thread(admin.client_kill_filter, _type="pubsub")
        outcomes = []
        for subscription in (first, second):
            try:
                outcomes.append(await subscription.get(5.0))
            except CacheBoxUnavailable as exc:
                outcomes.append(type(exc).__name__)
        again = await streams.subscribe(valkey_url, "test.streams.lost.c").open()
        await asyncio.to_thread(store.publish, "test.streams.lost.c", b"after")
        return outcomes, await again.get(5.0)

    outcomes, after = asyncio.run(lose_and_return())
    assert outcomes == ["CacheBoxUnavailable", "CacheBoxUnavailable"]
    assert after == b"after"


def test_an_unreachable_cache_box_is_a_clear_error_at_once():
    async def follow():
        started = time.monotonic()
        with pytest.raises(CacheBoxUnavailable, match="unreachable"):
            await streams.subscribe(
                "redis://127.0.0.1:9/0", "test.streams.nowhere", connect_timeout=0.3, timeout=0.5
            ).open()
        return time.monotonic() - started

    assert asyncio.run(follow()) < 2.0

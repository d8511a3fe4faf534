"""Link emulation: real pacing of real transfers to a real server."""

import os
import time

import pytest

from cachebox.link import LinkProfile
from cachebox.store import CacheBox

pytestmark = pytest.mark.cachebox


def test_one_megabyte_over_a_one_megabyte_per_second_link_takes_about_a_second(valkey_url, namespace):
    plain = CacheBox(valkey_url)
    name = f"ec:e:{namespace}:00ff00ff00ff00ff:{{{'ee' * 16}}}"
    plain.put_entries([(name, os.urandom(1_000_000))], ttl=60)
    shaped = CacheBox(valkey_url, link=LinkProfile(bandwidth_mbps=8.0, rtt_ms=0.0), timeout=10)  # 1 MB/s
    started = time.monotonic()
    blob = shaped.read_entries([name])[0]
    elapsed = time.monotonic() - started
    assert len(blob) == 1_000_000
    assert 0.9 < elapsed < 1.4, elapsed
    started = time.monotonic()
    plain.read_entries([name])
    assert time.monotonic() - started < 0.2  # the same read unshaped


def test_each_request_waits_one_round_trip(valkey_url):
    shaped = CacheBox(valkey_url, link=LinkProfile(bandwidth_mbps=1000.0, rtt_ms=50.0))
    shaped.redis.ping()  # connect first
    started = time.monotonic()
    for _ in range(4):
        shaped.redis.ping()
    assert 0.19 < time.monotonic() - started < 0.4
    assert shaped.link_label == "emulated link 1000 Mbit/s, 50 ms RTT"
    assert CacheBox(valkey_url).link_label == "unshaped"


def test_uploads_are_paced_too(valkey_url, namespace):
    shaped = CacheBox(valkey_url, link=LinkProfile(bandwidth_mbps=16.0, rtt_ms=0.0), timeout=10)  # 2 MB/s
    name = f"ec:e:{namespace}:00ff00ff00ff00ff:{{{'ef' * 16}}}"
    started = time.monotonic()
    shaped.put_entries([(name, os.urandom(1_000_000))], ttl=60)
    assert 0.45 < time.monotonic() - started < 0.8


def test_a_reply_read_later_waits_only_what_is_left_of_its_round_trip(valkey_url):
    """A PUBLISH sent without waiting (a run's "started" stage) and answered while the board worked:
    its reply is there one round trip after it was sent, not one round trip after it is read."""
    shaped = CacheBox(valkey_url, link=LinkProfile(bandwidth_mbps=1000.0, rtt_ms=80.0))
    shaped.redis.ping()  # connect first
    answer = shaped.publish_unanswered("ec:stream:nobody:listens", b"started")
    time.sleep(0.1)  # the board's engine at work, longer than the round trip
    started = time.monotonic()
    assert answer() == 0
    assert time.monotonic() - started < 0.05  # the reply came meanwhile
    started = time.monotonic()
    answer = shaped.publish_unanswered("ec:stream:nobody:listens", b"token")
    assert answer() == 0
    assert 0.075 < time.monotonic() - started < 0.2  # read at once: the whole round trip

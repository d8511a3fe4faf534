"""A board's stream thread serves every streamed run of its process (``inference.board.streaming``):
an error while one run's event is published must not stop the events of the runs after it."""

from __future__ import annotations

import threading
import uuid

from inference.board import streaming
from inference.contract.messages import StreamEvent


class _Store:
    def __init__(self):
        self.published: list[tuple[str, bytes]] = []
        self.done = threading.Event()

    def publish(self, channel: str, data: bytes) -> int:
        self.published.append((channel, data))
        self.done.set()
        return 1

    def read_flag(self, name: str):
        return None  # no cancel


class _Me:
    name = "board-x"

    def seal_event(self, event: StreamEvent) -> bytes:
        if event.type == "error":
            raise ValueError("a broken event")  # what a bug in one run's event would do
        return event.request_id.encode()


BROKEN, FINE = str(uuid.uuid4()), str(uuid.uuid4())


def test_one_runs_failing_event_leaves_the_stream_thread_serving_the_next_run():
    store, me = _Store(), _Me()
    broken = streaming.StreamPublisher(store, BROKEN, me)
    broken.send(StreamEvent(type="error", request_id=BROKEN, device=me.name, error="x"))
    broken.close(timeout=5)  # returns once the broken event was taken (its failure counted as done)
    assert store.published == []
    thread = streaming._stream_thread()
    assert thread.is_alive()
    fine = streaming.StreamPublisher(store, FINE, me)
    assert fine._thread is thread  # the same thread, not one started afresh
    fine.send(StreamEvent(type="stage", request_id=FINE, device=me.name, stage="started"))
    assert store.done.wait(5)
    fine.close(timeout=5)
    assert store.published == [(fine.channel, FINE.encode())]

"""A board's answered requests on its disk (inference.board.replay): kept until they expire, across restarts, bounded."""

from __future__ import annotations

import uuid

from inference.board import replay
from inference.board.replay import SpentRequests


def test_an_answered_request_is_spent_until_its_expiry_also_for_the_next_process(tmp_path):
    path = tmp_path / "boards" / "solo" / "spent-requests"
    answered, other = str(uuid.uuid4()), str(uuid.uuid4())
    SpentRequests(path, now=1000.0).record(answered, 1600.0, now=1000.0)
    restarted = SpentRequests(path, now=1100.0)  # the board came back
    assert restarted.spent(answered, now=1100.0) and not restarted.spent(other, now=1100.0)
    assert not restarted.spent(answered, now=1602.0)  # expired: the envelope is refused as expired anyway
    later = SpentRequests(path, now=2000.0)
    assert not later.spent(answered, now=2000.0) and path.read_text() == ""  # expired lines are dropped at start


def test_the_file_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(replay, "MAX_SPENT", 10)
    spent = SpentRequests(tmp_path / "spent", now=0.0)
    short = [str(uuid.uuid4()) for _ in range(9)]
    long = [str(uuid.uuid4()) for _ in range(9)]
    for request_id in short:
        spent.record(request_id, 15.0, now=10.0)
    for request_id in long:  # past the short ones' expiry: the file is rewritten without them when it is full
        spent.record(request_id, 1000.0, now=20.0)
    lines = (tmp_path / "spent").read_text().splitlines()
    assert len(lines) <= 10 and all(spent.spent(request_id, now=30.0) for request_id in long)
    assert not any(request_id in "".join(lines) for request_id in short)


def test_a_process_that_keeps_nothing_refuses_nothing():
    replay._spent = None
    replay.record(str(uuid.uuid4()), None)
    assert not replay.spent(str(uuid.uuid4()))

"""The board's heartbeat: every few seconds, signed, with its status (catalogs, memory, rates);
each beat re-checks the board's record, so a revoked or rotated board stops instead of serving on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from cachebox.errors import CacheBoxUnavailable
from cachebox.keys import heartbeat_key
from inference.board.devices import DeviceRefused
from inference.board.enrollment import identity
from inference.board.wire import write_to_broker
from inference.contract.envelope import Kind
from inference.contract.messages import BoardStatus, Heartbeat

log = logging.getLogger("inference.board")


def push_heartbeat(sealed: dict, interval: float = 5.0) -> None:
    """A signed heartbeat as this board's latest (``cachebox.keys.heartbeat_key``, one PSETEX that
    overwrites the last one and expires when the board would count as offline long since): the
    control plane reads every board's latest in turn, so however often one board beats, it holds
    one key and delays no other board."""
    me = identity()
    raw = json.dumps(sealed, separators=(",", ":"))
    ttl = max(60, int(interval * 12))
    write_to_broker(
        lambda client: client.psetex(heartbeat_key(me.name), ttl * 1000, raw), retry=False, what="a heartbeat"
    )


class HeartbeatThread(threading.Thread):
    """Tells the control plane every few seconds that this board lives, and how its catalogs look.

    Each beat also re-checks the token: a board whose token was revoked or rotated calls
    ``on_refused`` (the edge command stops the worker) instead of serving on.
    """

    def __init__(self, board_status, interval: float = 5.0, on_refused=None):
        super().__init__(name="edgecache-heartbeat", daemon=True)
        self.board_status = board_status
        self.interval = interval
        self.on_refused = on_refused
        self._stop_event = threading.Event()

    def beat(self) -> None:
        me = identity()
        try:
            me.recheck()
        except DeviceRefused as exc:
            log.error("stopping: %s", exc)
            if self.on_refused:
                self.on_refused(exc)
            self.stop()
            return
        except CacheBoxUnavailable:
            pass  # cannot tell now; the control plane checks every message anyway
        status = BoardStatus(pid=os.getpid(), sent=time.time(), heartbeat_s=self.interval, **self.board_status())
        push_heartbeat(me.seal(Heartbeat(device=me.name, status=status), Kind.HEARTBEAT), self.interval)

    def run(self) -> None:
        while True:
            try:
                self.beat()
            except Exception as exc:  # the broker may be down for a while: keep trying
                log.warning("heartbeat not sent: %s", exc)
            if self._stop_event.is_set() or self._stop_event.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop_event.set()

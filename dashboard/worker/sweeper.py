"""The control worker's sweeper: every ``EDGECACHE_SWEEP_SECONDS`` it ends the runs nobody will
answer (``actions.sweeper.sweep``) and tells open pages which boards went quiet. It starts with
each control worker (``dashboard.celery``); several workers sweeping is safe."""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import close_old_connections

from dashboard.actions.devices import ensure_identities
from dashboard.actions.sweeper import announce_liveness, sweep

log = logging.getLogger("dashboard.worker.sweeper")


class Sweeper(threading.Thread):
    def __init__(self, interval: float):
        super().__init__(name="edgecache-sweeper", daemon=True)
        self.interval = interval
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                close_old_connections()
                ensure_identities()
                counts = sweep()
                if counts["resent"] or counts["lost"]:
                    log.warning("sweep: %s", counts)
                announce_liveness()
            except Exception:  # a database or cache box hiccup: the next sweep tries again
                log.exception("sweep failed")
            finally:
                close_old_connections()

    def stop(self) -> None:
        self._stopped.set()


_sweeper: Sweeper | None = None


def start() -> Sweeper:
    """Start this process's sweeper (once)."""
    global _sweeper
    if _sweeper is None or not _sweeper.is_alive():
        _sweeper = Sweeper(settings.EDGECACHE_SWEEP_SECONDS)
        _sweeper.start()
    return _sweeper

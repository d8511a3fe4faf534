"""The one way a board writes to the broker's server: as its own Redis user, through its Celery
connection pool, waiting for a server that is away. Used by the outbox (its inbox), heartbeats
(its heartbeat key) and enrollment (its enrollment inbox); it knows no message.
"""

from __future__ import annotations

import logging
import time

from celery import current_app

log = logging.getLogger("inference.board")

# A report waits for a broker that is away (its Wi-Fi dropped, the broker restarted) instead of
# failing: the answer is computed, and the report is what the control plane records.
RETRY_START_S, RETRY_STEP_S, RETRY_MAX_S = 0.5, 1.0, 5.0


def write_to_broker(command, *, retry: bool = True, what: str = "a message") -> None:
    """``command(client)`` on the broker's server as this board's own Redis user (its Celery
    connection pool); while the server cannot be reached, tried again with back-off (``retry``).
    A refusal (NOPERM, OOM) is raised at once."""
    delay = RETRY_START_S
    while True:
        with current_app.pool.acquire(block=True, timeout=10) as connection:
            away = (OSError, *connection.connection_errors)
            try:
                command(connection.default_channel.client)
                return
            except away as exc:
                if not retry:
                    raise
                log.warning("%s not sent yet (again in %.1f s): %s", what, delay, exc)
        time.sleep(delay)
        delay = min(delay + RETRY_STEP_S, RETRY_MAX_S)

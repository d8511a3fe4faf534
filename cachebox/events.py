"""Security events: one JSON object per line on the ``edgecache.security`` logger.

``security_event("run.rate_limited", user="bob", retry_after=42)`` logs a record whose
formatted line (through :class:`JsonLineFormatter`) is::

    {"event": "run.rate_limited", "time": "2025-01-01T12:00:00.123Z", "level": "warning", "user": "bob", "retry_after": 42}

The line is plain ``json.dumps`` output, so values cannot break it into several lines or
forge other fields, whatever a client sent. Pure standard library: boards, the control
plane and scripts all use it; the host application only attaches a handler with this
formatter (Django's ``LOGGING`` does in ``dashboard/settings.py``).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

LOGGER_NAME = "edgecache.security"
RESERVED = ("event", "time", "level")

logger = logging.getLogger(LOGGER_NAME)


def security_event(event: str, **fields) -> None:
    """Log one security-relevant event (a refused request, a rejected entry, ...) with its fields.

    A field named like a reserved key (``time``, ``level``) is kept as ``field_time``, ...
    Values that JSON cannot hold are written as their ``str()``.
    """
    logger.warning(event, extra={"security_event": event, "security_fields": fields})


def _timestamp(created: float) -> str:
    moment = datetime.fromtimestamp(created, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonLineFormatter(logging.Formatter):
    """Formats a record as one JSON object: event, time (UTC, ISO 8601), level, then the fields.

    Records that did not come from :func:`security_event` (a plain ``logger.warning(...)``
    on the same logger) get their message as the event.
    """

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "security_event", None) or record.getMessage()
        line = {"event": event, "time": _timestamp(record.created), "level": record.levelname.lower()}
        for name, value in (getattr(record, "security_fields", None) or {}).items():
            line[f"field_{name}" if name in RESERVED else str(name)] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=True)

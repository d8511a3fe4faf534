"""An edge board as a Celery worker, one room per concern:

- ``enrollment``: this process's board identity: its keys, the control plane it pinned, the
  record and namespace ring it last trusted, what it may open and sign;
- ``serving``: a dispatched run answered by the strategy it names (streamed, stopped, cancelled,
  the next chat turn prepared), and a schema encoded;
- ``streaming``: a streamed run's answer pieces and events, sealed and signed on its channel, and
  the signed cancel flag;
- ``outbox``: reports, progress and refusals to the control plane, signed and sealed;
- ``heartbeats``: the board's signed status every few seconds;
- ``replay``: the requests it answered, kept on its disk until they expire (a replay after a restart is refused).

A board holds no database credentials: it needs the broker/cache-box URL, its token once (to
enroll) and then its own keys (``inference.board.identity``). It opens only requests the control plane
it pinned signed and sealed for it, and signs (and seals) everything it sends
(``inference.contract.envelope``). ``inference.board.tasks`` (the Celery tasks) and ``inference.board.main`` (the
``edgecache-board`` command) use the names below.
"""

from inference.board.enrollment import EdgeIdentity, become, current, identity, send_enrollment
from inference.board.heartbeats import HeartbeatThread, push_heartbeat
from inference.board.outbox import refused_request, report, send_progress, send_to_control
from inference.board.serve import CANCELLED, board_work_waiting, encode, messages_waiting, serve
from inference.board.streaming import AnswerText, StreamPublisher, signed_cancel_set

__all__ = [
    "CANCELLED",
    "AnswerText",
    "EdgeIdentity",
    "HeartbeatThread",
    "StreamPublisher",
    "become",
    "board_work_waiting",
    "current",
    "encode",
    "identity",
    "messages_waiting",
    "push_heartbeat",
    "refused_request",
    "report",
    "send_enrollment",
    "send_progress",
    "send_to_control",
    "serve",
    "signed_cancel_set",
]

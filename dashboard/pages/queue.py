"""What the boards' queues hold, as the Queue page shows it (Flower's strength): the runs under way
per board and per namespace, how long each has waited, and the runs that ended unanswered (expired,
lost with their board, revoked) with the reason their failed run gives.

Read from ``Dispatch`` (one row per run sent; its ``outcome`` says how it ended) and the failed
runs the sweeper recorded (``actions.sweeper``): the viewer's namespaces only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

from cachebox.broker import queued_task_ids
from dashboard import outbox
from dashboard.models import Dispatch, InferenceRun
from dashboard.pages.stats import sees_every_namespace, visible_devices
from inference.contract.messages import Queue

log = logging.getLogger("dashboard.pages.queue")

RECENT = timedelta(hours=24)  # the unanswered runs the page lists
LIMIT = 200  # rows of each table at most


NOT_READ = -2  # ``Waiting.ahead``: the broker did not answer
TAKEN = -1  # ... not in its board's queue: its board took it


@dataclass
class Waiting:
    """A run under way: queued on its board (``ahead``: how many runs its board takes before it),
    or taken off the queue by its board (``TAKEN``), as the broker holds it."""

    dispatch: Dispatch
    title: str
    waited_s: float
    expires_in_s: float | None
    board_online: bool
    ahead: int = NOT_READ

    @property
    def state(self) -> str:
        """Where the run is, in the page's words."""
        device = self.dispatch.device
        board = (
            ""
            if device is None
            else "online"
            if self.board_online
            else "offline"
            if device.last_seen is not None
            else "never"
        )
        return run_state(board, self.ahead, self.dispatch.namespace)


def run_state(board: str, ahead: int, namespace: str = "") -> str:
    """A waiting run's state from its board's liveness (``online``, ``offline``, ``never`` started;
    "": sent to any board of ``namespace``) and its place in the board's queue (``ahead``)."""
    if not board:
        return f"queued for any board of {namespace}"
    if board == "never":
        return "waiting for its board to start" + (f": {_place(ahead)}" if ahead >= 0 else "")
    if ahead == NOT_READ:
        return (
            "queued or running" if board == "online" else "waiting for its board to come back"
        ) + " (the broker did not answer)"
    if ahead == TAKEN:
        if board == "online":
            return "running on its board"
        return "taken by its board, which stopped answering (re-sent or lost at the next sweep)"
    return (
        f"queued on its board: {_place(ahead)}"
        if board == "online"
        else f"waiting for its board to come back: {_place(ahead)}"
    )


def _place(ahead: int) -> str:
    return "next in its queue" if ahead == 0 else f"{ahead:,} run{'s' if ahead != 1 else ''} ahead of it"


QUEUE_WINDOW = 500  # messages of a board's queue looked through for its runs (the next to be taken)
DEEPER = ""  # ``queue_places``: the runs ahead of one that waits past the window (at least)


def queue_places(boards: list[str], under_way: set[str]) -> dict[str, dict[str, int]] | None:
    """{board: {request id: runs ahead of it}} for the runs waiting in each board's queue on the
    broker (a run its board took is in none); None when the broker does not answer. Reads only the
    task ids (``cachebox.broker.queued_task_ids``): a run's task id is its request id. Counted
    ahead are the runs ``under_way`` only: a revoked or lost run's message that still waits is
    dropped by the board as it takes it."""
    from django.conf import settings

    places: dict[str, dict[str, int]] = {}
    try:
        # the broker (REDIS_URL, read at call time), through outbox.app as it is now (a test may replace it)
        with outbox.app.connection_for_read(settings.REDIS_URL) as connection:
            channel = connection.channel()  # no retry loop (``default_channel`` retries a broker that is down)
            client = channel.client
            for board in boards:
                ids, length = queued_task_ids(client, Queue.device(board), QUEUE_WINDOW)
                live = [request_id for request_id in ids if request_id in under_way]
                places[board] = {request_id: position for position, request_id in enumerate(live)}
                if length > len(ids):  # a run past the window waits behind all of them: not taken
                    places[board][DEEPER] = len(live)
            channel.close()
    except Exception as exc:  # the page still shows what the database knows
        log.warning("the boards' queues were not read from the broker: %s: %s", type(exc).__name__, exc)
        return None
    return places


@dataclass
class Ended:
    """A run that ended unanswered: expired, lost with its board, or revoked."""

    dispatch: Dispatch
    run: InferenceRun | None

    @property
    def reason(self) -> str:
        return self.run.error if self.run is not None else self.dispatch.get_outcome_display()


@dataclass
class Group:
    """The queue of one board or one namespace."""

    name: str
    waiting: int = 0
    oldest_s: float = 0.0
    lost: int = 0  # expired or lost with its board, in the last RECENT
    revoked: int = 0


@dataclass
class QueueView:
    waiting: list[Waiting] = field(default_factory=list)
    ended: list[Ended] = field(default_factory=list)
    boards: list[Group] = field(default_factory=list)
    namespaces: list[Group] = field(default_factory=list)


def visible_dispatches(viewer):
    """The runs sent to boards that ``viewer`` may see (staff: every one, to any board too)."""
    dispatches = Dispatch.objects.filter(kind="run").select_related("device")
    if sees_every_namespace(viewer):
        return dispatches
    return dispatches.filter(device__in=visible_devices(viewer))


def queue_view(viewer, now: datetime | None = None) -> QueueView:
    now = now or timezone.now()
    dispatches = visible_dispatches(viewer)
    view = QueueView()
    boards: dict[str, Group] = {}
    namespaces: dict[str, Group] = {}

    def groups(dispatch: Dispatch) -> list[Group]:
        board = dispatch.device.name if dispatch.device is not None else "any board"
        return [
            boards.setdefault(board, Group(board)),
            namespaces.setdefault(dispatch.namespace, Group(dispatch.namespace)),
        ]

    under_way = list(dispatches.filter(outcome="").order_by("created")[:LIMIT])
    boards_waited_on = sorted({dispatch.device.name for dispatch in under_way if dispatch.device is not None})
    under_way_ids = Dispatch.objects.filter(kind="run", outcome="", device__name__in=boards_waited_on).values_list(
        "request_id", flat=True
    )
    live = {str(request_id) for request_id in under_way_ids}
    places = queue_places(boards_waited_on, live) if boards_waited_on else {}
    for dispatch in under_way:
        request = dispatch.request if isinstance(dispatch.request, dict) else {}
        waited = max((now - dispatch.created).total_seconds(), 0.0)
        expires = (dispatch.expires_at - now).total_seconds() if dispatch.expires_at else None
        online = dispatch.device.online_at(now) if dispatch.device is not None else True
        ahead = NOT_READ
        if places is not None and dispatch.device is not None:
            queued = places.get(dispatch.device.name, {})
            ahead = queued.get(str(dispatch.request_id), queued.get(DEEPER, TAKEN))
        view.waiting.append(
            Waiting(dispatch, str((request.get("meta") or {}).get("title", "")), waited, expires, online, ahead)
        )
        for group in groups(dispatch):
            group.waiting += 1
            group.oldest_s = max(group.oldest_s, waited)
    ended = list(
        dispatches.filter(outcome__in=("lost", "revoked"), created__gte=now - RECENT).order_by("-created")[:LIMIT]
    )
    runs = {
        str(run.request_id): run for run in InferenceRun.objects.filter(request_id__in=[d.request_id for d in ended])
    }
    for dispatch in ended:
        view.ended.append(Ended(dispatch, runs.get(str(dispatch.request_id))))
        for group in groups(dispatch):
            if dispatch.outcome == "revoked":
                group.revoked += 1
            else:
                group.lost += 1
    # Every board the viewer sees has a row, an idle one too.
    for device in visible_devices(viewer):
        boards.setdefault(device.name, Group(device.name))
        namespaces.setdefault(device.namespace_id, Group(device.namespace_id))
    view.boards = sorted(boards.values(), key=lambda group: group.name)
    view.namespaces = sorted(namespaces.values(), key=lambda group: group.name)
    return view


def revocable(viewer, request_id) -> Dispatch | None:
    """The run under way ``request_id`` if ``viewer`` may see it, else None."""
    return (
        visible_dispatches(viewer).filter(request_id=request_id, outcome="").select_related("device__namespace").first()
    )

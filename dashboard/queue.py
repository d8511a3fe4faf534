"""What the boards' queues hold, as the Queue page shows it (Flower's strength): the runs under way
per board and per namespace, how long each has waited, and the runs that ended unanswered (expired,
lost with their board, revoked) with the reason their failed run gives.

Read from ``Dispatch`` (one row per run sent; its ``outcome`` says how it ended) and the failed
runs the sweeper recorded (``actions.sweeper``): the viewer's namespaces only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

from .models import Dispatch, InferenceRun
from .stats import sees_every_namespace, visible_devices

RECENT = timedelta(hours=24)  # the unanswered runs the page lists
LIMIT = 200  # rows of each table at most


@dataclass
class Waiting:
    """A run under way: queued on its board, or on it."""

    dispatch: Dispatch
    title: str
    waited_s: float
    expires_in_s: float | None
    board_online: bool

    @property
    def state(self) -> str:
        if self.dispatch.device is not None and not self.board_online:
            return "waiting for its board to start"
        return "queued or running"


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
        return [boards.setdefault(board, Group(board)), namespaces.setdefault(dispatch.namespace, Group(dispatch.namespace))]

    for dispatch in dispatches.filter(outcome="").order_by("created")[:LIMIT]:
        request = dispatch.request if isinstance(dispatch.request, dict) else {}
        waited = max((now - dispatch.created).total_seconds(), 0.0)
        expires = (dispatch.expires_at - now).total_seconds() if dispatch.expires_at else None
        online = dispatch.device.online_at(now) if dispatch.device is not None else True
        view.waiting.append(Waiting(dispatch, str((request.get("meta") or {}).get("title", "")), waited, expires, online))
        for group in groups(dispatch):
            group.waiting += 1
            group.oldest_s = max(group.oldest_s, waited)
    ended = list(dispatches.filter(outcome__in=("lost", "revoked"), created__gte=now - RECENT).order_by("-created")[:LIMIT])
    runs = {str(run.request_id): run for run in InferenceRun.objects.filter(request_id__in=[d.request_id for d in ended])}
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
    return visible_dispatches(viewer).filter(request_id=request_id, outcome="").select_related("device__namespace").first()


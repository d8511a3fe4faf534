"""The model cards of a set of boards, as the Run page shows them: one card per model the boards
reported in their heartbeats (``dashboard.pages.model_card``), with the boards that run it and the
context each one uses."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db.models import QuerySet
from django.db.models.fields.json import KT

from dashboard.pages.model_card import ModelCard, card_for


@dataclass
class BoardsModel:
    card: ModelCard
    boards: list[tuple[str, int | None]] = field(default_factory=list)  # (device name, its context in tokens)

    SHOWN = 8  # boards named on a card; the rest are counted

    def where(self) -> str:
        """The boards that run it, with their context: "zero (context 2,048), pi5 (context 4,096)"."""
        named = [f"{name} (context {n_ctx:,})" if n_ctx else name for name, n_ctx in self.boards[: self.SHOWN]]
        more = len(self.boards) - self.SHOWN
        return ", ".join(named) + (f" and {more} more" if more > 0 else "")

    def board_names(self) -> str:
        names = [name for name, _ in self.boards[: self.SHOWN]]
        more = len(self.boards) - self.SHOWN
        return ", ".join(names) + (f" and {more} more" if more > 0 else "")


def boards_models(devices: QuerySet) -> list[BoardsModel]:
    """The models of ``devices`` (those that sent a heartbeat), most boards first. Two keys of each
    status are read by the database, not the whole status (catalogs and all)."""
    rows = (
        devices.exclude(status={})
        .annotate(model_file=KT("status__model"), n_ctx=KT("status__memory__n_ctx"))
        .filter(model_file__isnull=False)
        .values_list("name", "model_file", "n_ctx")
        .order_by("name")
    )
    models: dict[str, BoardsModel] = {}
    for name, model_file, n_ctx in rows:
        if not model_file:
            continue
        entry = models.setdefault(model_file, BoardsModel(card_for(model_file)))
        entry.boards.append((name, int(n_ctx) if n_ctx and str(n_ctx).isdigit() else None))
    return sorted(models.values(), key=lambda entry: (-len(entry.boards), entry.card.file))

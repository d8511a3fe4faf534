"""The Cache page (entries, catalogs, boards' filters) and flushing entries."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.db.models import Count, Sum
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import urlencode
from django.views.decorators.http import require_POST

from cachebox.catalog import DEFAULT_CAPACITY, DEFAULT_FP_RATE, Catalog, max_snapshot_bytes
from cachebox.errors import CacheBoxUnavailable, CatalogFormatError, InvalidNamespace
from cachebox.keys import catalog_key_names
from dashboard.models import CacheEntry
from dashboard.pages.entry_preview import previews
from dashboard.pages.stats import catalog_summary, current_namespace, fill_label

from .. import actions
from ..forms import FlushForm, model_names
from ..models import AuditEvent, Device
from .auth import staff_member_required


def _snapshot_cap() -> int:
    """The most bytes this page fetches of a master snapshot: what a catalog of the boards' configured
    size takes (or the default size, which ``rebuild_master_catalog`` writes), never a planted one's."""
    board = settings.EDGECACHE_BOARD
    return max(
        max_snapshot_bytes(board.catalog_capacity, board.catalog_fp_rate),
        max_snapshot_bytes(DEFAULT_CAPACITY, DEFAULT_FP_RATE),
    )


def _master_epoch(store, namespace: str) -> str:
    """The namespace's live catalog epoch (boards compare theirs with it at every sync); "" when
    the cache box holds none (flushed or restarted: the next board to sync starts a new one).
    Read as it is, never created: the page only looks."""
    value = store.read_entries([catalog_key_names(namespace)["epoch"]])[0]  # a plain GET
    return value.decode(errors="replace") if value else ""


NEWEST_ENTRIES = 15  # entries the Cache page lists (Admin > Cache entries lists them all)
BOARD_CATALOGS = 50  # boards' filters the Cache page lists (found by name past that; every board is counted)


def _newest_entries() -> list[dict]:
    entries = list(CacheEntry.objects.order_by("-created")[:NEWEST_ENTRIES])
    holds = previews(entries)
    return [{"entry": entry, "holds": holds.get(entry.key, "")} for entry in entries]


@staff_member_required
def cache_page(request):
    store = actions.cachebox()
    namespaces = list(
        CacheEntry.objects.values("namespace", "model")
        .annotate(entries=Count("id"), bytes=Sum("bytes"), hits=Sum("hits"))
        .order_by("namespace", "model")
    )
    names = model_names()
    for row in namespaces:
        row["model_name"] = names.get(row["model"], "")
    board = request.GET.get("board", "").strip()[:40]
    chosen = request.GET.get("namespace", "").strip()
    devices = [
        {"device": device, **catalog_summary(device)} for device in Device.objects.only("name", "status", "memory_mb")
    ]
    board_namespaces = {namespace for summary in devices for namespace in summary["catalogs"]}
    masters, epochs = [], {}
    try:
        for namespace in sorted(
            {row["namespace"] for row in namespaces} | {settings.EDGECACHE_NAMESPACE} | board_namespaces
        ):
            try:
                catalog_key_names(namespace)
            except InvalidNamespace:
                continue  # a board's report naming no usable namespace: no master copy to read
            catalog, refused = None, ""
            try:
                bloom, last_id, _ = store.catalog_snapshot(namespace, max_bytes=_snapshot_cap())
                catalog = Catalog.from_bytes(bloom) if bloom else None
            except CatalogFormatError as exc:  # a planted snapshot: neither fetched (too large) nor shown
                refused = str(exc)
            pending = store.catalog_log_length(namespace)
            epochs[namespace] = epoch = _master_epoch(store, namespace)
            masters.append(
                {
                    "namespace": namespace,
                    "has_snapshot": catalog is not None,
                    "snapshot_refused": refused,
                    "snapshot_items": round(catalog.approx_items) if catalog else 0,
                    "fill_label": fill_label(catalog.fill_ratio()) if catalog else "–",
                    "estimated_fp_rate": catalog.estimated_fp_rate() if catalog else None,
                    "pending_log": pending,
                    "epoch": epoch,
                }
            )
        reachable = True
    except CacheBoxUnavailable:
        reachable = False
    per_namespace: dict[str, dict] = {}
    for summary in devices:
        for namespace, catalog in summary["catalogs"].items():
            # A board's filter from an older epoch (the catalog was flushed, or the cache box
            # restarted empty) is dropped at its next sync; until then its figures are the old ones.
            catalog["stale"] = reachable and catalog["epoch"] != epochs.get(namespace, "")
            row = per_namespace.setdefault(
                namespace,
                {"namespace": namespace, "boards": 0, "stale": 0, "items": [], "fp": 0.0, "oldest_sync": None},
            )
            row["boards"] += 1
            row["stale"] += bool(catalog["stale"])
            row["items"].append(catalog.get("approx_items", 0))
            row["fp"] = max(row["fp"], catalog.get("estimated_fp_rate", 0.0) or 0.0)
            if catalog["last_sync"] and (row["oldest_sync"] is None or catalog["last_sync"] < row["oldest_sync"]):
                row["oldest_sync"] = catalog["last_sync"]
    board_summary = [
        {**row, "median_items": sorted(row["items"])[len(row["items"]) // 2] if row["items"] else 0}
        for _, row in sorted(per_namespace.items())
    ]
    reporting = [
        summary
        for summary in devices
        if summary["catalogs"] and (not board or board.lower() in summary["device"].name.lower())
    ]
    reporting.sort(
        key=lambda summary: (not any(c["stale"] for c in summary["catalogs"].values()), summary["device"].name)
    )  # stale ones first
    return render(
        request,
        "dashboard/cache.html",
        {
            "namespaces": namespaces,
            "masters": masters,
            "reachable": reachable,
            "devices": reporting[:BOARD_CATALOGS],
            "boards_found": len(reporting),
            "boards_listed": min(len(reporting), BOARD_CATALOGS),
            "board_summary": board_summary,
            "board": board,
            # The flush form opens on ?namespace= (where a flush came back to: a board's own namespace too), else the current one.
            "flush_form": FlushForm(current=(chosen, current_namespace(request, chosen))),
            "entries": _newest_entries(),
            "events": AuditEvent.objects.select_related("user")[:15],
        },
    )


@staff_member_required
@require_POST
def cache_flush(request):
    form = FlushForm(request.POST, current=current_namespace(request))
    if not form.is_valid():
        messages.error(request, "Nothing flushed: " + "; ".join(" ".join(errors) for errors in form.errors.values()))
        return redirect("cache")
    namespace, model = form.cleaned_data.get("namespace") or None, form.cleaned_data.get("model") or None
    # Back on the page, the form opens on the namespace flushed, or on the current one after every
    # namespace was: never on "every namespace".
    back = redirect(f"{reverse('cache')}?{urlencode({'namespace': namespace})}" if namespace else "cache")
    try:
        removed = actions.flush_entries(request.user, namespace, model)
    except CacheBoxUnavailable as exc:
        messages.error(request, f"Nothing flushed: {exc}")
        return back
    scope = (f"namespace {namespace}" if namespace else "every namespace", f"model {model}" if model else "")
    what = " and ".join(part for part in scope if part)
    if removed:
        messages.success(request, f"Deleted {removed} entr{'y' if removed == 1 else 'ies'} of {what}.")
    else:
        messages.warning(request, f"Nothing to delete: the cache box holds no entry of {what}.")
    return back

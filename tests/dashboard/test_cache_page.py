"""What the Cache page reads, read without decoding every device's or run's JSON: the names of the
models boards report, and the runs that stored the newest entries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

FINGERPRINT = "ab" * 16


@pytest.mark.django_db
def test_model_names_are_the_pairs_boards_report_read_by_the_database():
    from dashboard.forms import model_names
    from dashboard.models import Device, Namespace

    Namespace.objects.get_or_create(name="default")
    Device.objects.create(
        name="one",
        status={"fingerprint": FINGERPRINT, "model": "gemma.gguf", "catalogs": {"default": {"approx_items": 3}}},
    )
    Device.objects.create(name="two", status={"fingerprint": FINGERPRINT, "model": "gemma.gguf"})
    Device.objects.create(name="three", status={"fingerprint": "cd" * 16})  # no model named: nothing to say
    Device.objects.create(name="four", status={"model": "other.gguf"})  # no fingerprint
    Device.objects.create(name="five")  # never beat
    assert model_names() == {FINGERPRINT[:16]: "gemma.gguf"}


@pytest.mark.django_db
def test_entry_previews_find_each_entrys_newest_storing_run_within_its_window_in_one_query_per_span(
    django_assert_num_queries,
):
    from dashboard.models import CacheEntry, Device, InferenceRun, Namespace
    from dashboard.pages.entry_preview import NEAR, previews

    Namespace.objects.get_or_create(name="default")
    device = Device.objects.create(name="board")
    now = timezone.now()

    def entry(name: str, ago: timedelta) -> CacheEntry:
        made = CacheEntry.objects.create(
            key=f"ec:e:default:{name}", model=FINGERPRINT[:16], namespace="default", start=0, end=4, bytes=1
        )
        CacheEntry.objects.filter(pk=made.pk).update(created=now - ago)
        made.refresh_from_db()
        return made

    def stored(ago: timedelta, *pieces: tuple[CacheEntry, str]) -> None:
        run = InferenceRun.objects.create(
            device=device,
            source="schema",
            prompt="p",
            text="t",
            breakdown={"entries": {"stored": [{"name": e.key, "piece": piece} for e, piece in pieces]}},
        )
        InferenceRun.objects.filter(pk=run.pk).update(created=now - ago)

    a, b = entry("a", timedelta(seconds=1)), entry("b", timedelta(seconds=2))
    c = entry("c", timedelta(hours=1))
    lonely = entry("lonely", timedelta(seconds=3))  # its run is outside its window
    stored(timedelta(seconds=1), (a, "older"), (b, "b"))
    stored(timedelta(seconds=0), (a, "newer"))
    stored(timedelta(hours=1), (c, "c"), (a, "an hour early"), (lonely, "an hour early"))  # inside c's window only
    stored(timedelta(seconds=3) + NEAR + timedelta(seconds=5), (lonely, "too early"))
    with django_assert_num_queries(2):  # a, b and lonely overlap: one span; c another
        holds = previews([a, b, c, lonely])
    assert holds == {a.key: "schema ?, newer", b.key: "schema ?, b", c.key: "schema ?, c", lonely.key: ""}

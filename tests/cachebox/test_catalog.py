"""The Bloom catalog: pure, millisecond tests."""

import os

import pytest

from cachebox.catalog import Catalog
from cachebox.errors import CatalogFormatError


def keys(count):
    return [os.urandom(16) for _ in range(count)]


def test_added_keys_are_always_found():
    catalog = Catalog(10_000, 0.01)
    present = keys(2000)
    catalog.add_many(present)
    assert all(catalog.lookup(present))
    assert catalog.stats.lookups == 2000 and catalog.stats.maybe_hits == 2000


def test_false_positive_rate_is_near_the_configured_one_when_full():
    catalog = Catalog(20_000, 0.01)
    catalog.add_many(keys(20_000))
    absent = keys(50_000)
    observed = sum(catalog.lookup(absent)) / len(absent)
    assert 0.003 < observed < 0.02
    assert 0.005 < catalog.estimated_fp_rate() < 0.02


def test_default_size_matches_the_paper():
    # 1M entries at 1% false positives: about 1.2 MB, as in the paper's section 4.
    assert abs(Catalog().size_bits / 8 / 1e6 - 1.2) < 0.05


def test_serialization_round_trip_preserves_membership():
    catalog = Catalog(1000, 0.01)
    present = keys(500)
    catalog.add_many(present)
    loaded = Catalog.from_bytes(catalog.to_bytes())
    assert all(key in loaded for key in present)
    assert (loaded.capacity, loaded.fp_rate) == (1000, 0.01)


@pytest.mark.parametrize("raw", [b"", b"junk", b"ECB1\x03\x00\x00\x00{}x", Catalog(10).to_bytes()[:-5]])
def test_bad_catalog_bytes_raise_a_format_error(raw):
    with pytest.raises(CatalogFormatError):
        Catalog.from_bytes(raw)


def test_merge_is_a_union_and_refuses_other_sizes():
    a, b = Catalog(1000), Catalog(1000)
    ka, kb = keys(10), keys(10)
    a.add_many(ka)
    b.add_many(kb)
    a.merge(b)
    assert all(key in a for key in ka + kb)
    with pytest.raises(CatalogFormatError):
        a.merge(Catalog(2000))


def test_counters_for_true_hits_and_false_positives():
    catalog = Catalog(100)
    catalog.record_true_hit(2)
    catalog.record_false_positive()
    catalog.record_not_asked(3, "held_on_board")
    catalog.record_not_asked(1, "policy_skipped")
    assert catalog.stats.as_dict() == {
        "lookups": 0,
        "maybe_hits": 0,
        "true_hits": 2,
        "false_positives": 1,
        "held_on_board": 3,
        "policy_skipped": 1,
        "cachebox_down": 0,
    }
    with pytest.raises(ValueError):
        catalog.record_not_asked(1, "bored")


def test_keys_must_be_digests():
    with pytest.raises(ValueError):
        Catalog(10).add(b"short")

"""The message contract (inference.contract.messages): what a receiver refuses before it stores anything."""

from __future__ import annotations

import json

import pytest

from inference.contract.messages import MAX_BOARD_CATALOGS, MAX_HEARTBEAT_BYTES, BoardStatus, Heartbeat, MessageRefused

# What a real board's heartbeat says (inference.board.runtime.Board.status, plus the beat's own fields).
REAL_STATUS = {
    "pid": 4242,
    "sent": 1_764_000_000.5,
    "heartbeat_s": 5.0,
    "model": "gemma-3-270m-it-Q4_K_M.gguf",
    "fingerprint": "0123456789abcdef",
    "threads": 2,
    "kv_type": "f16",
    "codec": "zstd",
    "compute_profile": "pi-zero-2w",
    "catalogs": {
        "default": {
            "approx_items": 12,
            "size_bytes": 1_198_160,
            "fill_ratio": 0.0001,
            "estimated_fp_rate": 0.0,
            "configured_fp_rate": 0.01,
            "last_sync": 1_764_000_000.0,
            "epoch": "a" * 32,
            "lookups": 40,
            "maybe_hits": 9,
            "true_hits": 5,
            "false_positives": 1,
            "held_on_board": 2,
            "policy_skipped": 1,
            "cachebox_down": 0,
        }
    },
    "ram_tier": {
        "entries": 3,
        "bytes": 9_000_000,
        "budget_bytes": 134_217_728,
        "hits": 2,
        "misses": 5,
        "rss_limit_bytes": None,
        "evicted_for_rss": 0,
        "refused": 0,
    },
    "flash_tier": {
        "entries": 1,
        "bytes": 3_000_000,
        "budget_bytes": 67_108_864,
        "hits": 0,
        "misses": 1,
        "directory": "/var/lib/edgecache/flash/zero",
    },
    "memory": {
        "rss_mb": 480.5,
        "peak_rss_mb": 512.0,
        "pss_mb": 300.1,
        "memory_mb": 512,
        "budget_mb": 430.0,
        "n_ctx": 4096,
        "kv_cache_mb": 36.0,
    },
    "rates": {
        "prefill_ms_per_token": 3.1,
        "decode_ms_per_token": 20.0,
        "prompt_tokens": 128,
        "decode_tokens": 16,
        "compute_profile": "",
    },
}


def test_a_real_boards_status_is_accepted_and_travels_unchanged():
    status = BoardStatus.parse(REAL_STATUS)
    dumped = status.dump()
    for field, value in REAL_STATUS.items():
        if isinstance(value, dict) and field != "catalogs":  # a tier's unset fields come back as their defaults
            assert {name: dumped[field][name] for name in value} == value, field
        else:
            assert dumped[field] == value, field
    beat = Heartbeat(device="zero", status=status)
    assert len(json.dumps(beat.dump())) < MAX_HEARTBEAT_BYTES // 10


@pytest.mark.parametrize(
    "where",
    ["top", "catalog", "ram_tier", "memory", "rates"],
)
def test_a_status_with_an_unknown_field_anywhere_is_refused(where):
    status = json.loads(json.dumps(REAL_STATUS))
    filler = "x" * 8 * 1024 * 1024  # the probe's 8 MB heartbeat
    target = {
        "top": status,
        "catalog": status["catalogs"]["default"],
        "ram_tier": status["ram_tier"],
        "memory": status["memory"],
        "rates": status["rates"],
    }[where]
    target["padding"] = filler
    with pytest.raises(MessageRefused, match="padding.*Extra inputs are not permitted"):
        BoardStatus.parse(status)
    with pytest.raises(MessageRefused):
        Heartbeat.parse({"device": "zero", "status": status})


def test_a_status_with_oversized_strings_or_lists_is_refused():
    for field, value in [
        ("model", "m" * 201),
        ("kv_type", "k" * 17),
        ("codec", "c" * 33),
        ("compute_profile", "p" * 101),
    ]:
        with pytest.raises(MessageRefused, match=field):
            BoardStatus.parse({**REAL_STATUS, field: value})
    too_many = {f"ns{number}": REAL_STATUS["catalogs"]["default"] for number in range(MAX_BOARD_CATALOGS + 1)}
    with pytest.raises(MessageRefused, match="catalogs"):
        BoardStatus.parse({**REAL_STATUS, "catalogs": too_many})
    with pytest.raises(MessageRefused, match="catalogs"):
        BoardStatus.parse({**REAL_STATUS, "catalogs": {"n" * 129: REAL_STATUS["catalogs"]["default"]}})
    with pytest.raises(MessageRefused, match="flash_tier.directory"):
        BoardStatus.parse({**REAL_STATUS, "flash_tier": {**REAL_STATUS["flash_tier"], "directory": "d" * 1025}})
    with pytest.raises(MessageRefused, match="epoch"):
        BoardStatus.parse(
            {**REAL_STATUS, "catalogs": {"default": {**REAL_STATUS["catalogs"]["default"], "epoch": "e" * 65}}}
        )


def test_the_largest_status_the_contract_allows_fits_the_heartbeat_cap():
    """MAX_HEARTBEAT_BYTES bounds what a receiver reads; a valid status at every bound must fit under it."""
    catalog = {
        **REAL_STATUS["catalogs"]["default"],
        "epoch": "e" * 64,
        **{name: 2**62 for name in ("lookups", "maybe_hits", "true_hits", "false_positives")},
    }
    largest = {
        **REAL_STATUS,
        "model": "m" * 200,
        "kv_type": "k" * 16,
        "codec": "c" * 32,
        "compute_profile": "p" * 100,
        "catalogs": {f"{number:03d}" + "n" * 125: catalog for number in range(MAX_BOARD_CATALOGS)},
        "flash_tier": {**REAL_STATUS["flash_tier"], "directory": "d" * 1024},
    }
    beat = Heartbeat(device="z" * 64, status=BoardStatus.parse(largest))
    # signed envelope: about 300 bytes of head and signature around the message
    assert len(json.dumps(beat.dump(), separators=(",", ":"))) + 1024 < MAX_HEARTBEAT_BYTES


@pytest.mark.model
def test_the_status_a_real_board_sends_is_the_status_the_contract_accepts(make_board):
    """What ``HeartbeatThread`` sends (``Board.status`` and the beat's own fields) parses whole: a
    field added to a board's status and not to the contract would make every heartbeat refused, and
    every board look offline."""
    board = make_board(None, "default")
    status = {"pid": 1, "sent": 1_764_000_000.0, "heartbeat_s": 5.0, **board.status()}
    parsed = BoardStatus.parse(status).dump()
    assert (
        parsed["catalogs"].keys() == status["catalogs"].keys()
        and parsed["memory"]["n_ctx"] == status["memory"]["n_ctx"]
    )

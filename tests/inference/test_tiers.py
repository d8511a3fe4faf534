"""The board-local tiers: a board keeps what it holds (its last prompt in the engine, its own
entries in RAM) and serves from there first, with no network, giving the cold answer."""

import json
from decimal import ROUND_HALF_UP, Decimal

import pytest

from inference.serving.breakdown import TIME_LABELS, time_sums

pytestmark = [pytest.mark.model, pytest.mark.cachebox]

CONTEXT = "".join(f"Log {i}: the ferry left at {i % 12} and came back at {(i + 5) % 12}.\n" for i in range(45))


def ask(question: str) -> list[str]:
    return [CONTEXT, f"Question: {question}\nAnswer:"]


def test_a_repeated_prompt_is_served_from_the_context_with_no_network(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace, context_reuse=True)
    first = board.run(ask("when did the ferry leave on log 7?"), max_tokens=16)
    again = board.run(ask("when did the ferry leave on log 7?"), max_tokens=16)
    b = again.breakdown
    assert b.tier == "context" and b.case == "full" and b.decision == "local"
    assert b.fetched_bytes == 0 and b.redis_ms == 0 and b.prefill_ms == 0
    cold = board.run(ask("when did the ferry leave on log 7?"), max_tokens=16, use_cache=False)
    assert again.tokens == first.tokens == cold.tokens


def test_a_prompt_sharing_a_prefix_continues_from_the_context(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace, context_reuse=True)
    board.run(ask("when did the ferry leave on log 7?"), max_tokens=8)
    other = board.run(ask("when did it come back on log 30?"), max_tokens=24)
    b = other.breakdown
    assert b.tier == "context" and b.case == "partial" and b.fetched_bytes == 0
    assert b.matched_tokens == len(
        board.prefix.tokenize([CONTEXT])[0]
    )  # the shared segment, whole: the question began a batch
    cold = board.run(ask("when did it come back on log 30?"), max_tokens=24, use_cache=False)
    assert other.tokens == cold.tokens  # resumed where a batch ended: the cold run's batches


def test_entries_the_board_computed_stay_in_ram_and_serve_with_no_network(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace, context_reuse=True, ram_tier_bytes=64 * 1024 * 1024)
    first = board.run(ask("when did the ferry leave on log 7?"), max_tokens=8)
    board.run(["An unrelated prompt about lighthouses and their keepers."], max_tokens=2)  # the context moves on
    again = board.run(ask("when did the ferry leave on log 7?"), max_tokens=8)
    b = again.breakdown
    assert b.tier == "local" and b.case == "full" and b.fetched_bytes == 0 and b.local_ms > 0
    assert again.tokens == first.tokens
    assert board.prefix.ram.status()["entries"] >= 2 and board.status()["ram_tier"]["bytes"] > 0


def test_another_user_of_the_engine_voids_the_context(valkey_url, namespace, make_board):
    a = make_board(valkey_url, namespace, device="dev-a", context_reuse=True)
    b = make_board(valkey_url, namespace, device="dev-b", context_reuse=True)  # the same engine
    prompt = ask("when did the ferry leave on log 7?")
    cold = a.run(prompt, max_tokens=8, use_cache=False)
    a.run(prompt, max_tokens=8)
    b.run(["Something else entirely, about tides."], max_tokens=2, use_cache=False)  # overwrites the engine's sequence
    again = a.run(prompt, max_tokens=8)
    assert again.breakdown.tier != "context" and again.tokens == cold.tokens


def test_no_cache_means_no_local_tier_either(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace, context_reuse=True, ram_tier_bytes=64 * 1024 * 1024)
    board.run(ask("when did the ferry leave on log 7?"), max_tokens=4)
    cold = board.run(ask("when did the ferry leave on log 7?"), max_tokens=4, use_cache=False)
    assert cold.breakdown.tier == "" and cold.breakdown.prefill_ms > 0 and cold.breakdown.case == "miss"


def test_context_and_cache_box_chain_together(valkey_url, namespace, make_board):
    """The board holds the shared part in its context; the cache box has the rest of a longer prompt."""
    writer = make_board(valkey_url, namespace, device="dev-a")
    longer = ask("when did the ferry leave on log 7?") + ["Then list every return time after log 40 in order, please."]
    writer.run(longer, max_tokens=2)
    reader = make_board(valkey_url, namespace, device="dev-b", context_reuse=True)
    reader.catalogs.sync_all()
    reader.run([CONTEXT], max_tokens=2, upload=False)  # its context: the shared logs only
    result = reader.run(longer, max_tokens=8)
    b = result.breakdown
    assert b.tier == "cachebox" and b.case == "full" and b.local_ms >= 0 and b.fetched_bytes > 0
    # Each tier's share is counted (issue 28, B6): the context's part is not the cache box's.
    assert (
        b.context_tokens > 0
        and b.fetched_tokens > 0
        and b.context_tokens + b.local_tokens + b.fetched_tokens == b.matched_tokens
    )
    assert result.tokens == reader.run(longer, max_tokens=8, use_cache=False).tokens


# -- TTFT and TTLT as the sums they are (issue 42, item 5) ---------------------------------------------
def shown(ms: float) -> Decimal:
    """A number of milliseconds as the pages show it (0.1 ms, half up: Django's floatformat:1)."""
    return Decimal(repr(ms)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)


def assert_parts_add_up(result, tier: str) -> dict:
    """The run's TTFT and TTLT, as shown, are exactly their shown parts plus "other"; the named
    parts never exceed the whole (on these paths nothing runs at the same time)."""
    b = result.breakdown
    assert b.tier == tier, (b.tier, tier)
    stored = b.as_dict()  # as the control plane stores it (to the microsecond), and the pages show it
    sums = time_sums(stored)
    for key, whole in (("ttft", stored["ttft_ms"]), ("ttlt", stored["ttlt_ms"])):
        total = sums[key]
        assert [part.label for part in total.parts] == (
            ["Token", "Bloom", "P-decode", "Redis", "Sample", "other"] if key == "ttft" else [*TIME_LABELS, "other"]
        )
        assert Decimal(f"{total.total_ms:.1f}") == shown(whole)
        assert sum(Decimal(f"{part.ms:.1f}") for part in total.parts) == shown(whole), total.sentence()
        assert total.other_ms >= 0, total.sentence()
    # Where the prompt came from is a named part, not "other".
    redis = next(part for part in sums["ttft"].parts if part.label == "Redis")
    if tier in ("context", "local", "flash"):
        assert b.local_ms > 0 and b.redis_ms == 0 and redis.ms == shown(b.local_ms).__float__()
    if tier == "cachebox":
        assert b.redis_ms > 0 and redis.ms >= float(shown(b.redis_ms)) - 0.1
    return {key: total.sentence() for key, total in sums.items()}


def test_the_parts_of_ttft_and_ttlt_add_up_for_runs_from_every_tier(valkey_url, namespace, make_board, tmp_path):
    prompt = ask("when did the ferry leave on log 7?")
    said = {}
    writer = make_board(valkey_url, namespace, device="dev-a")
    said["cold"] = assert_parts_add_up(writer.run(prompt, max_tokens=12), "")
    reader = make_board(valkey_url, namespace, device="dev-b")
    reader.catalogs.sync_all()
    said["cache box"] = assert_parts_add_up(reader.run(prompt, max_tokens=12), "cachebox")
    keeper = make_board(valkey_url, namespace, device="dev-c", context_reuse=True, ram_tier_bytes=64 * 1024 * 1024)
    keeper.run(prompt, max_tokens=4, upload=False)
    said["context"] = assert_parts_add_up(keeper.run(prompt, max_tokens=12), "context")
    keeper.run(["An unrelated prompt about lighthouses and their keepers."], max_tokens=2)  # the context moves on
    said["RAM"] = assert_parts_add_up(keeper.run(prompt, max_tokens=12), "local")
    flash = {"flash_tier_bytes": 64 * 1024 * 1024, "flash_dir": tmp_path / "flash"}
    make_board(valkey_url, namespace, device="dev-d", **flash).run(prompt, max_tokens=2, upload=False)
    said["flash"] = assert_parts_add_up(
        make_board(valkey_url, namespace, device="dev-d", **flash).run(prompt, max_tokens=12), "flash"
    )
    print(json.dumps(said, indent=1))


# -- a catalog's counters add up (issue 42, item 5) ------------------------------------------------------
def catalog_stats(board, namespace: str) -> dict:
    return board.status()["catalogs"][namespace]


def assert_reconciles(stats: dict) -> None:
    """Every "maybe" settled once: held by the cache box, not there, or never asked about and why."""
    settled = ("true_hits", "false_positives", "held_on_board", "policy_skipped", "cachebox_down")
    assert stats["maybe_hits"] == sum(stats[name] for name in settled), stats
    assert stats["lookups"] >= stats["maybe_hits"], stats


def test_a_boards_catalog_counters_add_up(valkey_url, namespace, make_board):
    from cachebox.store import CacheBox

    longer = ask("when did the ferry leave on log 7?") + ["Then list every return time after log 40 in order, please."]
    writer = make_board(valkey_url, namespace, device="dev-a")
    writer.run(longer, max_tokens=2)  # a sure miss: lookups, no "maybe"
    # The board's context holds the front: its "maybe"s there are never asked about; the rest is fetched.
    reader = make_board(valkey_url, namespace, device="dev-b", context_reuse=True)
    reader.catalogs.sync_all()
    reader.run([CONTEXT], max_tokens=2, upload=False)
    assert reader.run(longer, max_tokens=2).breakdown.tier == "cachebox"
    stats = catalog_stats(reader, namespace)
    assert stats["true_hits"] > 0 and stats["held_on_board"] > 0
    assert_reconciles(stats)
    # A policy that never fetches: its "maybe"s are never asked about, and counted as such.
    skipper = make_board(valkey_url, namespace, device="dev-c", policy="never")
    skipper.catalogs.sync_all()
    assert skipper.run(longer, max_tokens=2).breakdown.decision == "policy-skip"
    stats = catalog_stats(skipper, namespace)
    assert stats["policy_skipped"] > 0 and stats["true_hits"] == 0
    assert_reconciles(stats)
    # Entries gone since the catalog was synced: "maybe"s the cache box did not hold.
    late = make_board(valkey_url, namespace, device="dev-d")
    late.catalogs.sync_all()
    store = CacheBox(valkey_url)
    store.delete(list(store.scan_entries(namespace)))
    late.run(longer, max_tokens=2)
    stats = catalog_stats(late, namespace)
    assert stats["false_positives"] > 0
    assert_reconciles(stats)
    assert_reconciles(catalog_stats(writer, namespace))

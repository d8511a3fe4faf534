"""The flash tier: entries on the board's own disk, between its RAM and the cache box. They survive
a restart of the board, stay under their budget (least recently used out first), and are verified
on every read: a file changed on disk is removed and never served."""

import pytest

from inference.tiers.flash import FlashEntries

CONTEXT = "".join(f"Log {i}: the ferry left at {i % 12} and came back at {(i + 5) % 12}.\n" for i in range(45))
QUESTION = [CONTEXT, "Question: when did the ferry leave on log 7?\nAnswer:"]


def test_entries_leave_least_recently_used_first_within_the_budget(tmp_path):
    flash = FlashEntries(tmp_path, budget_bytes=300)
    for name in ("a", "b", "c"):
        flash.put(name, name.encode() * 100)
    assert flash.get("a") == b"a" * 100  # a is now the most recent
    flash.put("d", b"d" * 100)
    assert "b" not in flash and {"a", "c", "d"} == {n for n in "abcd" if n in flash}
    assert flash.size_bytes == 300 and len(list(tmp_path.glob("*.entry"))) == 3
    flash.put("huge", b"x" * 301)  # larger than the whole budget: not kept, nothing evicted for it
    assert "huge" not in flash and len(flash) == 3


def test_the_order_of_use_survives_a_restart_and_a_smaller_budget(tmp_path):
    flash = FlashEntries(tmp_path, budget_bytes=1000)
    for name in ("a", "b", "c"):
        flash.put(name, name.encode() * 100)
    flash.get("a")
    (tmp_path / "half-written.entry.123.tmp").write_bytes(b"partial")  # power lost mid-write
    again = FlashEntries(tmp_path, budget_bytes=200)  # the board restarts with less room
    assert [n for n in "abc" if n in again] == ["a", "c"]  # b was the least recently used
    assert again.get("c") == b"c" * 100 and again.size_bytes == 200
    assert not list(tmp_path.glob("*.tmp"))


def test_a_failing_card_keeps_less_and_raises_nothing(tmp_path):
    flash = FlashEntries(tmp_path / "card", budget_bytes=1000)
    flash.put("a", b"a" * 10)
    (tmp_path / "card" / FlashEntries.file_name("a")).unlink()  # removed behind the tier's back
    assert flash.get("a") is None and "a" not in flash
    flash.directory.rename(tmp_path / "unmounted")  # writes now fail (as on a full or pulled card)
    flash.put("b", b"b" * 10)
    assert "b" not in flash and flash.size_bytes == 0


@pytest.mark.model
@pytest.mark.cachebox
def test_a_restarted_board_is_served_from_its_flash_with_no_network(valkey_url, namespace, make_board, tmp_path):
    flash = {"flash_tier_bytes": 64 * 1024 * 1024, "flash_dir": tmp_path / "flash"}
    board = make_board(valkey_url, namespace, device="dev-flash", **flash)
    cold = board.run(QUESTION, max_tokens=8, use_cache=False)
    board.run(QUESTION, max_tokens=8)  # computed here: kept on flash (and shared)
    kept = board.status()["flash_tier"]
    assert kept["entries"] >= 2 and kept["bytes"] > 0
    restarted = make_board(valkey_url, namespace, device="dev-flash", **flash)  # nothing in RAM or context
    again = restarted.run(QUESTION, max_tokens=8)
    b = again.breakdown
    assert (b.tier, b.case, b.decision) == ("flash", "full", "local")
    assert b.fetched_bytes == 0 and b.redis_ms == 0 and b.prefill_ms == 0 and b.local_ms > 0
    assert b.flash_tokens == b.matched_tokens and b.fetched_tokens == 0  # said as the flash tier's, not the cache box's
    assert again.tokens == cold.tokens


@pytest.mark.model
@pytest.mark.cachebox
def test_a_flash_file_changed_on_disk_is_removed_and_never_served(valkey_url, namespace, make_board, tmp_path):
    folder = tmp_path / "flash"
    flash = {"flash_tier_bytes": 64 * 1024 * 1024, "flash_dir": folder}
    board = make_board(valkey_url, namespace, device="dev-flash", **flash)
    cold = board.run(QUESTION, max_tokens=8, use_cache=False)
    board.run(QUESTION, max_tokens=8)
    files = sorted(folder.glob("*.entry"))
    for path in files:  # flip the last byte of every stored state
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = make_board(valkey_url, namespace, device="dev-flash", **flash)
    restarted.catalogs.sync_all()
    result = restarted.run(QUESTION, max_tokens=8)
    b = result.breakdown
    assert b.rejected_entries >= 1 and b.tier != "flash"
    assert result.tokens == cold.tokens  # served from the cache box's good copy (or computed)
    # The changed files were removed, and good copies kept again after this run.
    second = make_board(valkey_url, namespace, device="dev-flash", **flash).run(QUESTION, max_tokens=8)
    assert second.breakdown.tier == "flash" and second.breakdown.rejected_entries == 0 and second.tokens == cold.tokens

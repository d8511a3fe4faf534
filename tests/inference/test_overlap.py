"""Loading while computing, state codecs, the fetch deadline and compute profiles, on the real
model and a real Valkey: every path gives the cold run's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from cachebox import codec
from cachebox.entry import decode_header
from cachebox.keys import entry_key_name, grid_cuts, prefix_keys, range_boundaries
from cachebox.link import LINK_PRESETS, LinkProfile
from cachebox.store import CacheBox
from inference.board.config import BoardConfig
from inference.board.runtime import Board
from inference.engine.compute_profile import ComputeProfile, Pacer
from inference.engine.llama import MAIN_SEQ
from inference.serving.breakeven import BreakEvenPolicy, FetchPlan

pytestmark = [pytest.mark.model, pytest.mark.cachebox]

CONTEXT = "".join(
    f"Entry {i}: the ferry left pier {i % 9} at {i % 12} o'clock with {i % 31} cars.\n" for i in range(40)
)
QUESTION = "Question: which pier did the last ferry leave from?\nAnswer:"


class SplitPolicy(BreakEvenPolicy):
    """The real policy, except that it always plans to compute up to ``split`` while the rest loads,
    forecasting each range to take ``range_ms`` (so the board computes rather than waits)."""

    def __init__(self, split: int, range_ms: float = 10_000.0, **kwargs):
        super().__init__(**kwargs)
        self.split = split
        self.range_ms = range_ms

    def plan(self, floor, ranges):
        plan = super().plan(floor, ranges)
        arrivals = tuple(self.range_ms * (index + 1) for index in range(len(ranges)))
        return FetchPlan(
            True,
            max(floor, self.split),
            plan.predicted_ms,
            plan.predicted_fetch_ms,
            plan.predicted_prefill_ms,
            arrivals,
        )


@pytest.fixture
def board_for(engine, signing_keys, valkey_url, namespace):
    """Boards on the session's engine with a chosen link, policy and codec; no local tiers."""
    built = []

    def build(
        *, link: LinkProfile | None = None, policy: BreakEvenPolicy | None = None, device: str = "board-a", **options
    ):
        store = CacheBox(valkey_url, connect_timeout=0.5, timeout=30.0, link=link)
        config = BoardConfig(
            device=device, namespace=namespace, context_reuse=False, ram_tier_bytes=0, link=link, **options
        )
        board = Board(engine, store, config, background_sync=False, keys=signing_keys)
        if policy is not None:
            board.prefix.policy = policy
        board.catalogs.sync_all()  # what other boards stored so far (no background puller here)
        built.append(board)
        return board

    yield build
    engine.pacer = None  # the session's engine runs at this machine's speed for the next test


def names_of(board, text, namespace):
    tokens = board.prefix.tokenize([text])[0]
    ends = range_boundaries(len(tokens), 128)
    keys = prefix_keys(namespace, board.engine.fingerprint, tokens, ends, grid=128)
    return tokens, [entry_key_name(namespace, board.engine.fingerprint, key) for key in keys]


def test_front_computed_then_loaded_ranges_restored_in_order_give_the_cold_logits_bitwise(engine):
    tokens = engine.tokenize(CONTEXT + QUESTION, add_bos=True)
    total, last = len(tokens), len(tokens) - 1
    assert total > 600
    with engine.lock:
        engine.clear()
        cold = engine.prefill(tokens, 0, logits_at={last}, cuts=grid_cuts(total, 128))[last]
        back = [engine.export_range(256, 384), engine.export_range(384, 512)]
        engine.clear()
        engine.prefill(tokens[:256], 0, cuts=grid_cuts(total, 128))  # the front, computed on the grid
        for state in back:  # the back, loaded meanwhile, restored in position order at the meeting
            engine.import_range(state)
        assert engine.positions(MAIN_SEQ) == (0, 511)
        warm = engine.prefill(tokens[512:], 512, logits_at={last}, cuts=grid_cuts(total, 128, 512))[last]
        engine.remove(MAIN_SEQ)
    assert np.array_equal(cold, warm)


def test_computing_the_front_while_the_back_loads_gives_the_cold_answer(board_for, engine, namespace):
    prompt = CONTEXT + QUESTION
    seeder = board_for(device="seeder")
    cold = seeder.run(prompt, max_tokens=24, use_cache=False)
    seeder.run(prompt, max_tokens=1)  # stores every range, the last with its logits
    # The board computes slower than the loads come (a paced engine, an unshaped link), so the
    # ranges are all there when its first batch ends: they meet at 128.
    board = board_for(policy=SplitPolicy(256), compute_profile="")
    engine.pacer = Pacer(ComputeProfile("test", "test board", 4.0, "test"))
    served = board.run(prompt, max_tokens=24)
    engine.pacer = None
    b = served.breakdown
    assert served.tokens == cold.tokens
    assert (b.planned_split, b.met_at, b.tier, b.decision) == (256, 128, "cachebox", "fetch")
    assert b.matched_tokens == b.prompt_tokens - 128 and b.case == "partial"
    assert b.uploaded_bytes == 0  # the front it computed is in the cache box already


def test_when_the_loads_are_due_before_a_batch_would_end_the_board_waits_for_them(board_for, namespace):
    prompt = CONTEXT + QUESTION
    seeder = board_for(device="seeder")
    cold = seeder.run(prompt, max_tokens=8, use_cache=False)
    seeder.run(prompt, max_tokens=1)
    # Planned to compute the front, but every range is forecast within 10 ms: a 128-token batch
    # (hundreds of ms) would end after them, so it waits and computes nothing.
    board = board_for(policy=SplitPolicy(256, range_ms=10.0))
    served = board.run(prompt, max_tokens=8)
    b = served.breakdown
    assert served.tokens == cold.tokens
    assert (b.met_at, b.case, b.prefill_ms) == (0, "full", 0.0)


@pytest.mark.parametrize("cores", [None, 64], ids=["checked-at-the-meeting", "checked-by-the-loader"])
def test_a_range_that_fails_verification_mid_way_is_computed_instead(board_for, engine, namespace, monkeypatch, cores):
    if cores:  # an engine on fewer threads than cores: the loader checks each range as it arrives
        monkeypatch.setattr("inference.serving.prefix.os.cpu_count", lambda: cores)
    prompt = CONTEXT + QUESTION
    seeder = board_for(device="seeder")
    cold = seeder.run(prompt, max_tokens=16, use_cache=False)
    seeder.run(prompt, max_tokens=1)
    tokens, names = names_of(seeder, prompt, namespace)
    raw = seeder.store.redis.get(names[2])  # [256, 384): the third range, loaded after the back
    damaged = bytearray(raw)
    damaged[-100] ^= 0xFF
    seeder.store.redis.set(names[2], bytes(damaged))
    board = board_for(policy=SplitPolicy(128))
    engine.pacer = Pacer(ComputeProfile("test", "test board", 4.0, "test"))
    served = board.run(prompt, max_tokens=16)
    engine.pacer = None
    b = served.breakdown
    assert served.tokens == cold.tokens
    assert b.rejected_entries == 1
    assert seeder.store.redis.get(names[2]) not in (
        None,
        bytes(damaged),
    )  # evicted, then stored again by the board that computed it
    assert b.matched_tokens >= len(tokens) - 384  # the ranges after it still served


def test_a_link_slower_than_forecast_hits_the_deadline_and_computes(board_for, namespace):
    prompt = CONTEXT + QUESTION
    seeder = board_for(device="seeder")
    cold = seeder.run(prompt, max_tokens=8, use_cache=False)
    seeder.run(prompt, max_tokens=1)
    # The policy believes in gigabit Ethernet; the link is a quarter of Wi-Fi 4 (~0.6 MB/s).
    crawl = LinkProfile(5.0, 4.0, "a slowed link")
    _, names = names_of(seeder, prompt, namespace)
    whole_chain_ms = sum(seeder.store.redis.strlen(name) for name in names) / crawl.bytes_per_second * 1000
    board = board_for(link=crawl, policy=BreakEvenPolicy(prefill_ms_per_token=30.0, link=LINK_PRESETS["gigabit"]))
    served = board.run(prompt, max_tokens=8)
    b = served.breakdown
    assert served.tokens == cold.tokens
    assert b.fetch_late and b.planned_split == 0 and b.predicted_fetch_ms < 200
    assert b.decision in ("deadline", "fetch") and b.matched_tokens < b.prompt_tokens
    assert b.ttft_ms < whole_chain_ms  # it never waited for the whole chain


@pytest.mark.parametrize("name", [codec.ZSTD_SHUFFLE, codec.ZSTD])
def test_compressed_entries_serve_the_cold_answer_and_are_smaller(board_for, namespace, name):
    prompt = CONTEXT + QUESTION
    writer = board_for(device="writer", codec=name)
    cold = writer.run(prompt, max_tokens=16, use_cache=False)
    writer.run(prompt, max_tokens=1)
    _, names = names_of(writer, prompt, namespace)
    header, _ = decode_header(writer.store.redis.getrange(names[0], 0, 4095))
    assert header.codec == name and header.state_bytes < header.raw_bytes
    reader = board_for(device="reader", policy=BreakEvenPolicy(mode="always"))
    served = reader.run(prompt, max_tokens=16)
    assert served.breakdown.case == "full" and served.breakdown.codec == name
    assert served.tokens == cold.tokens


def test_a_codec_the_board_does_not_know_is_a_miss_not_an_eviction(board_for, namespace, monkeypatch):
    prompt = CONTEXT + QUESTION
    writer = board_for(device="writer", codec=codec.ZSTD_SHUFFLE)
    cold = writer.run(prompt, max_tokens=8, use_cache=False)
    writer.run(prompt, max_tokens=1)
    _, names = names_of(writer, prompt, namespace)
    monkeypatch.setattr(codec, "CODECS", (codec.RAW,))  # an older board
    reader = board_for(device="reader", policy=BreakEvenPolicy(mode="always"))
    served = reader.run(prompt, max_tokens=8)
    assert served.tokens == cold.tokens
    assert served.breakdown.matched_tokens == 0 and served.breakdown.rejected_entries == 0
    assert all(writer.store.redis.exists(name) for name in names)  # still there for boards that read it


def test_a_paced_board_takes_its_profiles_time_and_says_it_is_emulated(board_for):
    board = board_for(compute_profile="pi-zero-2w")
    result = board.run("A short prompt about ferries and piers.", max_tokens=2, use_cache=False)
    b = result.breakdown
    assert b.compute_profile == "Raspberry Pi Zero 2 W (emulated)"
    assert b.prefill_ms >= 0.95 * b.prompt_tokens * 39.56
    # Pacing adds what this machine did not take itself (nothing when a loaded machine was slower still).
    assert b.paced_ms > 0 or b.prefill_ms - b.paced_ms >= 0.95 * b.prompt_tokens * 39.56
    assert board.status()["compute_profile"] == "Raspberry Pi Zero 2 W (emulated)"
    plain = board_for(device="board-b")  # a board without a profile runs at this machine's speed
    assert plain.engine.pacer is None
    assert plain.run("A short prompt about ferries.", max_tokens=1, use_cache=False).breakdown.compute_profile == ""


def test_a_run_says_when_it_fetches_and_when_it_prefills(board_for, namespace):
    """The stages a streamed run shows on the Run page, in order."""
    prompt = CONTEXT + QUESTION
    board = board_for(policy=BreakEvenPolicy(mode="always"))
    stages = []
    board.run(prompt, max_tokens=1, on_stage=stages.append)
    assert stages == ["prefilling"]  # cold: nothing to fetch
    stages.clear()
    board.run(prompt, max_tokens=1, on_stage=stages.append)
    assert stages == ["fetching"]  # a full hit computes nothing
    stages.clear()
    board.run(prompt + " The pier", max_tokens=1, on_stage=stages.append)
    assert stages == ["fetching", "prefilling"]  # a partial hit: the cached ranges, then the rest

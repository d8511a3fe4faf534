"""State codecs, the overlap planner and compute profiles: pure, millisecond tests."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachebox import codec
from cachebox.codec import CodecChoice, UnknownCodec
from cachebox.entry import EntryHeader, decoded_state, encode_entry, open_entry
from cachebox.errors import EntryError
from cachebox.link import LINK_PRESETS
from cachebox.signing import derive_keyring, shared_producer_ring
from inference.engine.compute_profile import PI_5, PI_ZERO_2W, Pacer, pacing_ms, profile_named
from inference.serving.breakeven import BreakEvenPolicy, LinearFit, Range, overlap_ms

RING = shared_producer_ring(derive_keyring(b"m" * 32, "ns", 1))


def f16_like_state(count: int = 40_000, seed: int = 0) -> bytes:
    """Bytes shaped like a KV state: f16 values of similar magnitude."""
    return np.random.default_rng(seed).normal(0, 1.5, count).astype(np.float16).tobytes()


@given(st.binary(max_size=2048), st.sampled_from([1, 2, 4]))
@settings(max_examples=200, deadline=None)
def test_shuffle_round_trips_any_bytes(data, width):
    assert codec.unshuffle(codec.shuffle(data, width), width) == data


@pytest.mark.parametrize("name", codec.CODECS)
def test_every_codec_round_trips_a_state(name):
    state = f16_like_state()
    stored = codec.encode(state, name)
    assert codec.decode(stored, name, len(state)) == state


def test_byte_shuffle_makes_f16_states_smaller_than_plain_zstd():
    state = f16_like_state()
    plain, shuffled = len(codec.encode(state, codec.ZSTD)), len(codec.encode(state, codec.ZSTD_SHUFFLE))
    assert shuffled < plain < len(state)


def test_corrupted_compressed_bytes_are_refused():
    state = f16_like_state()
    stored = bytearray(codec.encode(state, codec.ZSTD_SHUFFLE))
    stored[len(stored) // 2] ^= 0xFF
    stored[len(stored) // 3] ^= 0x55
    with pytest.raises(EntryError):
        codec.decode(bytes(stored), codec.ZSTD_SHUFFLE, len(state))


def test_decoding_never_makes_more_than_the_signed_size():
    state = bytes(1_000_000)  # compresses to almost nothing: a bomb if the size were not bounded
    stored = codec.encode(state, codec.ZSTD)
    with pytest.raises(EntryError, match="decompress|decodes"):
        codec.decode(stored, codec.ZSTD, 1000)


def test_an_unknown_codec_is_its_own_error():
    with pytest.raises(UnknownCodec):
        codec.decode(b"x", "brotli-9", 1)
    assert issubclass(UnknownCodec, EntryError)


def test_a_compressed_entry_is_signed_over_its_stored_bytes_and_decodes_to_the_state():
    state = f16_like_state()
    stored = codec.encode(state, codec.ZSTD_SHUFFLE)
    header = EntryHeader("f" * 16, "ns", 0, 128, "d" * 32, 0, codec=codec.ZSTD_SHUFFLE, raw_bytes=len(state))
    blob = encode_entry(header, stored, RING)
    parsed, opened = open_entry(blob, RING, max_state_bytes=1 << 22)
    assert (parsed.codec, parsed.raw_bytes, parsed.decoded_bytes) == (codec.ZSTD_SHUFFLE, len(state), len(state))
    assert decoded_state(parsed, opened) == state
    tampered = bytearray(blob)
    tampered[-10] ^= 1
    with pytest.raises(EntryError, match="authenticate"):  # refused before anything is decompressed
        open_entry(bytes(tampered), RING, max_state_bytes=1 << 22)
    with pytest.raises(EntryError, match="limit"):  # the decoded size counts against the limit
        open_entry(blob, RING, max_state_bytes=len(stored) + 10)


def test_codec_choice_compresses_only_on_slow_links():
    choice = CodecChoice(ratio=1.18, decode_ms_per_mb=1.6)
    assert choice.choose(LINK_PRESETS["wifi4"].bytes_per_second) == codec.ZSTD_SHUFFLE
    assert choice.choose(LINK_PRESETS["fast-ethernet"].bytes_per_second) == codec.ZSTD_SHUFFLE
    assert choice.choose(LINK_PRESETS["gigabit"].bytes_per_second) == codec.RAW
    assert choice.choose(None) == codec.RAW  # unshaped (loopback): decoding would cost more than it saves


# -- the overlap planner -----------------------------------------------------------------------
def grid_ranges(floor: int, end: int, grid: int = 128, bytes_per_token: int = 18_500) -> list[Range]:
    cuts = list(range(floor, end, grid)) + [end]
    return [Range(a, b, (b - a) * bytes_per_token) for a, b in zip(cuts, cuts[1:])]


def test_on_a_fast_link_the_plan_loads_everything():
    policy = BreakEvenPolicy(prefill_ms_per_token=2.0, link=None)
    plan = policy.plan(0, grid_ranges(0, 512))
    assert plan.fetch and plan.split == 0 and plan.predicted_ms < plan.predicted_prefill_ms


def test_on_a_slow_link_the_plan_computes_the_front_while_the_back_loads():
    wifi = LINK_PRESETS["wifi4"]  # ~7 ms a token of f16 state; the board computes at 4 ms a token
    policy = BreakEvenPolicy(prefill_ms_per_token=4.0, link=wifi)
    ranges = grid_ranges(0, 512)
    plan = policy.plan(0, ranges)
    assert plan.fetch and 0 < plan.split < 512
    assert plan.predicted_ms <= 0.75 * plan.predicted_prefill_ms  # better than computing ...
    assert plan.predicted_ms < 0.5 * plan.predicted_fetch_ms  # ... and far better than waiting for it all
    without = BreakEvenPolicy(prefill_ms_per_token=4.0, link=wifi, overlap=False).plan(0, ranges)
    assert not without.fetch  # without the overlap, recomputing wins: the paper's Wi-Fi result


def test_arrivals_are_forecast_back_to_front_and_give_deadlines():
    policy = BreakEvenPolicy(prefill_ms_per_token=50.0, link=LINK_PRESETS["wifi4"])
    plan = policy.plan(0, grid_ranges(0, 300))
    assert plan.fetch and plan.split == 0
    assert list(plan.arrivals_ms) == sorted(plan.arrivals_ms) and len(plan.arrivals_ms) == 3
    assert plan.deadline_ms(0) == pytest.approx(plan.arrivals_ms[0] * 1.5 + 128 * 50.0)  # one batch of slack
    assert plan.deadline_ms(3) is None


def test_forced_modes_ignore_the_forecast():
    ranges = grid_ranges(128, 512)
    always = BreakEvenPolicy(mode="always", prefill_ms_per_token=0.001).plan(128, ranges)
    assert always.fetch and always.split == 128 and always.deadline_ms(0) is None  # waits for it all
    assert not BreakEvenPolicy(mode="never").plan(128, ranges).fetch
    assert not BreakEvenPolicy().plan(0, []).fetch


def test_overlap_line_meets_where_both_finish_together():
    prefill, fetch = LinearFit(4.0, 0.0, 3), LinearFit(7.0, 10.0, 3)
    total = overlap_ms(500, prefill, fetch)
    split = total / 4.0
    assert total == pytest.approx(fetch.predict(500 - split))
    assert total < min(prefill.predict(500), fetch.predict(500))
    assert overlap_ms(2, prefill, fetch) == pytest.approx(8.0)  # done before the first byte would come
    assert overlap_ms(0, prefill, fetch) == 0.0


# -- compute profiles ------------------------------------------------------------------------
def test_profiles_carry_the_papers_rates_and_say_they_are_emulated():
    assert PI_ZERO_2W.prefill_ms_per_token == pytest.approx(39.56, abs=0.01)
    assert PI_5.prefill_ms_per_token == pytest.approx(4.99, abs=0.01)
    assert "emulated" in PI_ZERO_2W.emulated_label and "table" in PI_ZERO_2W.source
    assert profile_named("") is None and profile_named("none") is None
    assert profile_named("pi5") is PI_5
    with pytest.raises(ValueError, match="pi-zero-2w"):
        profile_named("pi4")


def test_pacing_makes_a_batch_take_the_profiles_time():
    assert pacing_ms(PI_ZERO_2W, 100, 150.0) == pytest.approx(100 * 39.56 - 150.0)
    assert pacing_ms(PI_5, 10, 500.0) == 0.0  # already slower than the profile: no pause


def test_pacer_slows_decoding_by_the_prefill_factor(monkeypatch):
    slept = []
    monkeypatch.setattr("inference.engine.compute_profile.time.sleep", slept.append)
    pacer = Pacer(PI_5)
    pacer.after_prefill(128, 128.0)  # 1 ms a token here, 4.99 on the profile
    pacer.after_decode(10.0)
    assert slept[0] == pytest.approx((128 * 4.99 - 128) / 1000)
    assert slept[1] == pytest.approx(10.0 * (4.99 - 1) / 1000, rel=0.01)
    assert pacer.total_ms == pytest.approx(sum(slept) * 1000)


@pytest.mark.model
def test_a_board_measures_its_prefill_and_decode_rates_at_start_at_its_profiles_pace(engine):
    from inference.board.runtime import calibrate

    own = calibrate(engine, prompt_tokens=24, decode_tokens=2)
    assert own.prefill_ms_per_token > 0 and own.decode_ms_per_token > 0  # this machine's speed (whatever its load)
    assert (
        own.prompt_tokens == 24 and own.decode_tokens in (2, 4, 6) and own.compute_profile == ""
    )  # repeated while it fits its budget
    engine.pacer = Pacer(PI_ZERO_2W)  # as `make run` paces its zero board
    try:
        paced = calibrate(engine, prompt_tokens=24, decode_tokens=2)
    finally:
        engine.pacer = None
    assert paced.prefill_ms_per_token >= PI_ZERO_2W.prefill_ms_per_token  # never faster than the class it emulates
    assert paced.decode_ms_per_token > 0 and paced.compute_profile == "pi-zero-2w"
    assert paced.decode_tokens == 2  # one repetition: a paced board spends its budget on it
    assert engine.positions(engine.scratch_seq) == (-1, -1)  # it leaves nothing in the context

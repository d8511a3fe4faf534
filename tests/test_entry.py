"""Entry encoding and verification: pure, millisecond tests."""

import numpy as np
import pytest

from cachebox.entry import EntryHeader, decode_header, encode_entry, state_checksum, verify_state
from cachebox.errors import EntryError


def make(state=b"\x01\x02" * 1000, **overrides):
    fields = dict(
        fingerprint="f" * 16,
        namespace="ns",
        start=64,
        end=128,
        tokens_digest="d" * 32,
        state_bytes=len(state),
        checksum=state_checksum(state),
        device="zero",
        top_ids=np.array([5, 3, 9], dtype=np.int32),
        top_logits=np.array([2.5, 1.0, -3.0], dtype=np.float32),
    )
    fields.update(overrides)
    return EntryHeader(**fields), state


def test_entry_round_trip_keeps_header_state_and_top_logits():
    header, state = make()
    blob = encode_entry(header, state)
    parsed, offset = decode_header(blob)
    assert blob[offset:] == state
    assert (parsed.start, parsed.end, parsed.token_count, parsed.device) == (64, 128, 64, "zero")
    assert parsed.top_ids.tolist() == [5, 3, 9]
    assert parsed.top_logits.tolist() == [2.5, 1.0, -3.0]
    verify_state(parsed, blob[offset:])


def test_header_without_logits_round_trips():
    header, state = make(top_ids=None, top_logits=None)
    parsed, _ = decode_header(encode_entry(header, state))
    assert parsed.top_ids is None and parsed.top_logits is None


def test_short_prefix_asks_for_more_bytes():
    header, state = make()
    blob = encode_entry(header, state)
    needed = decode_header(blob[:20])
    assert isinstance(needed, int) and needed > 20
    assert decode_header(blob[:needed])[1] == needed


@pytest.mark.parametrize(
    "blob",
    [b"", b"ECE", b"XXXX\x05\x00\x00\x00hello", b"ECE1\xff\xff\xff\x7f", b"ECE1\x05\x00\x00\x00{bad}"],
)
def test_garbage_is_an_entry_error_not_a_crash(blob):
    with pytest.raises(EntryError):
        decode_header(blob)


def test_impossible_range_is_rejected():
    header, state = make(start=10, end=10)
    with pytest.raises(EntryError, match="impossible range"):
        decode_header(encode_entry(header, state))


def test_corrupted_or_truncated_state_fails_verification():
    header, state = make()
    flipped = bytearray(state)
    flipped[100] ^= 0xFF
    with pytest.raises(EntryError, match="checksum"):
        verify_state(header, bytes(flipped))
    with pytest.raises(EntryError, match="bytes"):
        verify_state(header, state[:-1])


def test_encode_refuses_a_header_that_lies_about_the_state():
    header, state = make()
    with pytest.raises(ValueError):
        encode_entry(header, state + b"x")

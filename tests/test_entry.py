"""Entry encoding, signing and verification: pure, millisecond tests."""

import numpy as np
import pytest

from cachebox.entry import (
    EntryHeader,
    decode_header,
    encode_entry,
    open_entries,
    open_entry,
    state_checksum,
    verify_header,
    verify_state,
)
from cachebox.errors import EntryError
from cachebox.signing import UnknownKey, derive_keyring

MASTER = b"m" * 32
RING = derive_keyring(MASTER, "ns", 1)


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
    blob = encode_entry(header, state, RING)
    parsed, offset = open_entry(blob, RING, max_state_bytes=1 << 20)
    assert blob[offset:] == state
    assert (parsed.start, parsed.end, parsed.token_count, parsed.device, parsed.key_generation) == (64, 128, 64, "zero", 1)
    assert parsed.top_ids.tolist() == [5, 3, 9]
    assert parsed.top_logits.tolist() == [2.5, 1.0, -3.0]


def test_header_without_logits_round_trips():
    header, state = make(top_ids=None, top_logits=None)
    parsed, _ = decode_header(encode_entry(header, state, RING))
    assert parsed.top_ids is None and parsed.top_logits is None


def test_short_prefix_asks_for_more_bytes():
    header, state = make()
    blob = encode_entry(header, state, RING)
    needed = decode_header(blob[:20])
    assert isinstance(needed, int) and needed > 20
    assert decode_header(blob[:needed])[1] == needed


@pytest.mark.parametrize(
    "blob",
    [b"", b"ECE", b"XXXX\x05\x00\x00\x00hello", b"ECE2\xff\xff\xff\x7f", b"ECE2\x05\x00\x00\x00" + b"m" * 32 + b"{bad}"],
)
def test_garbage_is_an_entry_error_not_a_crash(blob):
    with pytest.raises(EntryError):
        decode_header(blob)


def test_impossible_range_is_rejected():
    header, state = make(start=10, end=10)
    with pytest.raises(EntryError, match="impossible range"):
        decode_header(encode_entry(header, state, RING))


def test_corrupted_or_truncated_state_fails_verification():
    header, state = make()
    flipped = bytearray(state)
    flipped[100] ^= 0xFF
    with pytest.raises(EntryError, match="digest"):
        verify_state(header, bytes(flipped))
    with pytest.raises(EntryError, match="bytes"):
        verify_state(header, state[:-1])


def test_digest_covers_every_byte_of_a_large_state():
    state = bytes(3 * (1 << 20) + 17)
    digest = state_checksum(state)
    for where in (0, (1 << 20) + 5, len(state) - 1):
        changed = bytearray(state)
        changed[where] = 1
        assert state_checksum(bytes(changed)) != digest
    assert state_checksum(memoryview(state)) == digest


def test_encode_refuses_a_header_that_lies_about_the_state():
    header, state = make()
    with pytest.raises(ValueError):
        encode_entry(header, state + b"x", RING)


def test_a_forger_without_the_key_is_refused():
    """Re-signing a changed header with another key, or changing any header byte, fails the MAC."""
    header, state = make()
    forged = encode_entry(header, state, derive_keyring(b"x" * 32, "ns", 1))
    with pytest.raises(EntryError, match="signature"):
        open_entry(forged, RING, 1 << 20)
    blob = bytearray(encode_entry(make()[0], state, RING))
    at = bytes(blob).index(b'"start":64')
    blob[at + 9] = ord("0")  # start 64 -> 60 without re-signing
    with pytest.raises(EntryError, match="signature"):
        open_entry(bytes(blob), RING, 1 << 20)


def test_a_state_swapped_under_a_genuine_header_is_refused():
    header, state = make()
    blob = encode_entry(header, state, RING)
    offset = decode_header(blob)[1]
    swapped = blob[:offset] + bytes(len(state))
    with pytest.raises(EntryError, match="digest"):
        open_entry(swapped, RING, 1 << 20)
    with pytest.raises(EntryError, match="bytes"):
        open_entry(blob[:-10], RING, 1 << 20)


def test_entries_of_another_namespace_are_outside_the_ring():
    header, state = make(namespace="other")
    blob = encode_entry(header, state, derive_keyring(MASTER, "other", 1))
    with pytest.raises(EntryError, match="outside"):
        verify_header(decode_header(blob)[0], RING)


def test_rotation_keeps_the_previous_key_and_retires_older_ones():
    header, state = make()
    old = encode_entry(header, state, RING)
    ring2, ring3 = derive_keyring(MASTER, "ns", 2), derive_keyring(MASTER, "ns", 3)
    open_entry(old, ring2, 1 << 20)  # one rotation later: still valid
    with pytest.raises(EntryError, match="retired"):
        open_entry(old, ring3, 1 << 20)
    newer = encode_entry(make()[0], state, ring3)
    with pytest.raises(UnknownKey):
        open_entry(newer, RING, 1 << 20)


def test_size_limit_is_checked_before_the_state_is_hashed():
    header, state = make()
    with pytest.raises(EntryError, match="limit"):
        open_entry(encode_entry(header, state, RING), RING, max_state_bytes=len(state) - 1)


def test_entries_of_one_fetch_are_opened_together_each_with_its_verdict():
    good = [encode_entry(make(start=start, end=start + 64)[0], make()[1], RING) for start in (0, 64, 128)]
    bad = good[1][:-1]
    results = open_entries([good[0], bad, good[2]], RING, 1 << 20)
    assert results[0][0].start == 0 and results[2][0].start == 128
    assert isinstance(results[1], EntryError)

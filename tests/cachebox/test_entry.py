"""Entry sealing, signing and verification: pure, millisecond tests."""

import numpy as np
import pytest

from cachebox.entry import (
    SEAL_OVERHEAD,
    EntryHeader,
    decode_header,
    encode_entry,
    open_entries,
    open_entry,
    open_state,
    verify_header,
)
from cachebox.errors import EntryError
from cachebox.signing import CHACHA20, UnknownKey, derive_keyring, shared_producer_ring

MASTER = b"m" * 32
RING = shared_producer_ring(derive_keyring(MASTER, "ns", 1))


def make(state=b"\x01\x02" * 1000, **overrides):
    fields = dict(
        fingerprint="f" * 16,
        namespace="ns",
        start=64,
        end=128,
        tokens_digest="d" * 32,
        state_bytes=0,
        device="zero",
        top_ids=np.array([5, 3, 9], dtype=np.int32),
        top_logits=np.array([2.5, 1.0, -3.0], dtype=np.float32),
    )
    fields.update(overrides)
    return EntryHeader(**fields), state


@pytest.mark.parametrize("cipher", ["aes-256-gcm", CHACHA20])
def test_entry_round_trip_keeps_header_state_and_top_logits(cipher):
    header, state = make(cipher=cipher)
    blob = encode_entry(header, state, RING)
    parsed, opened = open_entry(blob, RING, max_state_bytes=1 << 20)
    assert opened == state and parsed.cipher == cipher and parsed.state_bytes == len(state) + SEAL_OVERHEAD
    assert (
        parsed.start,
        parsed.end,
        parsed.token_count,
        parsed.device,
        parsed.key_generation,
        parsed.tokens_digest,
    ) == (64, 128, 64, "zero", 1, "d" * 32)
    assert parsed.top_ids.tolist() == [5, 3, 9]
    assert parsed.top_logits.tolist() == [2.5, 1.0, -3.0]


def test_a_stored_entry_shows_neither_state_nor_tokens_nor_logits():
    """What a dump of the cache box holds: sizes and ranges, nothing a tenant wrote."""
    state = b"The launch code is 4471. " * 80
    header, _ = make(state, device="acme-secret-board", tokens_digest="feedface" * 4)
    blob = encode_entry(header, state, RING)
    for secret in (b"launch code", b"4471", b"acme-secret-board", b"feedface", np.array([5, 3, 9], "<i4").tobytes()):
        assert secret not in blob
    public, _ = decode_header(blob)  # without the key: no tokens digest, no creator, no logits
    assert public.tokens_digest == "" and public.device == "" and public.top_ids is None


def test_header_without_logits_round_trips():
    header, state = make(top_ids=None, top_logits=None)
    parsed, _ = decode_header(encode_entry(header, state, RING))
    verify_header(parsed, RING)
    assert parsed.top_ids is None and parsed.top_logits is None


def test_short_prefix_asks_for_more_bytes():
    header, state = make()
    blob = encode_entry(header, state, RING)
    needed = decode_header(blob[:20])
    assert isinstance(needed, int) and needed > 20
    assert decode_header(blob[:needed])[1] == needed


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"ECE",
        b"XXXX\x05\x00\x00\x00hello",
        b"ECE3\xff\xff\xff\x7f",
        b"ECE3\x05\x00\x00\x00" + b"m" * 32 + b"{bad}",
        b"ECE2\x05\x00\x00\x00",
    ],
)
def test_garbage_is_an_entry_error_not_a_crash(blob):
    with pytest.raises(EntryError):
        decode_header(blob)


def test_impossible_range_is_rejected():
    header, state = make(start=10, end=10)
    with pytest.raises(EntryError, match="impossible range"):
        decode_header(encode_entry(header, state, RING))


def test_corrupted_or_truncated_state_fails_to_open():
    header, state = make()
    blob = encode_entry(header, state, RING)
    parsed, offset = decode_header(blob)
    verify_header(parsed, RING)
    sealed = bytearray(blob[offset:])
    sealed[100] ^= 0xFF
    with pytest.raises(EntryError, match="authenticate"):
        open_state(parsed, bytes(sealed), RING)
    with pytest.raises(EntryError, match="bytes"):
        open_state(parsed, blob[offset:-1], RING)


def test_authentication_covers_every_byte_of_a_large_state():
    state = bytes(3 * (1 << 20) + 17)
    blob = encode_entry(make(state)[0], state, RING)
    parsed, offset = decode_header(blob)
    verify_header(parsed, RING)
    assert open_state(parsed, memoryview(blob)[offset:], RING) == state
    for where in (offset, offset + (1 << 20) + 5, len(blob) - 1):
        changed = bytearray(blob)
        changed[where] ^= 1
        with pytest.raises(EntryError):
            open_state(parsed, bytes(changed[offset:]), RING)


def test_a_forger_without_the_key_is_refused():
    """Re-signing a changed header with another key, or changing any header byte, fails the MAC."""
    header, state = make()
    forged = encode_entry(header, state, shared_producer_ring(derive_keyring(b"x" * 32, "ns", 1)))
    with pytest.raises(EntryError, match="signature"):
        open_entry(forged, RING, 1 << 20)
    blob = bytearray(encode_entry(make()[0], state, RING))
    at = bytes(blob).index(b'"start":64')
    blob[at + 9] = ord("0")  # start 64 -> 60 without re-signing
    with pytest.raises(EntryError, match="signature"):
        open_entry(bytes(blob), RING, 1 << 20)


def test_a_state_swapped_under_a_genuine_header_is_refused():
    """Another entry's sealed state (same namespace, same size) under this header: the header is
    the state's associated data, so it does not open."""
    header, state = make()
    blob = encode_entry(header, state, RING)
    other = encode_entry(make(start=0, end=64)[0], state, RING)
    offset, other_offset = decode_header(blob)[1], decode_header(other)[1]
    swapped = blob[:offset] + other[other_offset:]
    with pytest.raises(EntryError, match="authenticate"):
        open_entry(swapped, RING, 1 << 20)
    with pytest.raises(EntryError, match="bytes"):
        open_entry(blob[:-10], RING, 1 << 20)


def test_another_namespace_with_its_own_key_cannot_open_a_state():
    header, state = make()
    blob = encode_entry(header, state, RING)
    parsed, offset = decode_header(blob)
    verify_header(parsed, RING)
    with pytest.raises(EntryError):
        open_state(parsed, blob[offset:], shared_producer_ring(derive_keyring(b"x" * 32, "ns", 1)))


def test_entries_of_another_namespace_are_outside_the_ring():
    header, state = make(namespace="other")
    blob = encode_entry(header, state, shared_producer_ring(derive_keyring(MASTER, "other", 1)))
    with pytest.raises(EntryError, match="outside"):
        verify_header(decode_header(blob)[0], RING)


def test_rotation_keeps_the_previous_key_and_retires_older_ones():
    header, state = make()
    old = encode_entry(header, state, RING)
    ring2, ring3 = (
        shared_producer_ring(derive_keyring(MASTER, "ns", 2)),
        shared_producer_ring(derive_keyring(MASTER, "ns", 3)),
    )
    open_entry(old, ring2, 1 << 20)  # one rotation later: still valid
    with pytest.raises(EntryError, match="retired"):
        open_entry(old, ring3, 1 << 20)
    newer = encode_entry(make()[0], state, ring3)
    with pytest.raises(UnknownKey):
        open_entry(newer, RING, 1 << 20)


def test_size_limit_is_checked_before_the_state_is_opened():
    header, state = make()
    with pytest.raises(EntryError, match="limit"):
        open_entry(encode_entry(header, state, RING), RING, max_state_bytes=len(state) - 1)


def test_entries_of_one_fetch_are_opened_together_each_with_its_verdict():
    good = [encode_entry(make(start=start, end=start + 64)[0], make()[1], RING) for start in (0, 64, 128)]
    bad = good[1][:-1]
    results = open_entries([good[0], bad, good[2]], RING, 1 << 20)
    assert results[0][0].start == 0 and results[2][0].start == 128
    assert isinstance(results[1], EntryError)


# -- producers: every entry names and is signed by the board that made it -----------------------
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from cachebox.signing import Producer, ProducerTable, QuarantinedProducer, UnknownProducer, public_hex  # noqa: E402

HONEST, LIAR = Producer("honest", Ed25519PrivateKey.generate()), Producer("liar", Ed25519PrivateKey.generate())
TABLE = ProducerTable("ns", {"honest": public_hex(HONEST.key), "liar": public_hex(LIAR.key)}, {}, "", 1)
BASE = derive_keyring(MASTER, "ns", 1)


def ring_of(producer, table=TABLE):
    return BASE.with_producers(producer, table)


def test_an_entry_names_its_producer_and_opens_under_its_signature():
    header, state = make()
    parsed, opened = open_entry(encode_entry(header, state, ring_of(HONEST)), ring_of(LIAR), 1 << 20)
    assert (parsed.producer, opened) == ("honest", state)


def test_a_ring_holder_resealing_another_state_under_an_honest_header_is_refused():
    """The probe: a member of the namespace (it holds the ring: MAC and data keys) puts another
    prompt's state behind an honest entry's header and signature. The state digest the producer
    signed does not match."""
    honest_blob = encode_entry(make()[0], b"\x01\x02" * 1000, ring_of(HONEST))
    parsed, offset = decode_header(honest_blob)
    other_state = b"\x07\x08" * 1000  # prompt Y's state, same size
    sealed = bytearray(parsed.state_bytes)
    ring_of(LIAR).seal_into(other_state, parsed.signed_bytes, memoryview(sealed), cipher=parsed.cipher)
    forged = honest_blob[:offset] + bytes(sealed)
    with pytest.raises(EntryError, match="not the one its producer 'honest' signed"):
        open_entry(forged, ring_of(HONEST), 1 << 20)


def test_a_header_resealed_by_another_board_under_the_honest_name_fails_its_signature():
    """The liar re-seals the whole entry with the ring but keeps the honest producer's name (its
    own signature under another's name): refused."""
    header, state = make()
    header.device = "honest"
    impostor = Producer("honest", LIAR.key)
    with pytest.raises(EntryError, match="producer signature does not match 'honest'"):
        open_entry(encode_entry(header, state, ring_of(impostor)), ring_of(HONEST), 1 << 20)


def test_signed_as_itself_a_liar_is_named_by_the_entry():
    """Re-sealed under its own name the entry opens (nothing refuses it before an audit) and names the liar."""
    header, state = make()
    parsed, _ = open_entry(encode_entry(header, b"\x07\x08" * 1000, ring_of(LIAR)), ring_of(HONEST), 1 << 20)
    assert parsed.producer == "liar"


def test_unknown_and_quarantined_producers_are_refused():
    blob = encode_entry(make()[0], make()[1], ring_of(LIAR))
    without = ProducerTable("ns", {"honest": public_hex(HONEST.key)}, {}, "", 2)
    with pytest.raises(UnknownProducer):  # a miss (the table may be older than the producer): refreshed, not evicted
        open_entry(blob, ring_of(HONEST, without), 1 << 20)
    quarantined = ProducerTable("ns", {"honest": public_hex(HONEST.key)}, {"liar": "audit: state differs"}, "", 3)
    with pytest.raises(QuarantinedProducer, match="quarantined: audit: state differs"):
        open_entry(blob, ring_of(HONEST, quarantined), 1 << 20)
    with pytest.raises(UnknownProducer, match="no producer table"):
        open_entry(blob, BASE, 1 << 20)
    with pytest.raises(ValueError, match="no producer key"):
        encode_entry(make()[0], make()[1], BASE)


def test_an_entry_of_the_previous_format_no_longer_opens():
    """ECE3 (no producer signature): refused by its magic bytes; its keys no longer match either
    (STATE_FORMAT_VERSION 6 enters the model fingerprint)."""
    from cachebox.keys import STATE_FORMAT_VERSION, ModelIdentity

    blob = bytearray(encode_entry(make()[0], make()[1], ring_of(HONEST)))
    blob[:4] = b"ECE3"
    with pytest.raises(EntryError, match="older format"):
        open_entry(bytes(blob), ring_of(HONEST), 1 << 20)
    assert STATE_FORMAT_VERSION == 6
    assert ModelIdentity("a", "f16", "b").fingerprint() != ModelIdentity("a", "f16", "b", state_format=5).fingerprint()


def test_the_producer_table_is_the_control_planes_word_and_never_goes_back():
    control = Ed25519PrivateKey.generate()
    signed = ProducerTable("ns", {"honest": public_hex(HONEST.key)}, {"liar": "revoked"}, "", 10).signed(control)
    table = ProducerTable.verified(signed, public_hex(control), "ns")
    assert table.quarantined == {"liar": "revoked"} and table.control_plane_key == public_hex(control)
    with pytest.raises(ValueError, match="replay"):
        ProducerTable.verified(signed, public_hex(control), "ns", newer_than=11)
    lifted = {**signed, "quarantined": {}}
    with pytest.raises(ValueError, match="not signed"):
        ProducerTable.verified(lifted, public_hex(control), "ns")
    with pytest.raises(ValueError, match="not signed"):
        ProducerTable.verified(ProducerTable("ns").signed(Ed25519PrivateKey.generate()), public_hex(control), "ns")
    with pytest.raises(ValueError, match="not 'other'"):
        ProducerTable.verified(signed, public_hex(control), "other")

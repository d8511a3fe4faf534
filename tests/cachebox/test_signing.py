"""Key rings: derivation, rotation, sealing for one device. Pure, millisecond tests."""

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from cachebox.errors import EntryError
from cachebox.signing import (
    Keychain,
    control_plane_key,
    derive_key,
    derive_keyring,
    open_data,
    pin_proof,
    private_namespace,
    public_hex,
    seal,
    seal_data,
    sign_document,
    unseal,
    verify_document,
)

MASTER = b"s" * 32
CONTROL = control_plane_key(MASTER)
CONTROL_KEY = public_hex(CONTROL)


def test_keys_differ_by_namespace_and_generation_and_master():
    keys = {derive_key(MASTER, ns, gen) for ns in ("a", "b") for gen in (1, 2)} | {derive_key(b"t" * 32, "a", 1)}
    assert len(keys) == 5
    assert derive_key(MASTER, "a", 1) == derive_key(MASTER, "a", 1)


def test_ring_holds_the_current_and_previous_generation():
    assert sorted(derive_keyring(MASTER, "a", 1).keys) == [1]
    assert sorted(derive_keyring(MASTER, "a", 5).keys) == [4, 5]
    with pytest.raises(ValueError):
        derive_keyring(b"short", "a", 1)


def test_a_sealed_ring_opens_only_with_the_boards_private_key_and_name():
    ring = derive_keyring(MASTER, "acme", 3, (private_namespace("acme", "zero"),))
    zero, pi5 = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    sealed = seal(ring, zero.public_key().public_bytes_raw(), "zero", CONTROL)
    opened = unseal(sealed, zero, "zero", CONTROL_KEY)
    assert opened == ring and opened.covers("acme.dev-zero") and not opened.covers("acme.dev-pi5")
    assert opened.name_key == ring.name_key and len(opened.name_key) == 32
    with pytest.raises(ValueError, match="cannot open"):
        unseal(sealed, pi5, "zero", CONTROL_KEY)
    with pytest.raises(ValueError, match="cannot open"):
        unseal(sealed, zero, "pi5", CONTROL_KEY)  # bound to the device name
    with pytest.raises(ValueError, match="cannot open"):
        unseal(sealed[:-4] + "AAAA", zero, "zero", CONTROL_KEY)
    assert (
        seal(ring, zero.public_key().public_bytes_raw(), "zero", CONTROL) != sealed
    )  # a fresh ephemeral key each time


def test_a_ring_sealed_to_a_board_by_anyone_but_the_control_plane_is_refused():
    """The probe: a sealed ring needs only the board's public key. The attacker seals a ring of its
    choosing (its own keys for the victim's namespace), signed with its own key or not at all."""
    zero = X25519PrivateKey.generate()
    planted = derive_keyring(b"attacker-master-secret-32-bytes!", "default", 1)
    for signer in (control_plane_key(b"attacker-master-secret-32-bytes!"), None):
        if signer is None:  # an older, unsigned seal
            from cachebox import signing

            sealed = signing.seal(planted, zero.public_key().public_bytes_raw(), "zero", CONTROL)
            raw = __import__("base64").b64decode(sealed)
            sealed = __import__("base64").b64encode(raw[:-1] + bytes([raw[-1] ^ 1])).decode()
        else:
            sealed = seal(planted, zero.public_key().public_bytes_raw(), "zero", signer)
        with pytest.raises(ValueError):
            unseal(sealed, zero, "zero", CONTROL_KEY)


def test_data_sealed_under_a_namespace_key_opens_only_with_it_and_its_context():
    ring, other = derive_keyring(MASTER, "acme", 1), derive_keyring(MASTER, "globex", 1)
    generation, sealed = ring.seal_data(b"Tenant secret: 4471", b"context")
    assert b"4471" not in sealed and generation == 1
    assert ring.open_data(generation, sealed, b"context") == b"Tenant secret: 4471"
    for opener, context in ((other, b"context"), (ring, b"other context")):
        with pytest.raises(EntryError):
            opener.open_data(generation, sealed, context)
    assert seal_data(b"k" * 32, b"same", b"") != seal_data(b"k" * 32, b"same", b"")  # a salt of its own each time
    with pytest.raises(EntryError, match="truncated"):
        open_data(b"k" * 32, b"short", b"")


def test_signed_documents_verify_only_unchanged_and_with_the_signers_key():
    doc = sign_document(CONTROL, {"name": "zero", "revoked": False})
    assert verify_document(doc, CONTROL_KEY)
    assert not verify_document({**doc, "revoked": True}, CONTROL_KEY)
    assert not verify_document(doc, public_hex(control_plane_key(b"t" * 32)))
    assert not verify_document({"name": "zero"}, CONTROL_KEY)
    assert (
        control_plane_key(MASTER).private_bytes_raw() == CONTROL.private_bytes_raw()
    )  # every process derives the same


def test_a_pin_proof_needs_the_token():
    proof = pin_proof("token-1", CONTROL_KEY)
    assert proof == pin_proof("token-1", CONTROL_KEY)
    assert proof != pin_proof("token-2", CONTROL_KEY) and proof != pin_proof("token-1", "00" * 32)


def test_keychain_remembers_and_refreshes_at_most_once_a_second():
    calls = []

    def source(namespace):
        calls.append(namespace)
        return derive_keyring(MASTER, namespace, 1)

    chain = Keychain(source)
    chain.ring("a"), chain.ring("a")
    assert calls == ["a"]
    assert chain.refresh() is True
    assert chain.refresh() is False  # too soon: a flood of unknown keys costs one re-read
    chain.ring("a")
    assert calls == ["a", "a"]

"""Key rings: derivation, rotation, sealing for one device. Pure, millisecond tests."""

import pytest

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from cachebox.signing import Keychain, derive_key, derive_keyring, private_namespace, seal, unseal

MASTER = b"s" * 32


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
    sealed = seal(ring, zero.public_key().public_bytes_raw(), "zero")
    opened = unseal(sealed, zero, "zero")
    assert opened == ring and opened.covers("acme.dev-zero") and not opened.covers("acme.dev-pi5")
    with pytest.raises(ValueError, match="cannot open"):
        unseal(sealed, pi5, "zero")
    with pytest.raises(ValueError, match="cannot open"):
        unseal(sealed, zero, "pi5")  # bound to the device name
    with pytest.raises(ValueError, match="cannot open"):
        unseal(sealed[:-4] + "AAAA", zero, "zero")
    assert seal(ring, zero.public_key().public_bytes_raw(), "zero") != sealed  # a fresh ephemeral key each time


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

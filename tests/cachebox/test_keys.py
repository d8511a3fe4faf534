"""Cache keys: pure, millisecond tests."""

import pytest

from cachebox.errors import InvalidNamespace
from cachebox.keys import (
    ModelIdentity,
    catalog_key_names,
    entry_key_name,
    entry_key_pattern,
    grid_cuts,
    parse_entry_key_name,
    prefix_keys,
    range_boundaries,
    tokens_digest,
)

IDENTITY = ModelIdentity(gguf_sha256="ab" * 32, kv_type="f16", llama_build="x")


def test_fingerprint_is_stable_and_sensitive_to_every_field():
    assert IDENTITY.fingerprint() == ModelIdentity("ab" * 32, "f16", "x").fingerprint()
    assert len(IDENTITY.fingerprint()) == 16
    others = [
        ModelIdentity("cd" * 32, "f16", "x"),
        ModelIdentity("ab" * 32, "q8_0", "x"),
        ModelIdentity("ab" * 32, "f16", "y"),
        ModelIdentity("ab" * 32, "f16", "x", state_format=99),
        ModelIdentity("ab" * 32, "f16", "x", repacked=True),  # repacked weights compute other bits
        ModelIdentity("ab" * 32, "f16", "x", kernels="x86_64-avx2:0123456789abcdef"),  # so do other kernels
        ModelIdentity("ab" * 32, "f16", "x", kernels="x86_64-avx512:fedcba9876543210"),
    ]
    assert len({IDENTITY.fingerprint(), *(o.fingerprint() for o in others)}) == 8


def test_a_model_without_repacked_weights_keeps_the_fingerprint_it_had_before_the_field():
    import hashlib
    import json

    before = json.dumps(
        {"gguf_sha256": "ab" * 32, "kv_type": "f16", "llama_build": "x", "state_format": IDENTITY.state_format},
        sort_keys=True,
        separators=(",", ":"),
    )
    assert (
        IDENTITY.fingerprint() == hashlib.blake2b(before.encode(), digest_size=8).hexdigest()
    )  # the entries already stored stay reachable


def test_the_context_size_is_no_part_of_a_models_identity():
    # States are the same bits whatever the context holds: boards sized to small memories share them.
    assert "n_ctx" not in ModelIdentity.__dataclass_fields__


def test_prefix_key_does_not_depend_on_where_earlier_ranges_were_cut():
    tokens = list(range(1, 200))
    a = prefix_keys("ns", "fp", tokens, [10, 64, 128], grid=64)
    b = prefix_keys("ns", "fp", tokens, [64, 128], grid=64)
    c = prefix_keys("ns", "fp", tokens, [128], grid=64)
    assert a[1] == b[0] and a[2] == b[1] == c[0]


def test_prefix_key_pins_every_earlier_token_model_and_namespace():
    tokens = list(range(1, 100))
    base = prefix_keys("ns", "fp", tokens, [50, 99], grid=64)
    changed_early = tokens.copy()
    changed_early[3] = 7777
    assert prefix_keys("ns", "fp", changed_early, [50, 99], grid=64)[1] != base[1]
    assert prefix_keys("ns", "fp2", tokens, [50, 99], grid=64) != base
    assert prefix_keys("other", "fp", tokens, [50, 99], grid=64) != base
    assert all(len(key) == 16 for key in base)


def test_prefix_keys_known_value_guards_the_format():
    # Changing the key derivation silently orphans every stored entry: make it a visible change.
    assert (
        prefix_keys("ns", "fp", [1, 2, 3], [3], grid=64)[0].hex()
        == prefix_keys("ns", "fp", [1, 2, 3], [1, 3], grid=64)[1].hex()
    )
    assert tokens_digest([1, 2, 3]) != tokens_digest([1, 2, 4])


@pytest.mark.parametrize("boundaries", [[0], [5, 5], [3, 2], [101]])
def test_prefix_keys_rejects_bad_boundaries(boundaries):
    with pytest.raises(ValueError):
        prefix_keys("ns", "fp", list(range(100)), boundaries, grid=64)


@pytest.mark.parametrize("namespace", ["", "a b", "x" * 65, "../etc", "tenant:1", "{tag}"])
def test_bad_namespaces_are_refused_with_a_clear_error(namespace):
    with pytest.raises(InvalidNamespace, match="namespace"):
        prefix_keys(namespace, "fp", [1], [1], grid=64)


def test_entry_key_names_use_a_cluster_hash_tag_and_round_trip():
    key = bytes(range(16))
    name = entry_key_name("tenant-a", "0123456789abcdef", key)
    assert name == "ec:e:tenant-a:0123456789abcdef:{000102030405060708090a0b0c0d0e0f}"
    assert parse_entry_key_name(name) == ("tenant-a", "0123456789abcdef", key)
    with pytest.raises(ValueError):
        parse_entry_key_name("ec:e:bad")
    assert entry_key_pattern("tenant-a") == "ec:[em]:tenant-a:*:*"
    assert entry_key_pattern() == "ec:[em]:*"
    assert entry_key_pattern(None, "0123456789abcdef") == "ec:[em]:*:0123456789abcdef:*"


def test_catalog_keys_share_one_hash_tag():
    names = catalog_key_names("tenant-a")
    assert {name.split("}")[0] for name in names.values()} == {"ec:c:{tenant-a"}


def test_ranges_end_on_the_grid_and_at_the_prompt_end():
    assert range_boundaries(200, 64) == [64, 128, 192, 200]
    assert range_boundaries(128, 64) == [64, 128]
    assert range_boundaries(5, 64) == [5]
    assert range_boundaries(0, 64) == []
    assert (
        grid_cuts(200, 64) == [64, 128, 192]
        and grid_cuts(200, 64, start=64) == [128, 192]
        and grid_cuts(200, 64, start=100) == [128, 192]
    )


def test_the_grid_enters_every_key():
    tokens = list(range(300))
    assert (
        prefix_keys("ns", "fp", tokens, [128, 256], grid=64)[0]
        != prefix_keys("ns", "fp", tokens, [128, 256], grid=128)[0]
    )


class _Words:
    """A vocabulary that tokenizes a word (or a run of newlines) per token, merging "\\n\\n" with a
    word after it when asked to (as some tokenizers would): enough to lay text prompts out."""

    def __init__(self, merge_break: bool = False):
        self.merge_break = merge_break

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]:
        import re

        pieces = re.findall(r"\n+\w*" if self.merge_break else r"\n+|[^\n ]+", text)
        return ([1] if add_bos else []) + [hash(piece) % 10_000 + 10 for piece in pieces]


def test_a_text_prompt_is_cut_where_its_last_paragraph_and_its_last_segment_begin():
    from inference.serving.run import text_layout

    examples = "Q: one? A: 1\n\nQ: two? A: 2\n\n"
    tokens, cuts = text_layout(_Words(), [examples + "Q: three? A:"])
    assert cuts == (len(_Words().tokenize(examples, add_bos=True)),)  # all the examples, whatever the grid
    same, other = (
        text_layout(_Words(), [examples + "Q: four, longer? A:"]),
        text_layout(_Words(), [examples + "Q: five? A:"]),
    )
    assert (
        same[1] == other[1] == cuts and same[0][: cuts[0]] == tokens[: cuts[0]]
    )  # so the next prompt reuses them whole
    tokens, cuts = text_layout(_Words(), ["Context: ferries.\n\n", "Notes\n\n\nQ: when? A:"])
    first = len(_Words().tokenize("Context: ferries.\n\n", add_bos=True))
    assert cuts == (
        first,
        first + len(_Words().tokenize("Notes\n\n\n", add_bos=False)),
    )  # the last segment, and its paragraph after the whole blank run
    assert text_layout(_Words(), ["one paragraph only"])[1] == ()
    assert text_layout(_Words(), ["a prompt ending with a break\n\n"])[1] == ()  # nothing after it to cut off
    assert (
        text_layout(_Words(merge_break=True), [examples + "Q: three? A:"])[1] == ()
    )  # the tokens would change: no cut

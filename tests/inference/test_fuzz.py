"""Property tests: whatever comes in, the pure parts answer or refuse cleanly, never crash."""

import os

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachebox.catalog import Catalog
from cachebox.entry import EntryHeader, decode_header, encode_entry, open_entry
from cachebox.errors import CatalogFormatError, EntryError
from cachebox.keys import prefix_keys
from cachebox.signing import control_plane_key, derive_keyring, public_hex, seal, shared_producer_ring, unseal
from inference.serving.pml import PMLError, PMLSchema, PromptDoc, parse_prompt, parse_schema

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCHEMA = parse_schema(
    '<schema name="s"><module name="a">A <param name="p" len="3"/></module><union><module name="b">B</module>'
    '<module name="c">C<module name="d">D</module></module></union></schema>'
)

names = st.sampled_from(["a", "b", "c", "d", "x", "module", "union", "param", "scaffold", "user", "schema", "prompt"])
attributes = st.dictionaries(
    st.sampled_from(["name", "len", "p", "schema", "modules", "xml:space"]), st.text(max_size=8), max_size=3
)


@st.composite
def xml_fragments(draw, depth=0):
    if depth > 3 or draw(st.booleans()):
        return draw(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12))
    tag = draw(names)
    attrs = "".join(f' {k}="{v.replace(chr(34), "")}"' for k, v in draw(attributes).items())
    children = "".join(draw(st.lists(xml_fragments(depth=depth + 1), max_size=3)))
    return f"<{tag}{attrs}>{children}</{tag}>"


@FAST
@given(st.text(max_size=300))
def test_any_text_parses_as_a_schema_or_fails_with_a_pml_error(source):
    try:
        assert isinstance(parse_schema(source), PMLSchema)
    except PMLError as exc:
        assert str(exc)


@FAST
@given(xml_fragments(), st.sampled_from(["schema", "prompt"]))
def test_tag_soup_is_refused_cleanly(fragment, root):
    document = f'<{root} name="s" schema="s">{fragment}</{root}>'
    try:
        result = parse_schema(document) if root == "schema" else parse_prompt(document, SCHEMA)
        assert isinstance(result, (PMLSchema, PromptDoc))
    except PMLError as exc:
        assert exc.reason


@FAST
@given(st.lists(st.integers(min_value=0, max_value=262_143), min_size=1, max_size=200), st.data())
def test_a_prefix_key_depends_only_on_the_prefix(tokens, data):
    end = data.draw(st.integers(min_value=1, max_value=len(tokens)))
    cuts = sorted(set(data.draw(st.lists(st.integers(min_value=1, max_value=end), max_size=5)) + [end]))
    assert (
        prefix_keys("ns", "fp", tokens, cuts, grid=64)[-1] == prefix_keys("ns", "fp", tokens[:end], [end], grid=64)[0]
    )
    changed = list(tokens)
    position = data.draw(st.integers(min_value=0, max_value=end - 1))
    changed[position] = (changed[position] + 1) % 262_144
    assert prefix_keys("ns", "fp", changed, [end], grid=64)[0] != prefix_keys("ns", "fp", tokens, [end], grid=64)[0]


@FAST
@given(st.binary(max_size=2000))
def test_arbitrary_catalog_bytes_load_or_fail_cleanly(raw):
    try:
        Catalog.from_bytes(raw)
    except CatalogFormatError:
        pass


@settings(max_examples=15, deadline=None)
@given(st.integers(min_value=0, max_value=300))
def test_catalog_round_trips_any_key_set(count):
    catalog = Catalog(1000, 0.01)
    keys = [os.urandom(16) for _ in range(count)]
    catalog.add_many(keys)
    loaded = Catalog.from_bytes(catalog.to_bytes())
    assert all(key in loaded for key in keys)


@FAST
@given(st.binary(max_size=600))
def test_arbitrary_entry_bytes_never_crash_the_header_reader(raw):
    for data in (raw, b"ECE2" + raw):
        try:
            decode_header(data)
        except EntryError:
            pass


RING = shared_producer_ring(derive_keyring(b"fuzz" * 8, "ns", 2))
STATE = os.urandom(3000)
SIGNED = encode_entry(EntryHeader("f" * 16, "ns", 0, 64, "d" * 32, 0), STATE, RING)


@FAST
@given(
    st.dictionaries(
        st.integers(min_value=0, max_value=len(SIGNED) - 1),
        st.integers(min_value=1, max_value=255),
        min_size=1,
        max_size=4,
    ),
    st.integers(min_value=0, max_value=len(SIGNED)),
)
def test_any_altered_or_cut_signed_entry_is_refused_cleanly(flips, cut):
    """Flipped bytes anywhere (header, MAC, state) or a cut: an EntryError, never a crash or a pass."""
    altered = bytearray(SIGNED)
    for where, mask in flips.items():  # distinct positions: every flip changes a byte
        altered[where] ^= mask
    for data in (bytes(altered), SIGNED[:cut] if cut < len(SIGNED) else bytes(altered)):
        try:
            open_entry(data, RING, 1 << 20)
        except EntryError:
            continue
        raise AssertionError("an altered entry was accepted")


BOARD_KEY = X25519PrivateKey.generate()
CONTROL = control_plane_key(b"fuzz" * 8)
CONTROL_KEY = public_hex(CONTROL)


@FAST
@given(st.text(max_size=200))
def test_arbitrary_sealed_rings_fail_cleanly(sealed):
    try:
        unseal(sealed, BOARD_KEY, "zero", CONTROL_KEY)
    except ValueError:
        return
    raise AssertionError("garbage opened as a key ring")


@FAST
@given(st.binary(min_size=60, max_size=400))
def test_altered_sealed_rings_fail_cleanly(noise):
    import base64

    sealed = seal(RING, BOARD_KEY.public_key().public_bytes_raw(), "zero", CONTROL)
    raw = bytearray(base64.b64decode(sealed))
    for index, byte in enumerate(noise[: len(raw)]):
        raw[index] ^= byte
    if bytes(raw) == base64.b64decode(sealed):
        return
    try:
        unseal(base64.b64encode(bytes(raw)).decode(), BOARD_KEY, "zero", CONTROL_KEY)
    except ValueError:
        return
    raise AssertionError("an altered sealed ring opened")


def test_a_sealed_ring_opens_for_its_board_only():
    sealed = seal(RING, BOARD_KEY.public_key().public_bytes_raw(), "zero", CONTROL)
    assert unseal(sealed, BOARD_KEY, "zero", CONTROL_KEY) == RING
    for _ in range(5):
        try:
            unseal(sealed, X25519PrivateKey.generate(), "zero", CONTROL_KEY)
        except ValueError:
            continue
        raise AssertionError("another board's key opened the ring")

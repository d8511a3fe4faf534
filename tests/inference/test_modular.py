"""Prompt schemas served from cached modules: the real model and a real cache box."""

import json

import pytest

from cachebox.entry import decode_header
from cachebox.store import CacheBox
from inference.serving.pml import PMLError
from inference.serving.pml_layout import ModulePiece
from tests.conftest import ROOT, run_manage

pytestmark = [pytest.mark.model, pytest.mark.cachebox]

SCHEMA = (ROOT / "examples" / "travel.pml").read_text()
PERSONA = (ROOT / "examples" / "persona.pml").read_text()  # Prompt Cache's own dialect
PERSONA_PROMPT = (ROOT / "examples" / "persona-prompt.pml").read_text()
PROMPT = '<prompt schema="travel"><trip-plan duration="3 days"/><tokyo><kyoto/></tokyo><user>Which places first?</user></prompt>'


def module_names(store, namespace):
    return sorted(name for name in store.scan_entries(namespace) if name.startswith("ec:m:"))


def test_encoded_schema_serves_prompts_from_cached_modules(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace)
    encoded = board.schemas.encode_schema(SCHEMA, namespace=namespace)
    assert {item.piece for item in encoded["stored"]} == {
        "_text0",
        "trip-plan",
        "miami",
        "tokyo",
        "tokyo/kyoto",
        "scaffold:plan-miami",
    }
    cached = board.run_pml(SCHEMA, PROMPT, max_tokens=6, namespace=namespace)
    b = cached.breakdown
    assert cached.modules_hit == ["_text0", "trip-plan", "tokyo", "tokyo/kyoto"]
    # Every module came from the cache box, the prompt's own text was computed: partial, by tokens.
    assert b.case == "partial" and 0 < b.matched_tokens < b.prompt_tokens and b.fetched_bytes > 0
    uncached = board.run_pml(SCHEMA, PROMPT, max_tokens=6, namespace=namespace, use_cache=False)
    assert uncached.breakdown.cachebox == "off" and uncached.modules_hit == []
    assert cached.tokens == uncached.tokens  # a module's state is the same whether fetched or encoded here
    assert board.schemas.encode_schema(SCHEMA, namespace=namespace)["skipped"]  # nothing encoded twice


def test_modules_are_encoded_on_the_fly_shared_and_hit_by_another_board(valkey_url, namespace, make_board):
    first = make_board(valkey_url, namespace, device="zero")
    miss = first.run_pml(SCHEMA, PROMPT, max_tokens=4, namespace=namespace)
    assert miss.breakdown.case == "miss" and miss.breakdown.uploaded_bytes > 0
    store = CacheBox(valkey_url)
    assert len(module_names(store, namespace)) == 4  # _text0, trip-plan, tokyo, tokyo/kyoto
    second = make_board(valkey_url, namespace, device="pi5")
    second.catalogs.sync_all()
    hit = second.run_pml(SCHEMA, PROMPT, max_tokens=4, namespace=namespace)
    assert hit.breakdown.case == "partial" and hit.modules_hit and hit.tokens == miss.tokens
    assert hit.breakdown.ttft_ms < miss.breakdown.ttft_ms


def test_parameter_values_are_computed_not_cached(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace)
    board.schemas.encode_schema(SCHEMA, namespace=namespace)
    short = board.run_pml(SCHEMA, PROMPT, max_tokens=3, namespace=namespace)
    longer = board.run_pml(SCHEMA, PROMPT.replace("3 days", "two long weeks"), max_tokens=3, namespace=namespace)
    assert short.modules_hit == longer.modules_hit == ["_text0", "trip-plan", "tokyo", "tokyo/kyoto"]
    assert longer.breakdown.prompt_tokens > short.breakdown.prompt_tokens
    with pytest.raises(PMLError, match="longer than its len=4"):
        board.run_pml(SCHEMA, PROMPT.replace("3 days", "a very long holiday of many many weeks"), namespace=namespace)


def test_a_scaffold_stands_for_its_members(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace)
    prompt = '<prompt schema="travel"><trip-plan duration="a week"/><miami/><user>Where to surf?</user></prompt>'
    board.run_pml(SCHEMA, prompt, max_tokens=3, namespace=namespace)
    result = board.run_pml(SCHEMA, prompt, max_tokens=3, namespace=namespace)
    assert (
        result.modules_hit == ["_text0", "scaffold:plan-miami"] and result.breakdown.case == "partial"
    )  # the user's text is computed


def test_a_prompt_may_end_inside_a_module(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace)
    prompt = '<prompt schema="travel"><miami/></prompt>'
    cold = board.run_pml(SCHEMA, prompt, max_tokens=3, namespace=namespace)
    warm = board.run_pml(SCHEMA, prompt, max_tokens=3, namespace=namespace)
    assert warm.breakdown.case == "full" and warm.tokens == cold.tokens


def test_a_corrupted_module_is_rejected_and_encoded_again(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace)
    cold = board.run_pml(SCHEMA, PROMPT, max_tokens=4, namespace=namespace)
    store = CacheBox(valkey_url)
    name = module_names(store, namespace)[0]
    header, offset = decode_header(store.read_prefixes([name], 4096)[0])
    store.redis.setrange(name, offset + 100, b"\xff\xff\xff\xff")
    result = board.run_pml(SCHEMA, PROMPT, max_tokens=4, namespace=namespace)
    assert result.breakdown.rejected_entries == 1 and result.breakdown.case == "partial"
    assert result.tokens == cold.tokens
    again = board.run_pml(SCHEMA, PROMPT, max_tokens=4, namespace=namespace)
    assert (
        again.modules_hit == ["_text0", "trip-plan", "tokyo", "tokyo/kyoto"] and again.breakdown.rejected_entries == 0
    )


def test_an_oversized_module_entry_is_refused_before_it_is_downloaded(valkey_url, namespace, make_board, monkeypatch):
    board = make_board(valkey_url, namespace, max_entry_bytes=2_000_000)
    cold = board.run_pml(SCHEMA, PROMPT, max_tokens=4, namespace=namespace)
    store = CacheBox(valkey_url)
    name = module_names(store, namespace)[0]
    store.redis.setrange(name, 3_000_000, b"x")  # the value grows past the board's limit
    fetched = []
    original = board.store.read_entries
    monkeypatch.setattr(board.store, "read_entries", lambda names: fetched.extend(names) or original(names))
    result = board.run_pml(SCHEMA, PROMPT, max_tokens=4, namespace=namespace)
    assert name not in fetched  # never downloaded
    assert result.breakdown.rejected_entries == 1 and result.tokens == cold.tokens
    assert store.redis.strlen(name) < 2_000_000  # evicted, then encoded again at its real size


def test_infer_serves_pml_from_the_command_line(valkey_url, namespace, tmp_path):
    prompt = tmp_path / "prompt.pml"
    prompt.write_text(PROMPT)
    env = {"REDIS_URL": valkey_url, "EDGECACHE_NAMESPACE": namespace, "EDGECACHE_N_CTX": "2048"}
    args = [
        "infer",
        "--schema",
        str(ROOT / "examples" / "travel.pml"),
        "--prompt-file",
        str(prompt),
        "--max-tokens",
        "3",
        "--json",
    ]
    first = run_manage(*args, env=env)
    second = run_manage(*args, env=env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr.decode() + second.stderr.decode()
    cold, hit = json.loads(first.stdout), json.loads(second.stdout)
    assert cold["modules_hit"] == [] and hit["modules_hit"] == ["_text0", "trip-plan", "tokyo", "tokyo/kyoto"]
    assert hit["case"] == "partial" and hit["text"] == cold["text"] and "ttft_ms" in hit


@pytest.mark.parametrize(
    "schema, prompt, message",
    [
        ("<schema name='travel'><module name='a'>x</schema>", PROMPT, b"line 1, column"),
        (SCHEMA, '<prompt schema="travel"><miami/><tokyo/></prompt>', b"members of one union"),
        (SCHEMA, '<prompt schema="paris"><miami/></prompt>', b"unknown schema 'paris'"),
    ],
)
def test_infer_reports_bad_pml_in_one_line(tmp_path, valkey_url, schema, prompt, message):
    (tmp_path / "s.pml").write_text(schema)
    (tmp_path / "p.pml").write_text(prompt)
    done = run_manage(
        "infer",
        "--schema",
        str(tmp_path / "s.pml"),
        "--prompt-file",
        str(tmp_path / "p.pml"),
        env={"REDIS_URL": valkey_url},
    )
    assert done.returncode != 0 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr.decode()


def test_a_scaffold_whose_members_lie_far_apart_still_serves(valkey_url, namespace, make_board):
    # Gemma-3's sliding-window layers see 512 positions; this union reserves 600 for its
    # long member, so the scaffold's members are further apart than that in the schema.
    filler = " ".join(["word"] * 600)
    schema = (
        f'<schema name="wide"><union><module name="long">{filler}</module><module name="short">The sky is blue.</module></union>'
        '<module name="tail">Grass is green.</module><scaffold name="short-tail" modules="short tail"/></schema>'
    )
    prompt = '<prompt schema="wide"><short/><tail/> What colour is the sky?</prompt>'
    board = make_board(valkey_url, namespace)
    cold = board.run_pml(schema, prompt, max_tokens=3, namespace=namespace)
    warm = board.run_pml(schema, prompt, max_tokens=3, namespace=namespace)
    assert warm.modules_hit[-1] == "scaffold:short-tail" and warm.breakdown.case == "partial"
    assert warm.tokens == cold.tokens and warm.breakdown.rejected_entries == 0


# -- Prompt Cache's own dialect ------------------------------------------------------------------------
def entry_name(board, namespace, source, path):
    """The cache box key a module of ``source`` is stored under."""
    _, layout = board.schemas.load_schema(source)
    return board.schemas.ref(layout, namespace, ModulePiece(path, [path], layout.modules[path].start)).name


def test_a_schema_in_prompt_caches_dialect_serves_and_never_stores_an_uncached_module(
    valkey_url, namespace, make_board, monkeypatch
):
    board = make_board(valkey_url, namespace)
    store = CacheBox(valkey_url)
    encoded = []
    original = board.schemas.encode
    monkeypatch.setattr(
        board.schemas, "encode", lambda layout, piece: encoded.append(piece.key_name) or original(layout, piece)
    )
    stored = ["_text0", "tone/cheerful", "_text1", "age/young-adult", "residence/seaside", "hobby"]

    cold = board.run_pml(PERSONA, PERSONA_PROMPT, max_tokens=6, namespace=namespace)
    assert cold.modules_hit == [] and encoded == [*stored, "today"]
    assert sorted(entry.piece for entry in cold.uploaded) == sorted(stored)  # today (cache="false") is not uploaded
    names = module_names(store, namespace)
    assert names == sorted(entry_name(board, namespace, PERSONA, path) for path in stored)
    assert entry_name(board, namespace, PERSONA, "today") not in names

    encoded.clear()
    warm = board.run_pml(PERSONA, PERSONA_PROMPT, max_tokens=6, namespace=namespace)
    assert warm.modules_hit == stored and encoded == [
        "today"
    ]  # every module from the cache box but today, computed again
    assert warm.uploaded == [] and module_names(store, namespace) == names
    assert warm.breakdown.case == "partial" and warm.breakdown.fetched_bytes > 0
    uncached = board.run_pml(PERSONA, PERSONA_PROMPT, max_tokens=6, namespace=namespace, use_cache=False)
    assert warm.tokens == cold.tokens == uncached.tokens  # a module fetched is the module encoded
    assert board.schemas.encode_schema(PERSONA, namespace=namespace)["skipped"]  # nothing encoded twice
    other_day = board.run_pml(
        PERSONA, PERSONA_PROMPT.replace("a rainy Tuesday", "Christmas Day"), max_tokens=6, namespace=namespace
    )
    assert other_day.modules_hit == stored and entry_name(board, namespace, PERSONA, "today") not in module_names(
        store, namespace
    )


def test_same_named_modules_in_two_scopes_are_two_entries(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace)
    encoded = board.schemas.encode_schema(PERSONA, namespace=namespace)
    pieces = {entry.piece for entry in encoded["stored"]}
    assert {"age/default", "residence/default"} <= pieces and not pieces & {"age", "residence", "tone", "today"}
    age, residence = (entry_name(board, namespace, PERSONA, path) for path in ("age/default", "residence/default"))
    assert age != residence and {age, residence} <= set(module_names(CacheBox(valkey_url), namespace))
    prompt = "<prompt schema='persona'><age><default/></age><residence><default/></residence><user>Where do I live?</user></prompt>"
    result = board.run_pml(PERSONA, prompt, max_tokens=4, namespace=namespace)
    assert result.modules_hit == ["_text0", "_text1", "age/default", "residence/default"]
    assert result.breakdown.rejected_entries == 0  # each entry holds its own module's tokens


def test_malformed_reference_schemas_are_refused_with_line_and_column(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace)
    broken = PERSONA.replace('<module name="hobby">', '<module name="hobby>')
    with pytest.raises(PMLError, match="not well-formed") as error:
        board.run_pml(broken, PERSONA_PROMPT, namespace=namespace)
    assert error.value.line == PERSONA.splitlines().index('  <module name="hobby">') + 2 and error.value.column


def test_the_control_plane_accepts_the_reference_schema_with_the_models_tokenizer():
    from inference.serving.schema import layout_for  # what Schema.clean runs before a schema is saved

    layout = layout_for(PERSONA, n_ctx=2048)
    assert layout.name == "persona" and layout.modules["age"].runs == [] and not layout.modules["today"].cache
    hobby = layout.modules["hobby"]
    assert hobby.params["activity"][1] == 8 and 0 < layout.positions < 2048

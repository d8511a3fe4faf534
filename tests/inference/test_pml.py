"""PML parsing, module layout and prompt plans: pure, millisecond tests (a toy tokenizer)."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachebox.keys import module_key
from inference.serving.pml import MAX_DEPTH, PMLError, parse_prompt, parse_schema
from inference.serving.pml_layout import ModulePiece, TextPiece, all_pieces, lay_out, plan_prompt

TRAVEL = """<schema name="travel">
  <system>You are a travel agent.</system>
  <module name="trip-plan">Plan a trip of <param name="duration" len="4"/> please.</module>
  <union>
    <module name="miami">Miami has surf.</module>
    <module name="tokyo">Tokyo has temples.
      <module name="kyoto">Kyoto too.</module>
    </module>
  </union>
  <scaffold name="plan-miami" modules="trip-plan miami"/>
</schema>"""


class WordTokenizer:
    """One token per word; special text is one token per piece; BOS = 1, placeholder = 0."""

    bos = 1
    placeholder = 0

    def __init__(self):
        self.vocab = {}

    def _id(self, word):
        return self.vocab.setdefault(word, 100 + len(self.vocab))

    def text(self, text):
        return [self._id(word) for word in text.split()]

    def special(self, text):
        return [self._id(f"<{text}>")] if text else []

    def wrappers(self, role):
        return f"start-{role}", f"end-{role}"

    def generation_prefix(self):
        return "start-model"


@pytest.fixture
def schema():
    return parse_schema(TRAVEL)


# -- schemas ---------------------------------------------------------------------------------
def test_schema_declares_modules_unions_params_nesting_and_scaffolds(schema):
    assert schema.name == "travel"
    assert list(schema.modules) == ["trip-plan", "miami", "tokyo", "tokyo/kyoto"]
    assert schema.modules["miami"].union == schema.modules["tokyo"].union is not None
    assert schema.modules["trip-plan"].params()["duration"].length == 4
    assert [s.name for s in schema.scaffolds] == ["plan-miami"]
    assert len(schema.digest) == 16 and parse_schema(TRAVEL).digest == schema.digest


def test_text_keeps_inline_spaces_and_drops_formatting():
    schema = parse_schema('<schema name="s">\n  <module name="a">\n    Hello  world.\n  </module>\n</schema>')
    assert schema.modules["a"].children[0].text == "Hello  world."
    kept = parse_schema('<schema name="s"><module name="a" xml:space="preserve">\n  Hi\n\n</module></schema>')
    assert kept.modules["a"].children[0].text == "\n  Hi\n\n"


@pytest.mark.parametrize(
    "source, message, line",
    [
        ("<schema name='s'><module name='a'>x</module>", "not well-formed", 1),
        ("<prompt schema='s'/>", "a schema starts with", 1),
        ("<schema><module name='a'>x</module></schema>", "needs a name", 1),
        ("<schema name='s'>\n<module>x</module></schema>", "needs a name", 2),
        ("<schema name='s'><module name='a'>x</module><module name='a'>y</module></schema>", "declared twice", 1),
        ("<schema name='s'><union><module name='a'>x</module></union></schema>", "at least two", 1),
        (
            "<schema name='s'><union>text<module name='a'>x</module><module name='b'>y</module></union></schema>",
            "only <module>",
            1,
        ),
        ("<schema name='s'><module name='a'><param name='p'/></module></schema>", "len=", 1),
        ("<schema name='s'><module name='a'><param name='p' len='0'/></module></schema>", "between 1", 1),
        ("<schema name='s'><param name='p' len='2'/><module name='a'>x</module></schema>", "inside a <module>", 1),
        (
            "<schema name='s'><module name='a'>x</module><module name='b'>y</module><scaffold name='c' modules='a z'/></schema>",
            "unknown module 'z'",
            1,
        ),
        (
            "<schema name='s'><union><module name='a'>x</module><module name='b'>y</module></union><scaffold name='c' modules='a b'/></schema>",
            "two members of one union",
            1,
        ),
        ("<schema name='s'>just text</schema>", "no <module>", 1),
        ("<schema name='s'><module name='a'>x</module><blink/></schema>", "unknown element <blink>", 1),
        ("<schema name='s'><module name='union'>x</module></schema>", "not usable", 1),
        ("", "empty", None),
    ],
)
def test_invalid_schemas_say_where_and_what(source, message, line):
    with pytest.raises(PMLError) as error:
        parse_schema(source)
    assert message in str(error.value)
    assert error.value.line == line


def test_entity_expansion_and_dtds_are_refused():
    bomb = '<?xml version="1.0"?><!DOCTYPE s [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;">]><schema name="s"><module name="m">&b;</module></schema>'
    with pytest.raises(PMLError, match="not allowed"):
        parse_schema(bomb)
    external = '<!DOCTYPE s SYSTEM "file:///etc/passwd"><schema name="s"><module name="m">x</module></schema>'
    with pytest.raises(PMLError, match="not allowed"):
        parse_schema(external)


def test_size_depth_and_count_limits():
    with pytest.raises(PMLError, match="larger than"):
        parse_schema("<schema name='s'><module name='m'>" + "x" * 300_000 + "</module></schema>")
    deep = (
        "<schema name='s'>"
        + "".join(f"<module name='m{i}'>x" for i in range(MAX_DEPTH + 2))
        + "</module>" * (MAX_DEPTH + 2)
        + "</schema>"
    )
    with pytest.raises(PMLError, match="deeper"):
        parse_schema(deep)
    many = "<schema name='s'>" + "".join(f"<module name='m{i}'>x</module>" for i in range(600)) + "</schema>"
    with pytest.raises(PMLError, match="more than"):
        parse_schema(many)


# -- prompts -----------------------------------------------------------------------------------
def test_prompt_imports_nested_modules_and_parameters(schema):
    doc = parse_prompt(
        '<prompt schema="travel"><trip-plan duration="3 days"/><tokyo><kyoto/></tokyo><user>Surf?</user></prompt>',
        schema,
    )
    imports = [item for item in doc.items if hasattr(item, "args")]
    assert [i.name for i in imports] == ["trip-plan", "tokyo"]
    assert imports[0].args == {"duration": "3 days"} and imports[1].children[0].name == "tokyo/kyoto"
    assert doc.items[-1].role == "user" and doc.items[-1].text == "Surf?"


@pytest.mark.parametrize(
    "source, message",
    [
        ('<prompt schema="paris"><miami/></prompt>', "unknown schema 'paris'"),
        ("<prompt><miami/></prompt>", "needs schema="),
        ('<prompt schema="travel"><paris/></prompt>', "unknown module <paris/>"),
        ('<prompt schema="travel"><miami/><tokyo/></prompt>', "members of one union"),
        ('<prompt schema="travel"><trip-plan days="3"/></prompt>', "no parameter 'days'"),
        ('<prompt schema="travel"><kyoto/></prompt>', "import it as <tokyo><kyoto/></tokyo>"),
        ('<prompt schema="travel"><tokyo>text</tokyo></prompt>', "free text outside"),
        ('<prompt schema="travel"><user><miami/></user></prompt>', "outside <user>"),
        ('<prompt schema="travel">   </prompt>', "empty"),
        ('<prompt schema="travel"><miami/>', "not well-formed"),
    ],
)
def test_invalid_prompts_say_what_is_wrong(schema, source, message):
    with pytest.raises(PMLError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_prompt(source, schema)


def test_prompt_errors_carry_line_and_column(schema):
    with pytest.raises(PMLError) as error:
        parse_prompt('<prompt schema="travel">\n  <miami/>\n  <tokyo/>\n</prompt>', schema)
    assert (error.value.line, error.value.column) == (3, 3)


# -- layout ---------------------------------------------------------------------------------
def test_layout_positions_follow_the_schema(schema):
    tok = WordTokenizer()
    layout = lay_out(schema, tok)
    anon, plan_, miami, tokyo, kyoto = (
        layout.modules[p] for p in ["_text0", "trip-plan", "miami", "tokyo", "tokyo/kyoto"]
    )
    assert (anon.start, anon.end) == (0, 8)  # BOS + <system> wrapper + 5 words + wrapper
    assert anon.runs[0].tokens[0] == tok.bos and anon.anonymous
    assert (plan_.start, plan_.end) == (8, 8 + 4 + 4 + 1)  # "Plan a trip of" + 4 placeholders + "please."
    assert plan_.params == {"duration": (12, 4)}
    assert plan_.runs[0].tokens[4:8] == [tok.placeholder] * 4
    # Union members share a start; the union reserves its longest member (tokyo + nested kyoto).
    assert miami.start == tokyo.start == 17
    assert (miami.end, tokyo.token_count, (kyoto.start, kyoto.end), tokyo.end) == (20, 3, (20, 22), 22)
    assert layout.positions == 22
    assert layout.scaffolds == {"plan-miami": ["trip-plan", "miami"]}


def test_plan_orders_pieces_and_places_text_after_its_module(schema):
    tok = WordTokenizer()
    layout = lay_out(schema, tok)
    doc = parse_prompt(
        '<prompt schema="travel">Hi <tokyo><kyoto/></tokyo> <trip-plan duration="3 days"/><user>Surf?</user></prompt>',
        schema,
    )
    plan = plan_prompt(doc, layout, tok)
    kinds = [(p.key_name if isinstance(p, ModulePiece) else "text") for p in plan.pieces]
    assert kinds == ["_text0", "text", "trip-plan", "tokyo", "tokyo/kyoto", "text", "text"]
    trip = plan.pieces[2]
    assert trip.args == {"trip-plan/duration": (12, 4, tok.text("3 days"))}
    assert plan.pieces[-1].tokens == tok.special("start-model")  # the answer opens after a user turn


def test_a_scaffold_replaces_its_members_when_all_are_imported(schema):
    tok = WordTokenizer()
    layout = lay_out(schema, tok)
    both = plan_prompt(parse_prompt('<prompt schema="travel"><trip-plan/><miami/>Go.</prompt>', schema), layout, tok)
    assert [p.key_name for p in both.pieces if isinstance(p, ModulePiece)] == ["_text0", "scaffold:plan-miami"]
    assert both.pieces[1].members == ["trip-plan", "miami"]
    one = plan_prompt(parse_prompt('<prompt schema="travel"><miami/>Go.</prompt>', schema), layout, tok)
    assert [p.key_name for p in one.pieces if isinstance(p, ModulePiece)] == ["_text0", "miami"]


def test_parameter_values_longer_than_len_are_refused_with_their_place(schema):
    tok = WordTokenizer()
    layout = lay_out(schema, tok)
    doc = parse_prompt('<prompt schema="travel">\n<trip-plan duration="one two three four five"/></prompt>', schema)
    with pytest.raises(PMLError, match="5 tokens, longer than its len=4") as error:
        plan_prompt(doc, layout, tok)
    assert error.value.line == 2


def test_text_pieces_keep_their_tokens(schema):
    tok = WordTokenizer()
    layout = lay_out(schema, tok)
    plan = plan_prompt(parse_prompt('<prompt schema="travel"><miami/>Where to surf?</prompt>', schema), layout, tok)
    text = [p for p in plan.pieces if isinstance(p, TextPiece)]
    assert [t.tokens for t in text] == [tok.text("Where to surf?")]
    assert text[0].anchor == layout.modules["miami"].end


# -- placement of pieces when serving ----------------------------------------------------------
def test_placement_closes_gaps_left_by_unions_and_skipped_modules():
    from inference.serving.pml_layout import Placement

    place = Placement()
    assert place.module([(0, 10)]) == 0
    assert place.module([(20, 30)]) == -10  # the 10 positions of a module not imported are closed
    assert place.text(5) == 20
    assert place.module([(40, 45)]) == -15  # after the text: at 25
    assert place.cursor == 30


def test_placement_moves_a_module_right_when_text_ran_into_it():
    from inference.serving.pml_layout import Placement

    place = Placement()
    place.module([(0, 10)])
    assert place.text(8) == 10
    assert place.module([(12, 20)]) == 6  # would overlap the text: starts at 18
    assert place.cursor == 26


def test_placement_puts_a_nested_module_in_its_parents_gap():
    from inference.serving.pml_layout import Placement

    place = Placement()
    parent_shift = place.module([(5, 10), (14, 20)])  # the parent's own runs, with its child's slot between
    assert parent_shift == -5 and place.cursor == 15
    assert place.module([(10, 14)]) == -5  # the child lands in the gap, as in the schema
    assert place.cursor == 15 and place.text(3) == 15


def test_placement_without_compaction_keeps_schema_positions():
    from inference.serving.pml_layout import Placement

    place = Placement(compact=False)
    place.module([(0, 10)])
    assert place.module([(20, 30)]) == 0 and place.text(2) == 30


# -- Prompt Cache's own dialect (its README and implementation) ------------------------------------
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PERSONA = (EXAMPLES / "persona.pml").read_text()
PERSONA_PROMPT = (EXAMPLES / "persona-prompt.pml").read_text()


def test_the_reference_dialect_parses_with_every_feature():
    schema = parse_schema(PERSONA)
    assert "age/default" in schema.modules and "residence/default" in schema.modules  # one name, two scopes
    assert schema.modules["tone/cheerful"].path == "tone/cheerful"  # a module inside <system>
    assert schema.top_level.keys() == {"tone", "age", "residence", "hobby", "today"}
    hobby = schema.modules["hobby"].params()["activity"]
    assert (hobby.length, hobby.scaffold) == (8, "something to be named")  # <parameter length scaffold>
    unions = [node for node in schema.children if hasattr(node, "members")] + [
        node for module in schema.modules.values() for node in module.children if hasattr(node, "members")
    ]
    assert sorted(union.scaffold for union in unions) == ["default", "default", "plain"]
    assert [path for path, module in schema.modules.items() if not module.cache] == ["today"]
    assert "scenario" not in repr(schema.children) and "Computed for every" not in repr(schema.modules)  # comments


def test_the_reference_prompt_imports_members_through_their_scope():
    schema = parse_schema(PERSONA)
    doc = parse_prompt(PERSONA_PROMPT, schema)
    imports = [item for item in doc.items if hasattr(item, "args")]
    assert [(i.name, [c.name for c in i.children]) for i in imports] == [
        ("tone", ["tone/cheerful"]),
        ("age", ["age/young-adult"]),
        ("residence", ["residence/seaside"]),
        ("hobby", []),
        ("today", []),
    ]
    assert imports[3].args == {"activity": "sailing small boats"}
    assert doc.items[-1].role == "user" and doc.items[-1].text == "Introduce yourself in two sentences."
    one_line = parse_prompt("<prompt schema='persona'><age> <senior/> </age><user>Hi</user></prompt>", schema)
    assert one_line.items[0].children[0].name == "age/senior"  # spaces between imports are not free text
    with pytest.raises(
        PMLError,
        match="nested in 'age', 'residence': import it as <age><default/></age> or <residence><default/></residence>",
    ):
        parse_prompt("<prompt schema='persona'><default/></prompt>", schema)
    with pytest.raises(PMLError, match="members of one union"):
        parse_prompt("<prompt schema='persona'><age><child/><senior/></age></prompt>", schema)


def test_a_module_of_modules_has_no_state_and_its_members_keep_their_slot():
    tok = WordTokenizer()
    layout = lay_out(parse_schema(PERSONA), tok)
    age, default, child = (layout.modules[p] for p in ["age", "age/default", "age/child"])
    assert age.runs == [] and age.start == default.start == child.start and age.end == child.end
    pieces = [piece.key_name for piece in all_pieces(layout)]
    assert "age" not in pieces and "tone" not in pieces  # nothing of their own to store
    assert "today" not in pieces  # cache="false": never stored
    assert {"age/default", "residence/default", "hobby", "_text0"} <= set(pieces)


def test_a_parameter_scaffold_is_encoded_in_its_place_and_padded():
    tok = WordTokenizer()
    layout = lay_out(parse_schema(PERSONA), tok)
    hobby = layout.modules["hobby"]
    start, length = hobby.params["activity"]
    tokens = [t for run in hobby.runs for t in run.tokens]
    offset = start - hobby.start
    assert tokens[offset : offset + length] == tok.text("something to be named") + [tok.placeholder] * 4
    plain = lay_out(parse_schema(TRAVEL), tok).modules["trip-plan"]
    assert plain.runs[0].tokens[4:8] == [tok.placeholder] * 4  # no scaffold: placeholders, as before
    with pytest.raises(PMLError, match="scaffold of parameter 'p' is 3 tokens, longer than its length=2") as error:
        lay_out(
            parse_schema(
                '<schema name="s">\n<module name="m">x <parameter name="p" length="2" scaffold="a b c"/></module></schema>'
            ),
            tok,
        )
    assert (error.value.line, error.value.column) == (2, 20)


def test_plan_skips_modules_of_modules_and_marks_uncached_ones():
    tok = WordTokenizer()
    schema = parse_schema(PERSONA)
    plan = plan_prompt(parse_prompt(PERSONA_PROMPT, schema), lay_out(schema, tok), tok)
    modules = [(p.key_name, p.cache) for p in plan.pieces if isinstance(p, ModulePiece)]
    assert modules == [
        ("_text0", True),
        ("tone/cheerful", True),
        ("_text1", True),  # the closing of <system>, after the module inside it
        ("age/young-adult", True),
        ("residence/seaside", True),
        ("hobby", True),
        ("today", False),
    ]


def test_same_named_modules_in_two_scopes_get_different_keys():
    schema = parse_schema(PERSONA)
    layout = lay_out(schema, WordTokenizer())
    keys = {piece.key_name: module_key("ns", "fp", schema.digest, piece.key_name) for piece in all_pieces(layout)}
    assert keys["age/default"] != keys["residence/default"]
    assert len(set(keys.values())) == len(keys)


def test_roles_inside_modules_and_unions_inside_roles():
    source = """<schema name="chat">
      <module name="example">
        <user>What is 2 + 2?</user>
        <assistant>It is <parameter name="answer" length="2"/>.</assistant>
        <system><union><module name="a">A</module><module name="b">B</module></union></system>
      </module>
    </schema>"""
    tok = WordTokenizer()
    schema = parse_schema(source)
    assert list(schema.modules) == ["example", "example/a", "example/b"]
    layout = lay_out(schema, tok)
    own = [t for run in layout.modules["example"].runs for t in run.tokens]
    assert own[0] == tok.special("start-user")[0] and own[-1] == tok.special("end-system")[0]
    doc = parse_prompt('<prompt schema="chat"><example answer="4"><b/></example></prompt>', schema)
    assert doc.items[0].children[0].name == "example/b"


@pytest.mark.parametrize(
    "source, message, line",
    [
        (
            "<schema name='s'><module name='a'><union scaffold='c'><module name='b'>x</module><module name='d'>y</module></union></module></schema>",
            "names no member",
            1,
        ),
        ("<schema name='s'>\n<module name='a' cache='no'>x</module></schema>", 'cache must be "true" or "false"', 2),
        (
            "<schema name='s'><module name='a' cache='false'>x</module><module name='b'>y</module><scaffold name='c' modules='a b'/></schema>",
            "never cached",
            1,
        ),
        (
            "<schema name='s'><module name='a'><parameter name='p' len='2' length='2'/></module></schema>",
            "both len and length",
            1,
        ),
        ("<schema name='s'><module name='a'><parameter name='p' len='x'/></module></schema>", "needs len=", 1),
        ("<schema name='s'><module name='a'><parameter name='p'/></module></schema>", "needs length=", 1),
        (
            "<schema name='s'><module name='a'><parameter name='p' length='2' size='3'/></module></schema>",
            "unknown attribute(s) size",
            1,
        ),
        ("<schema name='s'><module name='_text0'>x</module></schema>", "taken by the text outside modules", 1),
        ("<schema name='s'>\n\n<module name='a'></module></schema>", "is empty", 3),
        (
            "<schema name='s'><module name='a'><module name='b'>x</module><module name='b'>y</module></module></schema>",
            "names are unique per scope: 'b' in 'a'",
            1,
        ),
        (
            "<schema name='s'><union kind='x'><module name='a'>x</module><module name='b'>y</module></union></schema>",
            "unknown attribute(s) kind",
            1,
        ),
        ("<schema name='s'><module name='parameter'>x</module></schema>", "not usable", 1),
    ],
)
def test_reference_dialect_errors_say_where_and_what(source, message, line):
    with pytest.raises(PMLError) as error:
        parse_schema(source)
    assert message in str(error.value)
    assert error.value.line == line


def test_malformed_reference_documents_are_refused_with_line_and_column():
    broken = PERSONA.replace('</module>\n\n  <module name="residence">', '\n\n  <module name="residence">')
    with pytest.raises(PMLError, match="not well-formed") as error:
        parse_schema(broken)
    assert error.value.line is not None and error.value.column is not None
    assert PERSONA.splitlines()[error.value.line - 1].strip()  # points at a real line of the document
    with pytest.raises(PMLError, match="not well-formed") as error:
        parse_prompt("<prompt schema='persona'>\n  <age><young-adult/></ag>\n</prompt>", parse_schema(PERSONA))
    assert (error.value.line, error.value.column) == (2, 24)


def test_comments_are_ignored_everywhere():
    schema = parse_schema(
        "<!-- before --><schema name='s'><!-- a --><module name='m'>Hello <!-- b -->world</module></schema><!-- after -->"
    )
    assert [child.text for child in schema.modules["m"].children] == ["Hello world"]
    doc = parse_prompt("<prompt schema='s'><!-- c --><m/><user>Hi<!-- d --> there</user></prompt>", schema)
    assert [getattr(item, "text", None) for item in doc.items] == [None, "Hi there"]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_choice_of_union_members_plans_into_stored_pieces_with_distinct_keys(data):
    schema = parse_schema(PERSONA)
    tok = WordTokenizer()
    layout = lay_out(schema, tok)
    parts = []
    for scope in ("tone", "age", "residence"):
        members = sorted(path.split("/", 1)[1] for path in schema.modules if path.startswith(scope + "/"))
        choice = data.draw(st.sampled_from([None, *members]))
        if choice is not None:
            parts.append(f"<{scope}><{choice}/></{scope}>")
    if data.draw(st.booleans()):
        parts.append('<today date="Monday"/>')
    plan = plan_prompt(
        parse_prompt(f"<prompt schema='persona'>{''.join(parts)}<user>Hi</user></prompt>", schema), layout, tok
    )
    pieces = [p for p in plan.pieces if isinstance(p, ModulePiece)]
    assert all(layout.modules[p.key_name].runs for p in pieces)  # never a piece without tokens
    stored = {p.key_name for p in all_pieces(layout)}
    assert all((p.key_name in stored) == p.cache for p in pieces)  # cached pieces are exactly the stored ones
    keys = [module_key("ns", "fp", schema.digest, p.key_name) for p in pieces]
    assert len(set(keys)) == len(keys)


def test_cache_false_covers_the_modules_nested_in_it():
    schema = parse_schema(
        "<schema name='s'><module name='a' cache='false'>x<union><module name='b'>y</module><module name='c' cache='true'>z</module></union></module>"
        "<module name='d'>w<module name='e' cache='false'>v</module></module></schema>"
    )
    assert {path: module.cache for path, module in schema.modules.items()} == {
        "a": False,
        "a/b": False,
        "a/c": False,
        "d": True,
        "d/e": False,
    }
    assert [piece.key_name for piece in all_pieces(lay_out(schema, WordTokenizer()))] == ["_text0", "d"]

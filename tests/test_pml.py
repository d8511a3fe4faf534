"""PML parsing, module layout and prompt plans: pure, millisecond tests (a toy tokenizer)."""

import pytest

from inference.pml_layout import ModulePiece, TextPiece, lay_out, plan_prompt
from inference.pml import MAX_DEPTH, PMLError, parse_prompt, parse_schema

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
        ("<schema name='s'><union>text<module name='a'>x</module><module name='b'>y</module></union></schema>", "only <module>", 1),
        ("<schema name='s'><module name='a'><param name='p'/></module></schema>", "len=", 1),
        ("<schema name='s'><module name='a'><param name='p' len='0'/></module></schema>", "between 1", 1),
        ("<schema name='s'><param name='p' len='2'/><module name='a'>x</module></schema>", "inside a <module>", 1),
        ("<schema name='s'><module name='a'>x</module><module name='b'>y</module><scaffold name='c' modules='a z'/></schema>", "unknown module 'z'", 1),
        ("<schema name='s'><union><module name='a'>x</module><module name='b'>y</module></union><scaffold name='c' modules='a b'/></schema>", "two members of one union", 1),
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
    deep = "<schema name='s'>" + "".join(f"<module name='m{i}'>x" for i in range(MAX_DEPTH + 2)) + "</module>" * (MAX_DEPTH + 2) + "</schema>"
    with pytest.raises(PMLError, match="deeper"):
        parse_schema(deep)
    many = "<schema name='s'>" + "".join(f"<module name='m{i}'>x</module>" for i in range(600)) + "</schema>"
    with pytest.raises(PMLError, match="more than"):
        parse_schema(many)


# -- prompts -----------------------------------------------------------------------------------
def test_prompt_imports_nested_modules_and_parameters(schema):
    doc = parse_prompt('<prompt schema="travel"><trip-plan duration="3 days"/><tokyo><kyoto/></tokyo><user>Surf?</user></prompt>', schema)
    imports = [item for item in doc.items if hasattr(item, "args")]
    assert [i.name for i in imports] == ["trip-plan", "tokyo"]
    assert imports[0].args == {"duration": "3 days"} and imports[1].children[0].name == "tokyo/kyoto"
    assert doc.items[-1].role == "user" and doc.items[-1].text == "Surf?"


@pytest.mark.parametrize(
    "source, message",
    [
        ('<prompt schema="paris"><miami/></prompt>', "unknown schema 'paris'"),
        ('<prompt><miami/></prompt>', "needs schema="),
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
    anon, plan_, miami, tokyo, kyoto = (layout.modules[p] for p in ["_text0", "trip-plan", "miami", "tokyo", "tokyo/kyoto"])
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
    doc = parse_prompt('<prompt schema="travel">Hi <tokyo><kyoto/></tokyo> <trip-plan duration="3 days"/><user>Surf?</user></prompt>', schema)
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
    from inference.pml_layout import Placement

    place = Placement()
    assert place.module([(0, 10)]) == 0
    assert place.module([(20, 30)]) == -10  # the 10 positions of a module not imported are closed
    assert place.text(5) == 20
    assert place.module([(40, 45)]) == -15  # after the text: at 25
    assert place.cursor == 30


def test_placement_moves_a_module_right_when_text_ran_into_it():
    from inference.pml_layout import Placement

    place = Placement()
    place.module([(0, 10)])
    assert place.text(8) == 10
    assert place.module([(12, 20)]) == 6  # would overlap the text: starts at 18
    assert place.cursor == 26


def test_placement_puts_a_nested_module_in_its_parents_gap():
    from inference.pml_layout import Placement

    place = Placement()
    parent_shift = place.module([(5, 10), (14, 20)])  # the parent's own runs, with its child's slot between
    assert parent_shift == -5 and place.cursor == 15
    assert place.module([(10, 14)]) == -5  # the child lands in the gap, as in the schema
    assert place.cursor == 15 and place.text(3) == 15


def test_placement_without_compaction_keeps_schema_positions():
    from inference.pml_layout import Placement

    place = Placement(compact=False)
    place.module([(0, 10)])
    assert place.module([(20, 30)]) == 0 and place.text(2) == 30

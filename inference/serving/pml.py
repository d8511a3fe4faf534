"""PML, the prompt markup language of Prompt Cache: schemas of reusable prompt modules and
the prompts built from them. Pure parsing and validation (no model, no I/O).

Schema::

    <schema name="travel">
      <system>You are a travel agent.</system>
      <module name="trip-plan">Plan a trip of <param name="duration" len="4"/>.</module>
      <union>
        <module name="miami">Miami has beaches.</module>
        <module name="tokyo">Tokyo has temples.</module>
      </union>
      <scaffold name="plan-city" modules="trip-plan miami"/>
    </schema>

Prompt::

    <prompt schema="travel"><trip-plan duration="3 days"/><miami/><user>Surf spots?</user></prompt>

Prompt Cache's own dialect (the one its implementation and README use) is read too::

    <schema name="persona">
      <!-- comments are ignored -->
      <system>You answer for the person described.</system>
      <module name="age">
        <union scaffold="default">
          <module name="default">Age not given.</module>
          <module name="young-adult">Aged 20 to 34.</module>
        </union>
      </module>
      <module name="today" cache="false">Today is <parameter name="date" length="6" scaffold="a weekday"/>.</module>
    </schema>

    <prompt schema='persona'><age><young-adult/></age><today date="Monday"/><user>Who am I?</user></prompt>

- ``<parameter name length scaffold>`` is ``<param name len>``; ``scaffold`` (either tag) is the
  text encoded in the parameter's place (padded with the placeholder token to ``length``) and
  served when a prompt gives no value.
- ``<union scaffold="member">`` names the member that stands for the union while its
  neighbours are encoded, in Prompt Cache's implementation. EdgeCache encodes every module
  alone (the paper's masking, section 3.3), so the name is checked and kept, nothing more.
- ``cache="false"`` on a module (and so on every module nested in it): its state is computed
  for every request, never stored in or fetched from the cache box.
- A module may hold only nested modules or unions (no text of its own): importing it only
  opens its scope, it has no state.
- Module names are unique per scope; the path (``age/young-adult``) identifies a module and
  keys its cache entries, so ``age/default`` and ``residence/default`` never share one.
- Modules may sit in ``<system>``/``<user>``/``<assistant>`` of a schema, at any level.

Parsing uses defusedxml's SAX reader (DTDs and entities refused) and enforces size, depth
and module-count limits. Every error names the line and column and says what is wrong.
Text is kept as written, except that whitespace-only runs with a newline (formatting
between tags) are dropped and a leading/trailing newline + indentation inside a tag is
trimmed; ``xml:space="preserve"`` on any element keeps its text exactly.
"""

from __future__ import annotations

import hashlib
import re
import xml.sax
from dataclasses import dataclass, field
from typing import Union as TypingUnion

import defusedxml.sax
from defusedxml import DefusedXmlException

MAX_PML_BYTES = 256 * 1024
MAX_DEPTH = 16
MAX_MODULES = 512
MAX_PARAM_LEN = 1024
ROLES = ("system", "user", "assistant")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_RESERVED = {"schema", "prompt", "module", "union", "param", "parameter", "scaffold", *ROLES}
_ANONYMOUS_RE = re.compile(r"^_text[0-9]+$")  # the names layout gives text outside modules
_PARAM_TAGS = ("param", "parameter")


class PMLError(ValueError):
    """A PML document that cannot be used; ``line``/``column`` locate the problem (1-based)."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None):
        self.line, self.column, self.reason = line, column, message
        where = f"line {line}, column {column}: " if line is not None else ""
        super().__init__(where + message)


@dataclass
class Where:
    line: int
    column: int


# -- schema tree ---------------------------------------------------------------------------
@dataclass
class Text:
    text: str


@dataclass
class Param:
    name: str
    length: int
    where: Where
    scaffold: str | None = None  # text encoded in its place (else placeholder tokens)


@dataclass
class Role:
    role: str
    children: list
    where: Where


@dataclass
class Module:
    name: str
    path: str  # "outer/inner" for nested modules
    children: list
    where: Where
    union: str | None = None  # id of the union it belongs to
    cache: bool = True  # False: computed for every request, never stored or fetched

    def params(self) -> dict[str, Param]:
        found: dict[str, Param] = {}
        stack = list(self.children)
        while stack:
            node = stack.pop()
            if isinstance(node, Param):
                found[node.name] = node
            elif isinstance(node, Role):
                stack.extend(node.children)
        return found

    def submodules(self) -> dict[str, "Module"]:
        found: dict[str, Module] = {}
        for node in self.children:
            for module in _modules_in(node):
                found[module.name] = module
        return found


@dataclass
class UnionNode:
    id: str
    members: list[Module]
    where: Where
    scaffold: str | None = None  # the member standing for the union in Prompt Cache's encoding


@dataclass
class Scaffold:
    name: str
    modules: list[str]  # module paths
    where: Where


@dataclass
class PMLSchema:
    name: str
    children: list
    scaffolds: list[Scaffold]
    digest: str  # of the source text: changes when the schema does
    modules: dict[str, Module] = field(default_factory=dict)  # by path

    @property
    def top_level(self) -> dict[str, Module]:
        return {module.name: module for node in self.children for module in _modules_in(node)}


def _modules_in(node) -> list[Module]:
    """Modules directly reachable from ``node`` without entering another module."""
    if isinstance(node, Module):
        return [node]
    if isinstance(node, UnionNode):
        return list(node.members)
    if isinstance(node, Role):
        return [module for child in node.children for module in _modules_in(child)]
    return []


# -- prompt tree -------------------------------------------------------------------------------
@dataclass
class Import:
    name: str
    args: dict[str, str]
    children: list  # nested Import and Text
    where: Where


@dataclass
class PromptText:
    text: str
    role: str | None = None  # rendered through the chat template when set


@dataclass
class PromptDoc:
    schema: str
    items: list[TypingUnion[Import, PromptText]]


# -- SAX plumbing ----------------------------------------------------------------------------------
@dataclass
class _Element:
    tag: str
    attrs: dict[str, str]
    where: Where
    children: list = field(default_factory=list)  # _Element or str
    preserve: bool = False


class _TreeBuilder(xml.sax.ContentHandler):
    def __init__(self):
        super().__init__()
        self.root: _Element | None = None
        self.stack: list[_Element] = []
        self.elements = 0

    def setDocumentLocator(self, locator):
        self.locator = locator

    def _where(self) -> Where:
        return Where(self.locator.getLineNumber(), self.locator.getColumnNumber() + 1)

    def startElement(self, name, attrs):
        where = self._where()
        if len(self.stack) >= MAX_DEPTH:
            raise PMLError(f"elements nest deeper than {MAX_DEPTH} levels", where.line, where.column)
        self.elements += 1
        if self.elements > MAX_MODULES * 4:
            raise PMLError(f"more than {MAX_MODULES * 4} elements", where.line, where.column)
        preserve = (self.stack[-1].preserve if self.stack else False) or attrs.get("xml:space") == "preserve"
        element = _Element(
            name, {key: value for key, value in attrs.items() if key != "xml:space"}, where, preserve=preserve
        )
        if self.stack:
            self.stack[-1].children.append(element)
        else:
            self.root = element
        self.stack.append(element)

    def endElement(self, name):
        self.stack.pop()

    def characters(self, content):
        if self.stack:
            children = self.stack[-1].children
            if children and isinstance(children[-1], str):
                children[-1] += content
            else:
                children.append(content)


def _parse_xml(source: str, what: str) -> _Element:
    if not isinstance(source, str):
        raise PMLError(f"the {what} must be text")
    if len(source.encode("utf-8")) > MAX_PML_BYTES:
        raise PMLError(f"the {what} is larger than {MAX_PML_BYTES // 1024} KB")
    if not source.strip():
        raise PMLError(f"the {what} is empty")
    builder = _TreeBuilder()
    try:
        defusedxml.sax.parseString(
            source.encode("utf-8"), builder, forbid_dtd=True, forbid_entities=True, forbid_external=True
        )
    except xml.sax.SAXParseException as exc:
        raise PMLError(
            f"not well-formed XML: {exc.getMessage()}", exc.getLineNumber(), exc.getColumnNumber() + 1
        ) from None
    except DefusedXmlException as exc:
        raise PMLError(f"DTDs and entity declarations are not allowed in PML ({type(exc).__name__})") from None
    return builder.root


def _clean_text(text: str, preserve: bool) -> str | None:
    if preserve:
        return text
    if not text.strip() and "\n" in text:
        return None  # formatting between tags
    text = re.sub(r"\A[ \t]*\n[ \t]*", "", text)
    text = re.sub(r"\n[ \t]*\Z", "", text)
    return text or None


def _check_name(name: str | None, element: _Element, what: str) -> str:
    if not name:
        raise PMLError(f"<{element.tag}> needs a name attribute", element.where.line, element.where.column)
    if not _NAME_RE.match(name) or name in _RESERVED:
        raise PMLError(
            f"{what} name {name!r} is not usable: start with a letter or '_', then letters, digits, '_', '.', '-' (not a PML tag name)",
            element.where.line,
            element.where.column,
        )
    return name


def _error(element: _Element, message: str) -> PMLError:
    return PMLError(message, element.where.line, element.where.column)


# -- schemas -------------------------------------------------------------------------------------
def parse_schema(source: str) -> PMLSchema:
    """Parse and validate a schema document."""
    root = _parse_xml(source, "schema")
    if root.tag != "schema":
        raise _error(root, f'a schema starts with <schema name="...">, not <{root.tag}>')
    name = _check_name(root.attrs.get("name"), root, "schema")
    unknown = set(root.attrs) - {"name"}
    if unknown:
        raise _error(root, f"<schema> has unknown attribute(s) {', '.join(sorted(unknown))}")
    state = {"modules": {}, "unions": 0}
    scaffolds: list[Scaffold] = []
    children = []
    for child in root.children:
        if isinstance(child, _Element) and child.tag == "scaffold":
            scaffolds.append(_scaffold(child))
        else:
            node = _schema_node(child, "", state, root.preserve, in_module=False)
            if node is not None:
                children.append(node)
    schema = PMLSchema(
        name, children, scaffolds, hashlib.blake2b(source.encode("utf-8"), digest_size=8).hexdigest(), state["modules"]
    )
    if not schema.modules:
        raise _error(root, "the schema declares no <module>: there is nothing to reuse")
    for scaffold in scaffolds:
        _check_scaffold(scaffold, schema)
    return schema


def _schema_node(node, prefix: str, state: dict, preserve: bool, in_module: bool, cache: bool = True):
    if isinstance(node, str):
        text = _clean_text(node, preserve)
        return Text(text) if text is not None else None
    tag = node.tag
    if tag == "module":
        return _module(node, prefix, state, union=None, cache=cache)
    if tag == "union":
        return _union(node, prefix, state, cache)
    if tag in _PARAM_TAGS:
        if not in_module:
            raise _error(
                node, f"<{tag}> belongs inside a <module> (a prompt supplies its value when importing the module)"
            )
        return _param(node)
    if tag in ROLES:
        unknown = set(node.attrs)
        if unknown:
            raise _error(node, f"<{tag}> has unknown attribute(s) {', '.join(sorted(unknown))}")
        kids = [_schema_node(child, prefix, state, node.preserve, in_module, cache) for child in node.children]
        return Role(tag, [kid for kid in kids if kid is not None], node.where)
    if tag == "scaffold":
        raise _error(node, "<scaffold> is declared directly inside <schema>")
    raise _error(
        node,
        f"unknown element <{tag}> in a schema (use module, union, param or parameter, scaffold, system, user or assistant)",
    )


def _module(node: _Element, prefix: str, state: dict, union: str | None, cache: bool = True) -> Module:
    name = _check_name(node.attrs.get("name"), node, "module")
    unknown = set(node.attrs) - {"name", "cache"}
    if unknown:
        raise _error(node, f'<module name="{name}"> has unknown attribute(s) {", ".join(sorted(unknown))}')
    if _ANONYMOUS_RE.match(name):
        raise _error(
            node, f"module name {name!r} is taken by the text outside modules (_text0, _text1, ...): pick another"
        )
    flag = node.attrs.get("cache", "true")
    if flag not in ("true", "false"):
        raise _error(node, f'<module name="{name}"> cache must be "true" or "false", not {flag!r}')
    path = f"{prefix}{name}"
    if path in state["modules"]:
        scope = f"in {prefix[:-1]!r}" if prefix else "at the top of the schema"
        raise _error(node, f"module {path!r} is declared twice (names are unique per scope: {name!r} {scope})")
    if len(state["modules"]) >= MAX_MODULES:
        raise _error(node, f"more than {MAX_MODULES} modules")
    module = Module(name, path, [], node.where, union, cache=cache and flag == "true")
    state["modules"][path] = module
    for child in node.children:
        kid = _schema_node(child, path + "/", state, node.preserve, in_module=True, cache=module.cache)
        if kid is not None:
            module.children.append(kid)
    if not module.children:
        raise _error(node, f"module {path!r} is empty: give it text, a parameter or nested modules")
    names = [param.name for param in _all_params(module.children)]
    duplicate = {n for n in names if names.count(n) > 1}
    if duplicate:
        raise _error(node, f"module {path!r} declares parameter {sorted(duplicate)[0]!r} twice")
    return module


def _all_params(children) -> list[Param]:
    found = []
    for node in children:
        if isinstance(node, Param):
            found.append(node)
        elif isinstance(node, Role):
            found.extend(_all_params(node.children))
    return found


def _union(node: _Element, prefix: str, state: dict, cache: bool = True) -> UnionNode:
    unknown = set(node.attrs) - {"scaffold"}
    if unknown:
        raise _error(node, f"<union> has unknown attribute(s) {', '.join(sorted(unknown))}")
    state["unions"] += 1
    union_id = f"{prefix}union{state['unions']}"
    members = []
    for child in node.children:
        if isinstance(child, str):
            if _clean_text(child, node.preserve):
                raise _error(node, "a <union> holds only <module> elements (text belongs inside its modules)")
            continue
        if child.tag != "module":
            raise _error(child, f"a <union> holds only <module> elements, not <{child.tag}>")
        members.append(_module(child, prefix, state, union=union_id, cache=cache))
    if len(members) < 2:
        raise _error(node, "a <union> needs at least two <module> members")
    scaffold = node.attrs.get("scaffold")
    if scaffold is not None and scaffold not in [member.name for member in members]:
        names = ", ".join(member.name for member in members)
        raise _error(node, f"<union scaffold={scaffold!r}> names no member of this union (its members: {names})")
    return UnionNode(union_id, members, node.where, scaffold)


def _param(node: _Element) -> Param:
    """``<param name len>`` or Prompt Cache's ``<parameter name length>``, either with ``scaffold``."""
    tag = node.tag
    name = _check_name(node.attrs.get("name"), node, "parameter")
    unknown = set(node.attrs) - {"name", "len", "length", "scaffold"}
    if unknown:
        raise _error(node, f'<{tag} name="{name}"> has unknown attribute(s) {", ".join(sorted(unknown))}')
    if "len" in node.attrs and "length" in node.attrs:
        raise _error(node, f'<{tag} name="{name}"> gives both len and length: keep one')
    word = "len" if "len" in node.attrs or tag == "param" else "length"
    raw = node.attrs.get(word)
    try:
        length = int(raw)
    except (TypeError, ValueError):
        raise _error(node, f'<{tag} name="{name}"> needs {word}="N", the most tokens its value may take') from None
    if not 1 <= length <= MAX_PARAM_LEN:
        raise _error(node, f'<{tag} name="{name}"> {word} must be between 1 and {MAX_PARAM_LEN}')
    if [child for child in node.children if not (isinstance(child, str) and not child.strip())]:
        raise _error(node, f'<{tag} name="{name}"/> is empty: its value comes from the prompt')
    return Param(name, length, node.where, node.attrs.get("scaffold") or None)


def _scaffold(node: _Element) -> Scaffold:
    name = _check_name(node.attrs.get("name"), node, "scaffold")
    members = (node.attrs.get("modules") or "").split()
    if len(members) < 2:
        raise _error(node, f'scaffold {name!r} needs modules="a b ..." naming at least two modules')
    return Scaffold(name, members, node.where)


def _check_scaffold(scaffold: Scaffold, schema: PMLSchema) -> None:
    unions = {}
    for path in scaffold.modules:
        module = schema.modules.get(path)
        if module is None:
            raise PMLError(
                f"scaffold {scaffold.name!r} names unknown module {path!r}", scaffold.where.line, scaffold.where.column
            )
        if not module.cache:
            raise PMLError(
                f'scaffold {scaffold.name!r} names module {path!r}, which is never cached (cache="false")',
                scaffold.where.line,
                scaffold.where.column,
            )
        if module.union and unions.setdefault(module.union, path) != path:
            raise PMLError(
                f"scaffold {scaffold.name!r} names {unions[module.union]!r} and {path!r}, two members of one union",
                scaffold.where.line,
                scaffold.where.column,
            )
    if len(set(scaffold.modules)) != len(scaffold.modules):
        raise PMLError(f"scaffold {scaffold.name!r} names a module twice", scaffold.where.line, scaffold.where.column)


# -- prompts ------------------------------------------------------------------------------------------
def parse_prompt(source: str, schema: PMLSchema) -> PromptDoc:
    """Parse a prompt and check it against ``schema`` (imports, unions, parameter names)."""
    root = _parse_xml(source, "prompt")
    if root.tag != "prompt":
        raise _error(root, f'a prompt starts with <prompt schema="...">, not <{root.tag}>')
    wanted = root.attrs.get("schema")
    if not wanted:
        raise _error(root, '<prompt> needs schema="NAME" naming the schema it is built from')
    if wanted != schema.name:
        raise _error(root, f"unknown schema {wanted!r}: this prompt was checked against schema {schema.name!r}")
    items = _prompt_items(root.children, schema.top_level, root.preserve, used_unions={}, schema_modules=schema.modules)
    if not any(isinstance(item, Import) for item in items) and not any(
        isinstance(item, PromptText) and item.text.strip() for item in items
    ):
        raise _error(root, "the prompt is empty: import modules or write some text")
    return PromptDoc(wanted, items)


def _prompt_items(
    children,
    available: dict[str, Module],
    preserve: bool,
    used_unions: dict,
    role: str | None = None,
    schema_modules=None,
) -> list:
    items: list = []
    for child in children:
        if isinstance(child, str):
            text = _clean_text(child, preserve)
            if text is not None:
                items.append(PromptText(text, role))
            continue
        if child.tag in ROLES:
            if role is not None:
                raise _error(child, f"<{child.tag}> cannot be inside <{role}>")
            inner = _prompt_items(
                child.children, available, child.preserve, used_unions, role=child.tag, schema_modules=schema_modules
            )
            if any(isinstance(item, Import) for item in inner):
                raise _error(child, f"modules are imported outside <{child.tag}>; put only free text in it")
            text = "".join(item.text for item in inner)
            items.append(PromptText(text, child.tag))
            continue
        module = available.get(child.tag)
        if module is None:
            raise _error(child, _unknown_module_message(child.tag, available, schema_modules))
        if module.union:
            other = used_unions.setdefault(module.union, module.path)
            if other != module.path:
                raise _error(child, f"{other!r} and {module.path!r} are members of one union: import only one of them")
        params = module.params()
        unknown = set(child.attrs) - set(params)
        if unknown:
            raise _error(
                child,
                f"module {module.path!r} has no parameter {sorted(unknown)[0]!r} (it has: {', '.join(sorted(params)) or 'none'})",
            )
        nested = _prompt_items(
            child.children, module.submodules(), child.preserve, used_unions, schema_modules=schema_modules
        )
        if any(isinstance(item, PromptText) and (item.text.strip() or item.role) for item in nested):
            raise _error(
                child, f"put free text outside <{child.tag}>: inside a module only its nested modules may be imported"
            )
        nested = [item for item in nested if isinstance(item, Import)]  # spaces between imports
        items.append(Import(module.path, dict(child.attrs), nested, child.where))
    return items


def _unknown_module_message(tag: str, available: dict[str, Module], schema_modules=None) -> str:
    nested = [path for path in (schema_modules or {}) if path.rsplit("/", 1)[-1] == tag and "/" in path]
    if nested:
        ways = []
        for path in nested[:3]:  # one name may live in several scopes
            outer = path.rsplit("/", 1)[0].split("/")
            opening = "".join(f"<{name}>" for name in outer)
            closing = "".join(f"</{name}>" for name in reversed(outer))
            ways.append(f"{opening}<{tag}/>{closing}")
        scopes = ", ".join(repr(path.rsplit("/", 1)[0]) for path in nested[:3])
        return f"module <{tag}/> is nested in {scopes}: import it as {' or '.join(ways)}"
    choices = ", ".join(sorted(available)) or "none here"
    return f"unknown module <{tag}/> (modules importable here: {choices})"

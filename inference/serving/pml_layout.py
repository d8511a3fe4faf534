"""Prompt-module layout and prompt plans (Prompt Cache, sections 3.3-3.4). Pure.

Layout: every module of a schema gets the positions it holds in the schema. Text outside
modules becomes anonymous modules that every prompt includes; union members share one
start and the union reserves its longest member; a parameter reserves ``len`` positions,
filled with its scaffold text (padded with the placeholder token) when the module is encoded.
A module holding only nested modules has no tokens and no state: importing it opens its scope.

Plan: a prompt becomes the list of pieces to assemble in position order: the schema's
anonymous modules, the imported modules (or a scaffold standing for several of them) with
their parameter values, and the prompt's own text, placed after the module it follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from inference.serving.pml import (
    Import,
    Module,
    Param,
    PMLError,
    PMLSchema,
    PromptDoc,
    PromptText,
    Role,
    Text,
    UnionNode,
)

ANONYMOUS = "_text"


class Tokenizer(Protocol):
    bos: int | None
    placeholder: int

    def text(self, text: str) -> list[int]: ...  # user text: no special tokens parsed

    def special(self, text: str) -> list[int]: ...  # template text: special tokens parsed

    def wrappers(self, role: str) -> tuple[str, str]: ...  # chat-template prefix and suffix

    def generation_prefix(self) -> str: ...  # what opens the assistant's answer


@dataclass
class Run:
    """Tokens at consecutive positions."""

    start: int
    tokens: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class ModuleLayout:
    path: str
    start: int
    end: int  # one past the last position the module spans (nested modules included)
    runs: list[Run]  # the module's own tokens; nested modules are modules of their own
    params: dict[str, tuple[int, int]]  # name -> (first position, len)
    anonymous: bool = False
    union: str | None = None
    cache: bool = True  # False: encoded for every request, never stored or fetched

    @property
    def token_count(self) -> int:
        return sum(len(run.tokens) for run in self.runs)

    @property
    def last(self) -> tuple[int, int]:
        """(position, token) of the module's last own token."""
        run = [run for run in self.runs if run.tokens][-1]
        return run.end - 1, run.tokens[-1]


@dataclass
class SchemaLayout:
    name: str
    digest: str
    modules: dict[str, ModuleLayout]  # by path, anonymous ones included
    scaffolds: dict[str, list[str]]
    positions: int  # positions the whole schema spans

    @property
    def anonymous(self) -> list[ModuleLayout]:
        return [module for module in self.modules.values() if module.anonymous]


class _LayoutBuilder:
    def __init__(self, schema: PMLSchema, tokenizer: Tokenizer):
        self.schema = schema
        self.tok = tokenizer
        self.pos = 0
        self.modules: dict[str, ModuleLayout] = {}
        self.anon: ModuleLayout | None = None

    def build(self) -> SchemaLayout:
        if self.tok.bos is not None:
            self._anon_tokens([self.tok.bos])
        for node in self.schema.children:
            self._top(node)
        self._flush_anon()
        scaffolds = {scaffold.name: list(scaffold.modules) for scaffold in self.schema.scaffolds}
        for scaffold in self.schema.scaffolds:
            if not any(self.modules[path].runs for path in scaffold.modules):
                where = scaffold.where
                raise PMLError(
                    f"scaffold {scaffold.name!r} names only modules without text of their own", where.line, where.column
                )
        return SchemaLayout(self.schema.name, self.schema.digest, self.modules, scaffolds, self.pos)

    # -- anonymous text between modules -----------------------------------------------------
    def _anon_tokens(self, tokens: list[int]) -> None:
        if not tokens:
            return
        if self.anon is None:
            path = f"{ANONYMOUS}{sum(1 for m in self.modules.values() if m.anonymous)}"
            self.anon = ModuleLayout(path, self.pos, self.pos, [Run(self.pos)], {}, anonymous=True)
            self.modules[path] = self.anon
        self.anon.runs[0].tokens.extend(tokens)
        self.pos += len(tokens)
        self.anon.end = self.pos

    def _flush_anon(self) -> None:
        self.anon = None

    def _top(self, node) -> None:
        if isinstance(node, Text):
            self._anon_tokens(self.tok.text(node.text))
        elif isinstance(node, Role):
            prefix, suffix = self.tok.wrappers(node.role)
            self._anon_tokens(self.tok.special(prefix))
            for child in node.children:
                self._top(child)
            self._anon_tokens(self.tok.special(suffix))
        elif isinstance(node, Module):
            self._flush_anon()
            self._module(node)
        elif isinstance(node, UnionNode):
            self._flush_anon()
            self._union(node)

    # -- modules -------------------------------------------------------------------------------
    def _union(self, node: UnionNode) -> None:
        start, end = self.pos, self.pos
        for member in node.members:
            self.pos = start
            self._module(member)
            end = max(end, self.pos)
        self.pos = end

    def _module(self, module: Module) -> None:
        layout = ModuleLayout(
            module.path, self.pos, self.pos, [Run(self.pos)], {}, union=module.union, cache=module.cache
        )
        self.modules[module.path] = layout
        self._body(module.children, layout)
        layout.runs = [run for run in layout.runs if run.tokens]
        layout.end = self.pos
        if not layout.runs and not module.submodules():
            where = module.where
            raise PMLError(f"module {module.path!r} has no text of its own", where.line, where.column)

    def _body(self, children, layout: ModuleLayout) -> None:
        for child in children:
            if isinstance(child, Text):
                self._own(layout, self.tok.text(child.text))
            elif isinstance(child, Param):
                layout.params[child.name] = (self.pos, child.length)
                scaffold = self.tok.text(child.scaffold) if child.scaffold else []
                if len(scaffold) > child.length:
                    raise PMLError(
                        f"scaffold of parameter {child.name!r} is {len(scaffold)} tokens, longer than its length={child.length}",
                        child.where.line,
                        child.where.column,
                    )
                self._own(layout, scaffold + [self.tok.placeholder] * (child.length - len(scaffold)))
            elif isinstance(child, Role):
                prefix, suffix = self.tok.wrappers(child.role)
                self._own(layout, self.tok.special(prefix))
                self._body(child.children, layout)
                self._own(layout, self.tok.special(suffix))
            elif isinstance(child, (Module, UnionNode)):
                if isinstance(child, Module):
                    self._module(child)
                else:
                    self._union(child)
                layout.runs.append(Run(self.pos))

    def _own(self, layout: ModuleLayout, tokens: list[int]) -> None:
        layout.runs[-1].tokens.extend(tokens)
        self.pos += len(tokens)


def lay_out(schema: PMLSchema, tokenizer: Tokenizer) -> SchemaLayout:
    """Positions of every module of ``schema`` (tokenizes its text)."""
    return _LayoutBuilder(schema, tokenizer).build()


# -- plans -----------------------------------------------------------------------------------------
@dataclass
class ModulePiece:
    """Cached state to place: one module, or a scaffold standing for several."""

    key_name: str  # module path, or "scaffold:NAME"
    members: list[str]  # module paths whose own tokens the state holds
    start: int
    # "module/param" -> (first position, len, value tokens)
    args: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)
    cache: bool = True  # False: encode it for this request; never store or fetch it


@dataclass
class TextPiece:
    tokens: list[int]
    anchor: int  # placed after the module piece ending here (or after everything before it)


@dataclass
class Plan:
    pieces: list  # ModulePiece | TextPiece in assembly order
    imported: list[str]  # module paths the prompt imported


def plan_prompt(doc: PromptDoc, layout: SchemaLayout, tokenizer: Tokenizer) -> Plan:
    """The pieces of a prompt in assembly order; raises PMLError for a parameter value too long."""
    imports: list[tuple[Import, int]] = []  # (import, index of the item it came from)
    texts: list[tuple[list[int], int]] = []  # (tokens, anchor)
    anchor = 0
    last_role = None
    for item in doc.items:
        if isinstance(item, Import):
            for imported in _flatten(item):
                imports.append(imported)
                anchor = max(anchor, layout.modules[imported.name].end)
            last_role = None
        elif isinstance(item, PromptText):
            if item.role:
                prefix, suffix = tokenizer.wrappers(item.role)
                tokens = tokenizer.special(prefix) + tokenizer.text(item.text) + tokenizer.special(suffix)
            else:
                tokens = tokenizer.text(item.text)
            texts.append((tokens, anchor))
            last_role = item.role
    if last_role == "user":
        texts.append((tokenizer.special(tokenizer.generation_prefix()), anchor))

    imported_paths = [imp.name for imp in imports]
    pieces: list[tuple[tuple, object]] = []
    covered: set[str] = set()
    for name, members in layout.scaffolds.items():
        if all(member in imported_paths for member in members) and not covered & set(members):
            start = min(layout.modules[m].start for m in members)
            piece = ModulePiece(f"scaffold:{name}", list(members), start)
            for imp in imports:
                if imp.name in members:
                    piece.args.update(_args(imp, layout.modules[imp.name], tokenizer))
            pieces.append(((start, 0, len(pieces)), piece))
            covered.update(members)
    for module in layout.anonymous:
        pieces.append(((module.start, 0, len(pieces)), ModulePiece(module.path, [module.path], module.start)))
    for imp in imports:
        if imp.name in covered or not layout.modules[imp.name].runs:  # a module of modules has no state
            continue
        module = layout.modules[imp.name]
        piece = ModulePiece(module.path, [module.path], module.start, _args(imp, module, tokenizer), cache=module.cache)
        pieces.append(((module.start, 0, len(pieces)), piece))
    for tokens, text_anchor in texts:
        if tokens:
            pieces.append(((text_anchor, 1, len(pieces)), TextPiece(tokens, text_anchor)))
    pieces.sort(key=lambda pair: pair[0])
    return Plan([piece for _, piece in pieces], imported_paths)


def all_pieces(layout: SchemaLayout) -> list[ModulePiece]:
    """Every state a schema stores: each module (anonymous ones included) and each scaffold.

    Left out: modules marked ``cache="false"`` and modules holding only nested modules.
    """
    pieces = [
        ModulePiece(path, [path], module.start)
        for path, module in layout.modules.items()
        if module.runs and module.cache
    ]
    for name, members in layout.scaffolds.items():
        pieces.append(ModulePiece(f"scaffold:{name}", list(members), min(layout.modules[m].start for m in members)))
    return pieces


def piece_runs(layout: SchemaLayout, piece: ModulePiece) -> list[tuple[Run, int]]:
    """The runs a piece's state holds, with how far each moved from its schema position.

    A module keeps its schema positions. A scaffold's members are encoded back to back
    from the first one's start: their schema positions can lie far apart (each union
    reserves its longest member), and a state spanning more than a sliding window loses
    the cells it cannot see when llama.cpp loads it. Served prompts close such gaps anyway.
    """
    runs = sorted((run for member in piece.members for run in layout.modules[member].runs), key=lambda run: run.start)
    if not piece.key_name.startswith("scaffold:"):
        return [(run, 0) for run in runs]
    packed, position = [], runs[0].start
    for run in runs:
        packed.append((Run(position, run.tokens), position - run.start))
        position += len(run.tokens)
    return packed


def _flatten(item: Import) -> list[Import]:
    found = [item]
    for child in item.children:
        if isinstance(child, Import):
            found.extend(_flatten(child))
    return found


def _args(imp: Import, module: ModuleLayout, tokenizer: Tokenizer) -> dict[str, tuple[int, int, list[int]]]:
    values = {}
    for name, value in imp.args.items():
        start, length = module.params[name]
        tokens = tokenizer.text(value)
        if len(tokens) > length:
            raise PMLError(
                f"value of parameter {name!r} of module {module.path!r} is {len(tokens)} tokens, longer than its len={length}",
                imp.where.line,
                imp.where.column,
            )
        values[f"{module.path}/{name}"] = (start, length, tokens)
    return values


class Placement:
    """Where each piece of a prompt goes in the served sequence. Pure bookkeeping.

    Modules keep their schema positions up to a running offset. With ``compact`` (the
    default) a gap left by modules the prompt did not import, or by a shorter union
    member, is closed by moving what follows left: Gemma-3's sliding-window layers see
    512 positions, and a schema spread wider than the prompt would hide its start from
    the question. Text goes after the last placed cell; a module that text has run into
    moves right. Nested modules land in their parent's gap, as in the schema.
    """

    def __init__(self, compact: bool = True):
        self.compact = compact
        self.offset = 0  # schema position - served position, for what comes next
        self.occupied: list[tuple[int, int]] = []

    @property
    def cursor(self) -> int:
        return max((end for _, end in self.occupied), default=0)

    def module(self, runs: list[tuple[int, int]]) -> int:
        """Place a module with these (start, end) runs in schema positions; returns its shift."""
        first = runs[0][0]
        target = first - self.offset
        if self._free([(start - self.offset, end - self.offset) for start, end in runs]):
            if target > self.cursor and self.compact:
                self.offset += target - self.cursor
                target = self.cursor
        else:
            target = self.cursor
            self.offset = first - target
        delta = target - first
        self.occupied.extend((start + delta, end + delta) for start, end in runs)
        return delta

    def text(self, length: int) -> int:
        """Place ``length`` tokens of text after everything; returns their first position."""
        start = self.cursor
        self.occupied.append((start, start + length))
        return start

    def _free(self, runs: list[tuple[int, int]]) -> bool:
        if any(start < 0 for start, _ in runs):
            return False
        return not any(start < o_end and o_start < end for start, end in runs for o_start, o_end in self.occupied)

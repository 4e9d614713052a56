"""SGLang's source read from a release wheel as an archive: modules, their top-level statements, classes and the
names they import, for scripts/sglang_layer_rules.py. Nothing is imported from the wheel.

A module is cut into its top-level statements (a line at column 0 outside any string or bracket starts one;
decorators, else/elif/except/finally and closing brackets stay with their statement), and a statement is parsed
with `ast` only when it is read: imports and compound blocks at once, a class's header for its bases, its body
when a method of it is read. A module whose cut leaves a statement with unbalanced brackets, or a statement
that does not parse, is parsed whole instead, so the cut never changes what is read, only what it costs.
"""

from __future__ import annotations

import ast
import bisect
import builtins
import functools
import keyword
import re
import zipfile
from pathlib import Path

MODELS = "sglang.srt.models"
# comments, strings (a multi-line one must not start a statement inside it) and backslash continuations
_LEXEME = re.compile(
    r"""\#[^\n]*|\"\"\"(?:\\.|[^\\])*?\"\"\"|'''(?:\\.|[^\\])*?'''|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|\\\n""",
    re.S,
)
_LINE_START = re.compile(r"^(?=[^\s#)\]}])", re.M)
_CONTINUES = re.compile(r"(?:else|elif|except|finally)\b")
_HEADS = re.compile(r"(?:class\s+(?P<cls>\w+)|(?P<def>(?:async\s+)?def\s)|(?P<name>\w+)\s*(?::[^=\n]*)?=(?!=))")


class Unresolved(Exception):
    """A class or rule cannot be followed from the source; the message says where."""


@functools.lru_cache(maxsize=None)
def _parse(text: str) -> ast.Module:
    return ast.parse(text)


@functools.lru_cache(maxsize=None)
def _statements(text: str) -> tuple[str, ...] | None:
    """The module's top-level statements as text, or None when a cut is not certain."""
    spans = [(m.start(), m.end() + (m.group() == "\\\n")) for m in _LEXEME.finditer(text) if "\n" in m.group()]
    ends = [end for _, end in spans]
    starts, previous = [], None
    for m in _LINE_START.finditer(text):
        at = bisect.bisect_right(ends, m.start())
        if at < len(spans) and spans[at][0] < m.start():
            continue  # inside a multi-line string or after a backslash
        line, previous = previous, m.start()
        if starts and (_CONTINUES.match(text, m.start()) or text[line] == "@"):
            continue  # else/except/... continue a statement; a decorator's statement follows it
        starts.append(m.start())
    pieces = tuple(text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True))
    for piece in pieces:
        bare = _LEXEME.sub("", piece)
        if sum(map(bare.count, "([{")) != sum(map(bare.count, ")]}")):
            return None
    return pieces


class ClassDef:
    """A class defined in sglang: its name, module, source text, bases (read from its header), and its parsed
    definition on demand."""

    def __init__(self, name: str, module: str, text: str, node: ast.ClassDef | None = None):
        self.name, self.module, self.text, self._node = name, module, text, node
        self.bases: list = []  # ClassDef, or the dotted name of a class defined outside sglang

    def node(self) -> ast.ClassDef:
        if self._node is None:
            self._node = _parse(self.text).body[0]
        return self._node

    def header(self) -> ast.ClassDef:
        """The class statement without its body (its bases), parsed from its first lines."""
        if self._node is not None:
            return self._node
        lines = self.text.split("\n")
        for count in range(1, min(len(lines), 20) + 1):
            try:
                return ast.parse("\n".join(lines[:count]) + "\n    pass").body[0]
            except SyntaxError:
                continue
        return self.node()

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class Module:
    """The top-level statements of one module: classes and `X = ...` by name (parsed when read), imports and
    compound blocks parsed."""

    def __init__(self, name: str, text: str):
        self.name = name
        self.classes: dict[str, ClassDef] = {}
        self.assigns: dict[str, str | ast.stmt] = {}
        self.parsed: list[ast.stmt] = []  # imports and what if/try/with blocks hold
        pieces = _statements(text)
        try:
            if pieces is not None:
                for piece in pieces:
                    self._add_piece(piece)
                return
        except SyntaxError:
            self.classes, self.assigns, self.parsed = {}, {}, []
        lines = text.split("\n")
        for node in _top_level(_parse(text).body):
            self._add_node(node, "\n".join(lines[node.lineno - 1 : node.end_lineno]))

    def _add_piece(self, piece: str) -> None:
        head = _HEADS.match(piece)
        if piece.startswith("@"):  # the decorated statement starts at a later line
            head = _HEADS.match(piece, re.search(r"^(?!@)", piece, re.M).start())
        if head and head.group("cls"):
            self.classes.setdefault(head.group("cls"), ClassDef(head.group("cls"), self.name, piece))
        elif head and head.group("def"):
            return
        elif head and head.group("name") and not keyword.iskeyword(head.group("name")) and not piece.startswith("@"):
            self.assigns.setdefault(head.group("name"), piece)
        else:
            for node in _top_level(_parse(piece).body):
                self._add_node(node, ast.unparse(node) if isinstance(node, ast.ClassDef) else "")

    def _add_node(self, node: ast.stmt, text: str) -> None:
        if isinstance(node, ast.ClassDef):
            self.classes.setdefault(node.name, ClassDef(node.name, self.name, text, node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                self.assigns.setdefault(targets[0].id, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            self.parsed.append(node)

    def assignment(self, name: str) -> ast.expr | None:
        """The value of the top-level `name = value`, or None."""
        found = self.assigns.get(name)
        if isinstance(found, str):
            found = self.assigns[name] = _parse(found).body[0]
        return None if found is None or found.value is None else found.value


def _top_level(body: list[ast.stmt]):
    """Statements run at import: the body and the bodies of its if/try/with blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(node, part, []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)


def absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ImportFrom in `module` reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".")[: -node.level]
    return ".".join(package + ([node.module] if node.module else []))


def mro(cls: ClassDef | str) -> list[ClassDef | str]:
    """Python's C3 linearization over the classes read; a class defined outside sglang is a leaf."""
    if isinstance(cls, str):
        return [cls]
    sequences = [mro(b) for b in cls.bases] + [list(cls.bases)]
    order: list = [cls]
    while any(sequences):
        sequences = [s for s in sequences if s]
        for seq in sequences:
            head = seq[0]
            if not any(head in s[1:] for s in sequences):
                break
        else:
            raise Unresolved(f"{cls}: its bases have no consistent method resolution order")
        order.append(head)
        sequences = [s[1:] if s[0] is head else s for s in sequences]
    return order


class Release:
    """One SGLang wheel's sources, read on demand."""

    def __init__(self, wheel: Path):
        self.zip = zipfile.ZipFile(wheel)
        self.files = set(self.zip.namelist())
        self.memo: dict = {}  # for the callers' own per-release results
        self._modules: dict[str, Module | None] = {}
        self._names: dict[tuple[str, str], ClassDef | str] = {}

    def module(self, name: str) -> Module | None:
        """Module `name` of the wheel, or None when the wheel has no such module (not sglang's)."""
        if name not in self._modules:
            path = name.replace(".", "/")
            found = next((p for p in (f"{path}.py", f"{path}/__init__.py") if p in self.files), None)
            self._modules[name] = Module(name, self.zip.read(found).decode("utf-8-sig")) if found else None
        return self._modules[name]

    def model_modules(self) -> list[str]:
        """The modules of sglang/srt/models/ that registry.import_model_classes imports (not packages)."""
        prefix = MODELS.replace(".", "/") + "/"
        names = (p[len(prefix) : -3] for p in self.files if p.startswith(prefix) and p.endswith(".py"))
        return sorted(f"{MODELS}.{n}" for n in names if "/" not in n and n != "__init__")

    def entry_classes(self) -> dict[str, ClassDef | str | Unresolved]:
        """Registered name (the class's __name__) -> its class, as registry.import_model_classes builds it."""
        entries: dict = {}
        for module in self.model_modules():
            value = self.module(module).assignment("EntryClass")
            for item in [] if value is None else value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]:
                try:
                    cls = self.lookup(module, item)
                except Unresolved as err:
                    cls = err
                name = cls.name if isinstance(cls, ClassDef) else str(cls) if isinstance(cls, str) else ""
                entries[name.rsplit(".", 1)[-1] or ast.unparse(item).rsplit(".", 1)[-1]] = cls
        return entries

    def resolve(self, module: str, name: str, depth: int = 0) -> ClassDef | str:
        """What `name` means at the top of `module`: a class defined in sglang, or the dotted name of one that is
        not (torch's nn.Module); through `X = Y` aliases and imports. Unresolved when `module` (in the wheel)
        does not define `name` at its top."""
        key = (module, name)
        if key not in self._names:
            self._names[key] = self._resolve(module, name, depth)
        return self._names[key]

    def _resolve(self, module: str, name: str, depth: int) -> ClassDef | str:
        source = self.module(module)
        if source is None:
            return f"{module}.{name}"
        if depth > 20:
            raise Unresolved(f"{module}.{name}: imports nest deeper than 20")
        if name in source.classes:
            cls = source.classes[name]
            cls.bases = [self.lookup(module, b, depth=depth + 1) for b in cls.header().bases]
            if any(b is None for b in cls.bases):
                raise Unresolved(f"{cls}: a base is not a name eyas can follow")
            return cls
        value = source.assignment(name)
        if value is not None:
            found = self.lookup(module, value, depth=depth + 1)
            if found is None:
                raise Unresolved(f"{module}: {name} = {ast.unparse(value)[:80]} is not a class eyas can follow")
            return found
        stars = []
        for node in source.parsed:
            for alias in node.names if isinstance(node, ast.ImportFrom) else ():
                if (alias.asname or alias.name) == name:
                    return self.resolve(absolute(module, node), alias.name, depth + 1)
                if alias.name == "*":
                    stars.append(absolute(module, node))
        for star in stars:
            try:
                return self.resolve(star, name, depth + 1)
            except Unresolved:
                continue
        if hasattr(builtins, name):
            return f"builtins.{name}"
        raise Unresolved(f"{module}: {name} is not defined at the module's top level")

    def lookup(self, module: str, node: ast.expr, *, imports: dict | None = None, cls: ClassDef | None = None,
               depth: int = 0) -> ClassDef | str | None:  # fmt: skip
        """The class an expression in `module` names (`X`, `mod.X`, `self.attr` for a class attribute of `cls`,
        `Generic[T]`), with `imports` a function's own `from m import X`; None when it names no class."""
        if isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Name):
            if imports and node.id in imports:
                return self.resolve(*imports[node.id], depth + 1)
            return self.resolve(module, node.id, depth + 1)
        parts = _dotted(node)
        if parts is None:
            return None
        if parts[0] == "self" and cls is not None and len(parts) == 2:
            value = _class_attribute(cls, parts[1])
            return None if value is None else self.lookup(value[0].module, value[1], depth=depth + 1)
        imported = self.module_alias(module, parts[0])
        if imported is None:
            return None
        owner = ".".join([imported, *parts[1:-1]])
        if self.module(owner) is not None:
            return self.resolve(owner, parts[-1], depth + 1)
        return None if owner.startswith("sglang.") else f"{owner}.{parts[-1]}"

    def module_alias(self, module: str, alias: str) -> str | None:
        """The module `alias` names in `module` (`import a.b as alias`, `from a import b as alias` with a.b a
        module), or None."""
        for node in self.module(module).parsed:
            for a in node.names:
                if isinstance(node, ast.Import) and a.asname == alias:
                    return a.name
                if isinstance(node, ast.Import) and a.asname is None and a.name.split(".")[0] == alias:
                    return alias  # `import a.b` binds a
                if isinstance(node, ast.ImportFrom) and (a.asname or a.name) == alias:
                    full = f"{absolute(module, node)}.{a.name}"
                    return full if self.module(full) or not full.startswith("sglang.") else None
        return None


def _dotted(node: ast.expr) -> list[str] | None:
    """["a", "b", "C"] for `a.b.C`; None for any other expression."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _class_attribute(cls: ClassDef, name: str) -> tuple[ClassDef, ast.expr] | None:
    """(owner, value) of the class-body assignment `name = value` first in the MRO of `cls`."""
    for owner in mro(cls):
        if isinstance(owner, str) or name not in owner.text:
            continue
        for node in owner.node().body:
            if isinstance(node, ast.Assign) and name in [ast.unparse(t) for t in node.targets]:
                return owner, node.value
    return None

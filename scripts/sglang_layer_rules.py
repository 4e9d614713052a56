"""SGLang's aux layer-id rule for every target class, derived from each release in kits/sglang-wheels.txt.

    python scripts/sglang_layer_rules.py            # rewrite eyas/sglang_layer_rules.py from the kit's wheels
    python scripts/sglang_layer_rules.py --check    # exit 1 when eyas/sglang_layer_rules.py differs

SGLang resolves a target's config.json `architectures` to a class through the `EntryClass` of each module of
sglang/srt/models/ (models/registry.py: import_model_classes, keyed by the class's own name) and numbers the
aux layer ids it is given (eagle_config ids, --return-aux-hidden-state-layer-ids) in that class's
`set_eagle3_layers_to_capture` (model_runner_components/attention_backend_setup.py calls it on the model).
For each release this reads the wheel as an archive (nothing is imported; scripts/sglang_source.py reads the
modules' statements):
- every EntryClass, resolved through aliases and imports to its class definition;
- the class's method resolution order (C3 over the classes defined in sglang; others end the search), so a class
  that inherits the method (MistralLarge3ForCausalLM from DeepseekV3ForCausalLM) gets its parent's rule;
- the `set_eagle3_layers_to_capture` found there, run alone on probe ids with a stand-in `self` (the config's
  layer count, the last pipeline rank, the sub-models its __init__ builds: a wrapper that hands the ids to
  `self.language_model` gets the rule of the class it builds there); what reaches `layers_to_capture` is
  compared with each rule of RULES on every probe.
A class whose method cannot be followed (a sub-model built by an expression, a name the method needs) is
`unresolved: why`; one without the method is `none` (SGLang refuses to capture its aux states). eyas refuses both.
The output is data (eyas/sglang_layer_rules.py); tests/test_layer_id_rules.py re-derives it from the kit.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_source import ClassDef, Release, Unresolved, absolute, mro  # noqa: E402

from kits import lock_file, require_kit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "eyas" / "sglang_layer_rules.py"
KIT = "sglang-wheels"
METHOD = "set_eagle3_layers_to_capture"
PROBE_LAYERS = (61, 32)  # the probes run at two layer counts: a rule keyed on N shows at both

# Each rule: (configured ids, layer count) -> the layers captured (inputs of layers i: HF hidden_states[i]).
RULES = {
    "plus_one": lambda ids, n: [i + 1 for i in ids],  # llama.py LlamaForCausalLM and most
    "plus_one_if_first_is_1": lambda ids, n: [i + 1 for i in ids] if ids[0] == 1 else list(ids),  # deepseek_v2.py
    "plus_one_unless_last_is_n": lambda ids, n: list(ids) if max(ids) == n else [i + 1 for i in ids],  # gpt_oss.py
    "as_given": lambda ids, n: list(ids),
}


def probes(n: int) -> list[tuple[int, ...]]:
    """Configured ids for an N-layer target: first ids 1, 2 and 3, one list ending at N (gpt_oss.py's case)."""
    return [(1, n // 2, n - 3), (2, n // 2, n - 3), (3, n // 2, n - 3), (3, n // 2, n), (2, 4), (1, 2, 3, 4), (10,),
            (5, 9, 20), (n - 2,)]  # fmt: skip


@functools.cache
def method(cls: ClassDef, name: str) -> tuple[ClassDef, ast.FunctionDef] | None:
    """(owner, definition) of method `name`, first in the MRO of `cls`; None when no class defines it."""
    for owner in mro(cls):
        if isinstance(owner, str) or name not in owner.text:  # a definition names the method
            continue
        for node in owner.node().body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return owner, node
            if isinstance(node, ast.Assign) and name in [ast.unparse(t) for t in node.targets]:
                raise Unresolved(f"{owner.module}.{owner.name}.{name} is assigned, not defined")
    return None


def sub_model(release: Release, cls: ClassDef, attr: str) -> ClassDef | str | None:
    """The class of `self.<attr> = Cls(...)` in the __init__ of the most derived class of the MRO that assigns it;
    None when it is built by an expression that names no class eyas can follow, or by different classes.
    `Cls` may be a parameter of that __init__: its default, or what a subclass passes to `super().__init__`.
    Raises AttributeError when no __init__ assigns it."""
    key = (id(cls), attr)
    if key not in release.memo:
        release.memo[key] = _sub_model(release, cls, attr)
    if release.memo[key] is AttributeError:
        raise AttributeError(f"self.{attr}: no __init__ of {cls.name}'s classes assigns it")
    return release.memo[key]


def _sub_model(release: Release, cls: ClassDef, attr: str):
    order = mro(cls)
    for at, owner in enumerate(order):
        init = _init(owner)
        classes = []
        for node in ast.walk(init) if init else ():
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                continue
            target = node.targets[0]
            if not (isinstance(target, ast.Attribute) and target.attr == attr and ast.unparse(target.value) == "self"):
                continue
            if isinstance(node.value, ast.Constant) and node.value.value is None:
                continue
            func = node.value.func if isinstance(node.value, ast.Call) else None
            classes.append(_built_class(release, cls, order[:at], owner, init, func))
        if classes:
            return classes[0] if all(c is classes[0] for c in classes) else None
    return AttributeError


def _init(owner: ClassDef | str) -> ast.FunctionDef | None:
    if isinstance(owner, str) or "__init__" not in owner.text:
        return None
    return next((n for n in owner.node().body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)


@functools.cache
def _local_imports(owner: ClassDef, function: ast.FunctionDef) -> dict[str, tuple[str, str]]:
    return {
        alias.asname or alias.name: (absolute(owner.module, node), alias.name)
        for node in ast.walk(function) if isinstance(node, ast.ImportFrom) for alias in node.names
    }  # fmt: skip


def _built_class(release: Release, cls: ClassDef, derived: list, owner: ClassDef, init: ast.FunctionDef, func):
    """The class `func` names in owner's __init__ (None when it names none eyas can follow)."""
    found = (owner, func) if func is not None else None
    if isinstance(func, ast.Name):
        found = _argument(derived, owner, init, func.id) or found
    if found is None:
        return None
    where, expr = found
    try:
        return release.lookup(where.module, expr, imports=_local_imports(where, _init(where)), cls=cls)
    except Unresolved:
        return None


def _argument(derived: list, owner: ClassDef, init: ast.FunctionDef, name: str):
    """(class, expression) of what parameter `name` of owner's __init__ holds for an instance of the most derived
    class: what the nearest subclass's __init__ passes to `super().__init__` (by keyword or position, followed
    through that subclass's own parameters), else the default; None when `name` is no parameter or has neither."""
    positional = [a.arg for a in init.args.args][1:]  # without self
    if name not in positional and name not in [a.arg for a in init.args.kwonlyargs]:
        return None
    callers = [(at, c) for at, c in enumerate(derived) if _init(c) is not None]
    if callers:
        at, sub = callers[-1]
        sub_init = _init(sub)
        for node in ast.walk(sub_init):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "super().__init__":
                passed = next((k.value for k in node.keywords if k.arg == name), None)
                if passed is None and name in positional and positional.index(name) < len(node.args):
                    passed = node.args[positional.index(name)]
                if passed is not None:
                    through = None
                    if isinstance(passed, ast.Name):  # the subclass's own parameter, passed on
                        through = _argument(derived[:at], sub, sub_init, passed.id)
                    return through or (sub, passed)
    defaults = dict(zip(positional[::-1], init.args.defaults[::-1], strict=False))
    defaults |= {a.arg: d for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults, strict=True) if d}
    return (owner, defaults[name]) if name in defaults else None


def captured(release: Release, cls: ClassDef, ids: list[int], num_layers: int, depth: int = 0) -> list[int]:
    """What `cls.set_eagle3_layers_to_capture(ids)` leaves in layers_to_capture, by running the method's own
    source on a stand-in `self`."""
    owner, node = method(cls, METHOD)
    result: dict[str, list[int]] = {}

    def sub(attr: str):
        return _SubModel(release, sub_model(release, cls, attr), attr, num_layers, result, depth)

    try:
        _compile(owner, node)(_Self(num_layers, result, sub), list(ids))
    except Unresolved:
        raise
    except Exception as err:  # the method needs something the stand-in does not have: say what
        raise Unresolved(f"{owner.module}.{owner.name}.{METHOD}: {type(err).__name__}: {err}") from err
    if "layers" not in result:
        raise Unresolved(f"{owner.module}.{owner.name}.{METHOD}: sets no layers_to_capture for ids {list(ids)}")
    return result["layers"]


@functools.cache
def _compile(owner: ClassDef, node: ast.FunctionDef):
    """The method alone, without its annotations and decorators, as a plain function."""
    func = ast.parse(ast.unparse(node)).body[0]
    func.decorator_list, func.returns = [], None
    for arg in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs):
        arg.annotation = None
    module = ast.fix_missing_locations(ast.Module(body=[func], type_ignores=[]))
    parallel = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True))
    # SGLang's accessors of the parallel groups: get_parallel() in newer releases, get_pp_group() in older ones
    namespace = {"__builtins__": builtins, "get_parallel": lambda: parallel, "get_pp_group": lambda: parallel.pp_group}
    exec(compile(module, f"<{owner.module}.{owner.name}.{METHOD}>", "exec"), namespace)
    return namespace[func.name]


class _Self:
    """`self` of the class under probe: its config's layer count, the last pipeline rank, its sub-models."""

    def __init__(self, num_layers: int, result: dict, sub):
        text = SimpleNamespace(num_hidden_layers=num_layers)
        object.__setattr__(self, "_result", result)
        object.__setattr__(self, "_sub", sub)
        object.__setattr__(self, "config", SimpleNamespace(num_hidden_layers=num_layers, text_config=text))
        object.__setattr__(self, "pp_group", SimpleNamespace(is_last_rank=True))
        # two more than N: room for a probe's capture past the last layer (the rule is read, not SGLang's range check)
        object.__setattr__(self, "layers", [SimpleNamespace() for _ in range(num_layers + 2)])

    def __getattr__(self, name):
        if name.startswith("__") or self._sub is None:
            raise AttributeError(f"self.{name}: the probe has config, pp_group, layers and its __init__'s sub-models")
        value = self._sub(name)
        object.__setattr__(self, name, value)
        return value

    def __setattr__(self, name, value):
        if name == "layers_to_capture":
            self._result["layers"] = list(value)
        object.__setattr__(self, name, value)


class _SubModel(_Self):
    """A sub-model the class builds in __init__ (self.model, self.language_model): it records layers_to_capture,
    and its own set_eagle3_layers_to_capture runs the rule of the class built there."""

    def __init__(self, release, cls, attr: str, num_layers: int, result: dict, depth: int):
        super().__init__(num_layers, result, None)
        object.__setattr__(self, "_inner", (release, cls, attr, depth))

    def __getattr__(self, name):
        release, cls, attr, depth = self._inner
        if name != METHOD:
            return super().__getattr__(name)
        if cls is None:
            raise Unresolved(f"self.{attr} is built by an expression eyas cannot follow, and its {METHOD} is called")
        if isinstance(cls, str) or method(cls, METHOD) is None:
            raise AttributeError(f"{cls} has no {METHOD}")
        if depth > 5:
            raise Unresolved(f"{cls.name}: sub-models nest deeper than 5")

        def delegate(ids):
            self._result["layers"] = captured(release, cls, ids, self.config.num_hidden_layers, depth + 1)

        return delegate


def rule_of(release: Release, cls: ClassDef | str | Unresolved) -> str:
    """The name of the RULES entry `cls` follows on every probe; "none" without the method; "unresolved: why"."""
    try:
        if isinstance(cls, Unresolved):
            raise cls
        if isinstance(cls, str) or method(cls, METHOD) is None:
            return "none"
        runs = [(ids, n, captured(release, cls, list(ids), n)) for n in PROBE_LAYERS for ids in probes(n)]
    except Unresolved as err:
        return f"unresolved: {err}"
    for name, rule in RULES.items():
        if all(got == rule(list(ids), n) for ids, n, got in runs):
            return name
    ids, n, got = next((ids, n, got) for ids, n, got in runs if got != RULES["plus_one"](list(ids), n))
    return f"unresolved: ids {list(ids)} at {n} layers capture {got}, which no rule of RULES gives"


def kit_wheels() -> dict[str, tuple[Path, str]]:
    """version -> (wheel, sha256) for each `sglang==X --hash=sha256:H` of kits/sglang-wheels.txt, oldest first."""
    pins = {}
    for line in lock_file(KIT).read_text().splitlines():
        if line.startswith("sglang=="):
            requirement, _, digest = line.partition(" --hash=sha256:")
            pins[requirement.split("==")[1].strip()] = digest.strip()
    wheels = {p.name.split("-")[1]: p for p in require_kit(KIT).glob("sglang-*.whl")}
    missing = sorted(set(pins) - set(wheels))
    if missing:
        raise SystemExit(f"kit {KIT}: no wheel for {missing}; run `python scripts/kits.py install {KIT}`")
    ordered = sorted(pins, key=lambda v: tuple(int(p) for p in v.split(".")))
    return {v: (wheels[v], pins[v]) for v in ordered}


def derive() -> dict[str, dict[str, str]]:
    """version -> {registered class name: rule}, for every release of the kit."""
    table = {}
    for version, (wheel, _) in kit_wheels().items():
        release = Release(wheel)
        table[version] = {name: rule_of(release, cls) for name, cls in sorted(release.entry_classes().items())}
    return table


def runs(table: dict[str, dict[str, str]]) -> dict[str, tuple[tuple[str, str | None], ...]]:
    """class -> ((first release, rule), ...): each rule from that release until the next entry; None = the release
    serves no class of that name."""
    versions = list(table)
    out = {}
    for name in sorted({n for rules in table.values() for n in rules}):
        changes, last = [], ...
        for version in versions:
            rule = table[version].get(name)
            if rule != last:
                changes.append((version, rule))
                last = rule
        out[name] = tuple(changes)
    return out


def render(table: dict[str, dict[str, str]]) -> str:
    """The text of eyas/sglang_layer_rules.py for `table`."""
    wheels = kit_wheels()

    def entry(version: str, rule: str | None) -> str:
        return f"({json.dumps(version)}, {json.dumps(rule) if rule is not None else 'None'})"

    rules = "".join(
        f"    {json.dumps(name)}: ({', '.join(entry(v, r) for v, r in changes)}{',' * (len(changes) == 1)}),\n"
        for name, changes in runs(table).items()
    )
    hashes = "".join(f"    {json.dumps(v)}: {json.dumps(h)},\n" for v, (_, h) in wheels.items())
    return (
        f'''"""SGLang's aux layer-id rule per target class and release: generated by scripts/sglang_layer_rules.py from the
wheels of kits/sglang-wheels.txt (do not edit: rerun the script; tests/test_layer_id_rules.py re-derives it).

RULES: config.json architecture (the class SGLang registers under that name) -> ((first release, rule), ...),
each rule holding from that release until the next entry; None: that release registers no class of that name.
Rules (the layers `set_eagle3_layers_to_capture(ids)` captures the inputs of): plus_one = each id + 1;
plus_one_if_first_is_1 = each id + 1 when the first id is 1, else the ids; plus_one_unless_last_is_n = the ids
when the largest is the layer count N, else each id + 1; none = the class has no such method (SGLang cannot
capture its aux states); "unresolved: why" = the method could not be followed from the source.
"""

RELEASES = ({", ".join(json.dumps(v) for v in wheels)})

WHEEL_SHA256 = {{
{hashes}}}

RULES = {{
{rules}}}
'''
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/sglang_layer_rules.py", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when eyas/sglang_layer_rules.py differs")
    args = ap.parse_args(argv)
    text = render(derive())
    if args.check:
        same = OUTPUT.is_file() and OUTPUT.read_text() == text
        print(f"{OUTPUT.relative_to(REPO)}: {'current' if same else 'differs from the kit; rerun the script'}")
        return 0 if same else 1
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The import structure, read from the source (every import statement, those inside functions included):
no import circle between modules, imports only downwards through the layers (the CLI over the flows over
the tasks over the library), and inside the library only from a lower rank of LIBRARY_RANKS. A change
that adds a circle or an upward import fails here with the offending imports named."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Top-level code, bottom up: a module may import its own layer or a lower one, never a higher one.
LAYERS = ("eyas", "tasks", "flows", "eyas_cli", "bench")
# The library's packages and shared modules, bottom up (the pipeline's order: every stage reads what the
# stages before it leave). An import goes to a lower rank, or stays inside its own package.
LIBRARY_RANKS = {
    "eyas.sglang_layer_rules": -1,  # data generated from SGLang's source (scripts/sglang_layer_rules.py)
    "eyas.config": 0,
    "eyas.checksum": 0,
    "eyas.fsio": 0,
    "eyas.layer_ids": 0,
    "eyas.markdown": 0,
    "eyas.draft_keys": 0,
    "eyas.attention": 0,
    "eyas.target_check": 0.5,  # the target's config.json against its weight headers, read by eyas.target
    "eyas.draft": 1,
    "eyas.target": 1,
    "eyas.engines": 1,
    "eyas.storage": 1,
    "eyas.dataset": 2,
    "eyas.objective": 2,
    "eyas.shards": 3,
    "eyas.facts": 3,
    "eyas.verify": 3.5,  # checks shards; a streamed extraction verifies each shard as it commits (eyas.extract.streamed)
    "eyas.extract": 4,
    "eyas.train": 4,
    "eyas.gate": 5,
    "eyas.export": 5,
    "eyas.run_inputs": 5.5,  # every stage's inputs checked before the first (reads the stages' own readers)
    "eyas.bench": 6,
    "eyas.status": 7,
}
NEVER = {"eyas": ("prefect", "tasks", "flows", "eyas_cli"), "tasks": ("flows", "eyas_cli"), "flows": ("eyas_cli",)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for layer in LAYERS for p in sorted((REPO / layer).rglob("*.py"))}


def imported(path: Path) -> list[tuple[str, int]]:
    """(module imported, line) of every import of `path`, except those only for type checking."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            skip |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return found


def edges() -> dict[str, set[str]]:
    """module -> the modules of this repo it imports (a `from package import name` counts the package, and the
    submodule when `name` is one)."""
    known = sources()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        for target, _ in imported(path):
            if target in known and target != mod:
                graph[mod].add(target)
    return graph


def rank(module: str) -> int | None:
    best = max((k for k in LIBRARY_RANKS if module == k or module.startswith(k + ".")), key=len, default=None)
    return None if best is None else LIBRARY_RANKS[best]


def package(module: str) -> str:
    return next(k for k in LIBRARY_RANKS if module == k or module.startswith(k + "."))


def test_every_library_module_has_a_rank():
    assert [m for m in sources() if m.startswith("eyas.") and rank(m) is None] == []


def test_no_import_circle():
    graph, state, circles = edges(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert circles == []


def test_layers_import_only_downwards():
    upward = []
    for mod, path in sources().items():
        layer = mod.split(".")[0]
        for target, line in imported(path):
            top = target.split(".")[0]
            if top in LAYERS and LAYERS.index(top) > LAYERS.index(layer):
                upward.append(f"{path.relative_to(REPO)}:{line} imports {target}")
            if top in NEVER.get(layer, ()):
                upward.append(f"{path.relative_to(REPO)}:{line} imports {target}, which {layer}/ never imports")
    assert sorted(set(upward)) == []


def test_library_imports_go_to_a_lower_rank_or_stay_in_their_package():
    wrong = []
    for mod, path in sources().items():
        if not mod.startswith("eyas."):
            continue
        for target, line in imported(path):
            if not target.startswith("eyas.") or rank(target) is None or package(target) == package(mod):
                continue
            if rank(target) >= rank(mod):
                wrong.append(
                    f"{path.relative_to(REPO)}:{line} ({package(mod)}, rank {rank(mod)}) imports {target} "
                    f"(rank {rank(target)})"
                )
    assert sorted(set(wrong)) == []

"""The package's layers (docs/architecture.md, "Layers"): every module-level import of an
eaglejax module points to the importer's layer or one below, and neither the modules nor
the packages (sub-packages and top-level modules as nodes) import each other in a cycle."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "eaglejax"
# bottom to top; a node is a sub-package or a top-level module of eaglejax
LAYERS = [
    ("foundations", {"errors", "validation", "config", "version", "hardware",
                     "compilation_cache", "datasets", "fingerprints"}),
    ("model", {"sharding", "native", "models"}),
    ("files", {"tokenizer", "target", "loading"}),
    ("draft heads", {"draft"}),
    ("loops", {"decoding"}),
    ("using the loops", {"prompting", "timing", "round_split", "generate", "bench",
                         "programs", "serving"}),
    ("users", {"training", "cli"}),
]
LAYER_OF = {node: i for i, (_, nodes) in enumerate(LAYERS) for node in nodes}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The eaglejax modules a file imports at module level (`from eaglejax.x import name`
    counts eaglejax.x.name when that is a module, else eaglejax.x)."""
    found = set()
    for statement in ast.parse(path.read_text()).body:
        if isinstance(statement, ast.Import):
            found |= {alias.name for alias in statement.names}
        elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
            for alias in statement.names:
                sub = f"{statement.module}.{alias.name}"
                found.add(sub if sub in MODULES else statement.module)
    return {name for name in found if name in MODULES}


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _node(module: str) -> str:
    return module.split(".")[1]


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_node_has_a_layer():
    nodes = {_node(m) for m in MODULES if m != "eaglejax"}
    assert nodes == set(LAYER_OF), nodes ^ set(LAYER_OF)


def test_imports_point_down_the_layers_or_within_one():
    upward = [f"{m} -> {i}" for m, imported in GRAPH.items() if m != "eaglejax"
              for i in imported
              if i == "eaglejax" or LAYER_OF[_node(i)] > LAYER_OF[_node(m)]]
    assert not upward, upward


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_cycle(level):
    if level == "module":
        edges = {m: {i for i in imported if i != "eaglejax"} for m, imported in GRAPH.items()}
    else:
        edges: dict[str, set[str]] = {}
        for m, imported in GRAPH.items():
            if m != "eaglejax":
                edges.setdefault(_node(m), set()).update(
                    _node(i) for i in imported if i != "eaglejax" and _node(i) != _node(m))
    assert _cycle(edges) is None, _cycle(edges)


def test_the_checks_see_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None

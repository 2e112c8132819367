"""verifypd.model has no import cycles, counting imports inside functions too (a lazy import that
closes a circle hides an ordering dependency: issue 22 item 6 removed runner <-> graph_runner <->
draft_loop)."""
from __future__ import annotations

import ast
import pathlib

import verifypd.model

PACKAGE = "verifypd.model"


def model_imports() -> dict[str, set[str]]:
    """module -> the verifypd.model modules it imports anywhere in its body (short names)."""
    root = pathlib.Path(verifypd.model.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        name = path.stem
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == PACKAGE:  # from verifypd.model import sampler
                    edges.update(alias.name for alias in node.names)
                elif node.module.startswith(PACKAGE + "."):
                    edges.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
            elif isinstance(node, ast.Import):
                edges.update(a.name.removeprefix(PACKAGE + ".").split(".")[0] for a in node.names
                             if a.name.startswith(PACKAGE + "."))
        edges.discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_model_package_has_no_import_cycle():
    cycle = find_cycle(model_imports())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]

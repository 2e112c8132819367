"""verifypd has no import cycles, counting imports inside functions too (a lazy import that closes a
circle hides an ordering dependency: issue 22 item 6 removed runner <-> graph_runner <-> draft_loop;
the restructuring's cli_flags broke verifypd/cli <-> server/cli).

Edges (module -> module, full dotted names, every .py under services/verifypd):
    import a.b.c / from a.b.c import X      -> a.b.c (a package: its __init__ only)
    from a.b import c (c a module of a.b)   -> a.b (its __init__) and a.b.c
    relative imports resolve against the importing module's package.
Parent packages' __init__s, which Python also runs, are left out: they would make every package that
imports its own modules look circular, and ours import nothing heavy."""

from __future__ import annotations

import ast
import pathlib

import verifypd

ROOT = pathlib.Path(verifypd.__file__).parent


def module_names() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of verifypd (a package named by its __init__)."""
    names = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("verifypd",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (relative levels against the importer's package)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the verifypd modules it imports anywhere in its body."""
    modules = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node, name, is_package)
                if target in modules:
                    edges.add(target)
                edges.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules)
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
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_verifypd_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "verifypd.model.build" in graph["verifypd.engine"]  # the walk sees modules
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_edges_cover_lazy_relative_and_package_imports(tmp_path, monkeypatch):
    """The rules of the module docstring, on a throwaway package."""
    pkg = tmp_path / "verifypd"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from verifypd.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\nimport verifypd.a\n")
    (pkg / "sub" / "c.py").write_text("from ..a import f\nfrom verifypd.sub.b import X\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    graph = import_graph()
    assert graph["verifypd.a"] == {"verifypd.sub", "verifypd.sub.b"}
    assert graph["verifypd.sub.b"] == {"verifypd.sub", "verifypd.sub.c", "verifypd.a"}
    assert graph["verifypd.sub.c"] == {"verifypd.a", "verifypd.sub.b"}
    assert find_cycle(graph) == ["verifypd.a", "verifypd.sub.b", "verifypd.a"]


def test_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]

"""Import layers of the product: no import cycle between files, and every import goes down a layer.

Three packages: `verifypd` (services/verifypd), `verifypd_operator` (operator/verifypd_operator) and
`verifypd_loadgen` (loadgen/verifypd_loadgen), read from this checkout (not from what is installed).

Edges (module -> module, full dotted names, every .py of the three packages), from imports anywhere
in a file: at the top, inside functions (a lazy import that closes a circle only hides an ordering
dependency), under `if TYPE_CHECKING:`:
    import a.b.c / from a.b.c import X      -> a.b.c (a package: its __init__)
    from a.b import c (c a module of a.b)   -> a.b (when it has an __init__) and a.b.c
    relative imports resolve against the importing module's package.
Parent packages' __init__s, which Python also runs, are left out: they would make every package that
imports its own modules look circular, and ours import nothing heavy.

Rules:
1. No file-level import cycle, in or across the three packages.
2. verifypd's package layers (VERIFYPD_ROOMS): every module lives in a room, its first sub-package or,
   for a top-level module, the module's name (`verifypd/__init__.py` is the room `__init__`); a module
   may import its own room, the rooms its room lists, and the package `verifypd` itself (which Python
   runs first anyway). A room missing from the table fails: a new room is placed deliberately.
3. Between the packages (PACKAGE_IMPORTS): the operator and loadgen use only verifypd's public part
   (the protocol, its domain types, networking) and never each other; verifypd imports neither.

The checker is plain functions of a {package: root} map and a table, so the planted-violation tests at
the bottom run the same code on throwaway trees.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import pathlib
from collections.abc import Mapping, Set

REPO = pathlib.Path(__file__).parents[2]
ROOTS = {
    "verifypd": REPO / "services" / "verifypd",
    "verifypd_operator": REPO / "operator" / "verifypd_operator",
    "verifypd_loadgen": REPO / "loadgen" / "verifypd_loadgen",
}

ANY = frozenset({"*"})  # a room that may import every room

# verifypd's target layering (room -> the rooms it may import besides itself), lowest first.
VERIFYPD_ROOMS: dict[str, frozenset[str]] = {
    "__init__": frozenset(),  # verifypd/__init__.py: imports nothing
    "v1": frozenset(),  # the generated protocol
    "domain": frozenset({"v1", "heads"}),  # heads: a shipped head by name (`--draft eagle:smollm2`)
    "net": frozenset({"v1", "domain"}),  # auth, TLS, health, lane TLS
    "router": frozenset({"domain"}),  # torch-free bookkeeping: scheduler, sequences, blocks, k policy, step strategies
    "model": frozenset({"domain"}),  # the torch/Triton leaf
    "heads": frozenset(),  # the shipped draft-head files
    "spec_decode": frozenset({"domain", "model", "heads"}),  # proposers
    "lanes": frozenset(
        {"v1", "domain", "net", "model", "spec_decode", "heads"}
    ),  # in-process lanes, lanes.rpc, TP ranks
    # the engine-core process, its client, the assembly of stacks
    "core": frozenset({"v1", "domain", "net", "router", "model", "spec_decode", "lanes", "heads"}),
    # the in-process engine (engine.py)
    "engine": frozenset({"v1", "domain", "net", "router", "model", "spec_decode", "lanes", "heads", "core"}),
    "gateway": frozenset({"v1", "domain", "net", "core"}),  # never model, lanes, router
    "distill": frozenset({"v1", "domain", "router", "model", "spec_decode", "lanes", "core", "engine", "heads"}),
    "launch": ANY,
    "cli": ANY,
    "cli_flags": ANY,
}

# What the operator and loadgen may import from verifypd (fnmatch patterns of module names).
PUBLIC_VERIFYPD = (
    "verifypd",  # the package (its __init__ imports nothing)
    "verifypd.v1",
    "verifypd.v1.*",
    "verifypd.domain",
    "verifypd.domain.*",
    "verifypd.net",
    "verifypd.net.*",
)
# package -> what it may import of the other two packages
PACKAGE_IMPORTS: dict[str, tuple[str, ...]] = {
    "verifypd": (),
    "verifypd_operator": PUBLIC_VERIFYPD,
    "verifypd_loadgen": PUBLIC_VERIFYPD,
}


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: pathlib.Path  # the importer's file
    line: int  # of the first import of `imported` in that file

    def where(self) -> str:
        try:
            shown = self.path.relative_to(REPO)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}"


def module_files(roots: Mapping[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the packages (a package named by its __init__)."""
    names = {}
    for package, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = (package,) + path.relative_to(root).with_suffix("").parts
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


def import_edges(roots: Mapping[str, pathlib.Path]) -> list[Import]:
    """Every import between modules of the packages, once per (importer, imported) pair."""
    modules = module_files(roots)
    edges: dict[tuple[str, str], Import] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name, is_package)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                key = (name, target)
                if target in modules and target != name and key not in edges:
                    edges[key] = Import(name, target, path, node.lineno)
    return sorted(edges.values(), key=lambda e: (e.importer, e.line, e.imported))


def import_graph(edges: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    return graph


def find_cycle(graph: Mapping[str, Set[str]]) -> list[str] | None:
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


def room_of(module: str) -> str:
    """`pkg.x.y...` -> x; the package itself -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def table_errors(table: Mapping[str, Set[str]]) -> list[str]:
    """Rooms a table lets some room import but does not list itself."""
    return [
        f"room {room!r} may import {other!r}, which is not a room of the table"
        for room, allowed in sorted(table.items())
        for other in sorted(allowed - ANY)
        if other not in table
    ]


def layer_violations(roots: Mapping[str, pathlib.Path], package: str, table: Mapping[str, Set[str]]) -> list[str]:
    """Modules of `package` in a room the table lacks, and imports inside `package` that its table
    does not allow (one line each, naming the module, the import and where it is)."""
    problems = [
        f"{module}: room {room_of(module)!r} is not in the layer table ({files.relative_to(roots[package].parent)})"
        for module, files in module_files({package: roots[package]}).items()
        if room_of(module) not in table
    ]
    for e in import_edges({package: roots[package]}):
        room, other = room_of(e.importer), room_of(e.imported)
        if e.imported == package or room == other or room not in table:
            continue
        allowed = table[room]
        if ANY <= allowed or other in allowed:
            continue
        may = ", ".join(sorted(allowed)) or "nothing"
        problems.append(f"{e.importer} imports {e.imported} ({e.where()}): {room} -> {other}; {room} may import {may}")
    return problems


def package_violations(roots: Mapping[str, pathlib.Path], rules: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Imports from one package into another that `rules` (package -> allowed patterns) does not allow."""
    problems = []
    for e in import_edges(roots):
        mine, theirs = e.importer.split(".")[0], e.imported.split(".")[0]
        if mine == theirs:
            continue
        allowed = rules.get(mine, ())
        if not any(fnmatch.fnmatchcase(e.imported, pattern) for pattern in allowed):
            problems.append(f"{e.importer} imports {e.imported} ({e.where()}): {mine} may not import it")
    return problems


# -- the product ---------------------------------------------------------------------------------


def test_the_walk_sees_the_packages():
    modules = module_files(ROOTS)
    for package in ROOTS:
        assert sum(m.split(".")[0] == package for m in modules) > 10, package
    graph = import_graph(import_edges(ROOTS))
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300
    assert "verifypd.core.assembly" in graph["verifypd.engine"]
    assert "verifypd_operator.pod_parts" in graph["verifypd_operator.builders"]  # a relative import
    assert "verifypd.v1.generate_pb2" in graph["verifypd_loadgen.runner"]  # from a.b import module


def test_no_import_cycle():
    cycle = find_cycle(import_graph(import_edges(ROOTS)))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layer_table_names_only_its_rooms():
    assert table_errors(VERIFYPD_ROOMS) == []


def test_verifypd_layers():
    problems = layer_violations(ROOTS, "verifypd", VERIFYPD_ROOMS)
    assert not problems, f"{len(problems)} layer violations:\n" + "\n".join(problems)


def test_packages_import_only_what_they_may_of_each_other():
    problems = package_violations(ROOTS, PACKAGE_IMPORTS)
    assert not problems, "\n".join(problems)


# -- the checker, on planted trees -----------------------------------------------------------------


def _tree(root: pathlib.Path, files: Mapping[str, str]) -> pathlib.Path:
    """Writes `files` (path relative to root -> source) with an __init__.py in every directory."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return root


def test_edges_cover_lazy_relative_and_package_imports(tmp_path):
    pkg = _tree(
        tmp_path / "verifypd",
        {
            "a.py": "def f():\n    from verifypd.sub import b\n",
            "sub/b.py": "from . import c\nimport verifypd.a\n",
            "sub/c.py": "from ..a import f\nfrom verifypd.sub.b import X\nif False:\n    import verifypd.sub\n",
        },
    )
    graph = import_graph(import_edges({"verifypd": pkg}))
    assert graph["verifypd.a"] == {"verifypd.sub", "verifypd.sub.b"}
    assert graph["verifypd.sub.b"] == {"verifypd.sub", "verifypd.sub.c", "verifypd.a"}
    assert graph["verifypd.sub.c"] == {"verifypd.a", "verifypd.sub.b", "verifypd.sub"}
    assert find_cycle(graph) == ["verifypd.a", "verifypd.sub.b", "verifypd.a"]


def test_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_a_planted_cycle_fails(tmp_path):
    pkg = _tree(
        tmp_path / "verifypd",
        {
            "router/scheduler.py": "from verifypd.router import sequence\n",
            "router/sequence.py": "def f():\n    from verifypd.router.blocks import B\n",
            "router/blocks.py": "from .scheduler import S\n",
        },
    )
    cycle = find_cycle(import_graph(import_edges({"verifypd": pkg})))
    assert cycle == [
        "verifypd.router.blocks",
        "verifypd.router.scheduler",
        "verifypd.router.sequence",
        "verifypd.router.blocks",
    ]


def test_a_function_level_import_of_a_higher_room_fails(tmp_path):
    pkg = _tree(
        tmp_path / "verifypd",
        {
            "domain/types.py": "import verifypd.v1.generate_pb2\n\n\n"
            "def f():\n    from verifypd.gateway import server\n",
            "v1/generate_pb2.py": "",
            "gateway/server.py": "from verifypd.domain import types\nfrom verifypd import domain\n",
        },
    )
    problems = layer_violations({"verifypd": pkg}, "verifypd", VERIFYPD_ROOMS)
    assert len(problems) == 2, problems  # domain -> gateway, as the package and as the module
    assert all(p.startswith("verifypd.domain.types imports verifypd.gateway") for p in problems)
    assert (
        "verifypd/domain/types.py:5" in problems[0] and "domain -> gateway; domain may import heads, v1" in problems[0]
    )


def test_a_relative_import_of_a_higher_room_fails(tmp_path):
    pkg = _tree(
        tmp_path / "verifypd",
        {
            "router/scheduler.py": "from ..gateway.http_api import App\nfrom . import sequence\n",
            "router/sequence.py": "from ..domain import types\n",
            "domain/types.py": "",
            "gateway/http_api.py": "from ..core import client\n",
            "core/client.py": "",
        },
    )
    problems = layer_violations({"verifypd": pkg}, "verifypd", VERIFYPD_ROOMS)
    assert len(problems) == 1, problems
    assert problems[0].startswith("verifypd.router.scheduler imports verifypd.gateway.http_api (")
    assert "router -> gateway; router may import domain" in problems[0]


def test_an_unknown_room_fails(tmp_path):
    pkg = _tree(
        tmp_path / "verifypd",
        {"plugins/extra.py": "from verifypd.domain import types\n", "domain/types.py": "", "tokenizer.py": ""},
    )
    problems = layer_violations({"verifypd": pkg}, "verifypd", VERIFYPD_ROOMS)
    assert [p.split(":")[0] for p in problems] == ["verifypd.plugins", "verifypd.plugins.extra", "verifypd.tokenizer"]
    assert all("is not in the layer table" in p for p in problems)
    assert table_errors({"a": frozenset({"b"}), "c": ANY}) == [
        "room 'a' may import 'b', which is not a room of the table"
    ]


def test_the_package_itself_and_everything_rooms_pass(tmp_path):
    pkg = _tree(
        tmp_path / "verifypd",
        {
            "domain/types.py": "import verifypd\nfrom verifypd import __version__\n",
            "cli.py": "from verifypd.gateway import server\nfrom verifypd.model import runner\n",
            "gateway/server.py": "from verifypd.core import client\n",
            "core/client.py": "from verifypd.model import runner\n",
            "model/runner.py": "",
        },
    )
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    assert layer_violations({"verifypd": pkg}, "verifypd", VERIFYPD_ROOMS) == []
    (pkg / "__init__.py").write_text("from verifypd.domain import types\n")
    assert layer_violations({"verifypd": pkg}, "verifypd", VERIFYPD_ROOMS) == [
        f"verifypd imports verifypd.domain ({pkg / '__init__.py'}:1): __init__ -> domain; __init__ may import nothing",
        f"verifypd imports verifypd.domain.types ({pkg / '__init__.py'}:1): __init__ -> domain; "
        "__init__ may import nothing",
    ]


def test_imports_between_the_packages_are_checked(tmp_path):
    roots = {
        "verifypd": _tree(
            tmp_path / "services" / "verifypd",
            {"v1/generate_pb2.py": "", "model/runner.py": "", "net/tls.py": "", "gateway/server.py": ""},
        ),
        "verifypd_operator": _tree(
            tmp_path / "operator" / "verifypd_operator",
            {
                "ok.py": "from verifypd.v1 import generate_pb2\nfrom verifypd.net import tls\nimport verifypd\n",
                "bad.py": "def f():\n    from verifypd.model import runner\n",
            },
        ),
        "verifypd_loadgen": _tree(
            tmp_path / "loadgen" / "verifypd_loadgen",
            {"run.py": "from verifypd_operator import ok\n", "fine.py": "from .run import x\n"},
        ),
    }
    (roots["verifypd"] / "gateway" / "server.py").write_text("import verifypd_loadgen.fine\n")
    problems = package_violations(roots, PACKAGE_IMPORTS)
    assert [p.split(" (")[0] for p in problems] == [
        "verifypd.gateway.server imports verifypd_loadgen.fine",
        "verifypd_loadgen.run imports verifypd_operator",
        "verifypd_loadgen.run imports verifypd_operator.ok",
        "verifypd_operator.bad imports verifypd.model",
        "verifypd_operator.bad imports verifypd.model.runner",
    ]

"""No file of the product reaches another file's private members: no `from module import _name` of our
modules, and no `obj._name` where obj is not the file's own `self` or `cls` (a shared helper is public,
or it stays in its file). Namedtuple API (`_replace`, ...) and the standard library's `os._exit` /
`sys._getframe` are not private members of ours. Third-party private API used on purpose is listed in
THIRD_PARTY with its reason."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).parents[2]
ROOTS = [REPO / "services" / "verifypd", REPO / "operator" / "verifypd_operator", REPO / "loadgen" / "verifypd_loadgen"]
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe"}
LIBRARY_NAMES = {"torch", "sys", "os"}
# file (relative to the repo) -> attribute: torch's private storage API, the only way to get a CUDA IPC
# handle of a pool tensor as explicit fields (no pickle on the wire).
THIRD_PARTY = {("services/verifypd/lanes/rpc/cuda_ipc.py", "_share_cuda_")}


def private_reaches(path: pathlib.Path, repo: pathlib.Path) -> list[str]:
    rel = path.relative_to(repo).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in PUBLIC_UNDERSCORE:
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in LIBRARY_NAMES or (rel, name) in THIRD_PARTY:
                continue
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("verifypd")):
            found += [
                f"{rel}:{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


def test_no_file_reaches_another_files_private_members():
    files = [p for root in ROOTS for p in sorted(root.rglob("*.py")) if "v1" not in p.relative_to(root).parts]
    assert len(files) > 150
    hits = [hit for path in files for hit in private_reaches(path, REPO)]
    assert hits == [], "\n".join(hits)


def test_the_check_sees_a_planted_reach(tmp_path):
    (tmp_path / "a.py").write_text(
        "from verifypd.router.scheduler import _plan\nfrom .b import _x\n\n\ndef f(other, self):\n"
        "    self._ok = other._not_ok\n    torch._C\n    return point._replace(x=1)\n"
    )
    hits = private_reaches(tmp_path / "a.py", tmp_path)
    assert hits == [
        "a.py:1: from verifypd.router.scheduler import _plan",
        "a.py:2: from b import _x",
        "a.py:6: other._not_ok",
    ]

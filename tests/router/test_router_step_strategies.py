"""Router.step dispatches to one step strategy per step (verifypd.router.steps, docs/engine.md "Step
strategies"); the strategies share the typed StepContext and reach nothing private of another file.
Torch-free: costed lanes (no model)."""

from __future__ import annotations

import ast
import pathlib

import pytest
from costed_lanes import CostedLanes

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec
from verifypd.router.router import Router

ROUTER = pathlib.Path(__file__).parents[2] / "services" / "verifypd" / "router"


def _run(config: RuntimeConfig, requests: int = 4) -> tuple[list[str], dict[str, list[int]]]:
    """Runs `requests` requests to the end; returns the strategy of each step (by class name) and
    each request's tokens."""
    lanes = CostedLanes(0.7)
    router = Router(lanes, lanes, lanes, decode=None, eos_token_ids=(), config=config, clock=lanes.clock)
    ran: list[str] = []
    pick = router._strategy

    def recording(ctx):
        strategy = pick(ctx)
        ran.append(type(strategy).__name__)
        return strategy

    router._strategy = recording
    tokens: dict[str, list[int]] = {}
    for i in range(requests):
        rid = router.add_request(RequestSpec(tuple(range(3, 20 + i)), max_tokens=12 + i, stop_at_eos=False))
        tokens[rid] = []
    while router.has_work():
        for out in router.step():
            tokens[out.request_id] += out.token_ids
    router.close()
    return ran, tokens


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"schedule": "baseline"}, {"Baseline"}),
        ({"schedule": "pd"}, {"LockStep"}),
        ({"schedule": "pdv", "pipeline": False}, {"LockStep"}),
        ({"schedule": "pdv", "pipeline": True}, {"LockStep", "Pipelined"}),  # lock-step while one decodes
    ],
)
def test_each_schedule_runs_its_strategy(changes, expected):
    ran, tokens = _run(RuntimeConfig(k_initial=3, adaptive=False, **changes))
    assert set(ran) == expected, ran
    assert all(len(t) == 12 + i for i, t in enumerate(tokens.values()))


def test_a_plain_pdv_step_with_no_group_drafting_ahead_is_lock_step():
    ran, _ = _run(RuntimeConfig(schedule="pdv", pipeline=True, k_initial=0, k_min=0, adaptive=False))
    assert set(ran) == {"LockStep"}


def _private_reaches(path: pathlib.Path) -> list[str]:
    """`obj._name` where obj is not self or cls, and `from module import _name`, in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom):
            found += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_router_files_reach_no_private_member_of_another_file():
    files = sorted(ROUTER.rglob("*.py"))
    assert len(files) > 10 and any(f.parent.name == "steps" for f in files)
    assert [hit for f in files for hit in _private_reaches(f)] == []


def test_strategies_hold_no_router():
    """A strategy gets the step context in `step`; none is built with, or keeps, the Router."""
    for path in sorted((ROUTER / "steps").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert "router" not in names and "Router" not in names, path.name

"""Schedules (RuntimeConfig.schedule): baseline | pd | pdv are router policies over the same lanes.
Each must stay lossless; baseline never batches across requests; pd is lock-step; pdv pipelined
alternates two groups, one drafting while the other verifies the drafts it made the step before."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from engine_cases import SCHEDULES, Recorder, drive, specs
from engine_helpers import make_engine

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.lanes import LaneError
from verifypd.domain.requests import InvalidRequest

pytestmark = pytest.mark.slow  # every schedule decoded through the engine, request by request (tests/README.md)


@pytest.fixture(scope="module")
def plain(tiny_models):
    engine = make_engine(*tiny_models, k=0)
    done = engine.generate(specs())
    return {rid: c.token_ids for rid, c in done.items()}


@pytest.mark.parametrize("schedule, pipeline", SCHEDULES)
def test_greedy_equals_plain_decoding(tiny_models, plain, schedule, pipeline):
    engine = make_engine(*tiny_models, k=4)
    tokens, rec = drive(engine, specs(), schedule, pipeline, cancel="r3")
    assert {r: t for r, t in tokens.items() if r != "r3"} == {r: t for r, t in plain.items() if r != "r3"}
    assert tokens["r3"] == plain["r3"][: len(tokens["r3"])] and len(tokens["r3"]) < 26  # cancelled mid-way
    verified = [k for c in rec.calls if c[1] == "verify" for _, k in c[2]]
    assert any(k > 0 for k in verified)
    if schedule == "pdv" and pipeline:
        assert any(rec.plans.values())  # the test did exercise pipelined steps


def test_greedy_lossless_with_adaptive_k(tiny_models, plain):
    engine = make_engine(*tiny_models, k=4, adaptive=True)
    tokens, _ = drive(engine, specs(), "pdv")
    assert tokens == plain
    engine = make_engine(*tiny_models, k=4, adaptive=True)
    tokens, _ = drive(engine, specs(), "baseline")
    assert tokens == plain


def test_baseline_never_batches_across_requests(tiny_models):
    engine = make_engine(*tiny_models, k=3)
    _, rec = drive(engine, specs(), "baseline")
    assert rec.calls and all(len(c[2]) == 1 for c in rec.calls)
    # One request per step (its prefill chunk or its draft + verify), never two.
    for step in {c[0] for c in rec.calls}:
        assert len({rid for c in rec.calls if c[0] == step for rid, _ in c[2]}) == 1
    # Interleaved: requests run concurrently (round-robin), not one after another to completion.
    order = [c[2][0][0] for c in rec.calls if c[1] == "verify"]
    first_done = max(i for i, r in enumerate(order) if r == "r1")
    assert len(set(order[:first_done])) >= 3


def test_pdv_groups_alternate(tiny_models):
    engine = make_engine(*tiny_models, k=3)
    _, rec = drive(engine, specs(), "pdv")
    pipelined = sorted(s for s, p in rec.plans.items() if p)
    overlapped = 0
    assert len(pipelined) >= 8
    main = threading.get_ident()
    for t in pipelined:
        drafts, verifies = rec.of("draft", t), rec.of("verify", t)
        d_ids, v_ids = {r for r, _ in drafts}, {r for r, _ in verifies}
        assert not d_ids & v_ids, f"step {t}: a request drafts and verifies in one pipelined step"
        for rid, k in drafts:
            # ... and verifies exactly those drafts in the next step (its drafts were held)
            assert (rid, k) in rec.of("verify", t + 1), f"{rid} drafted at step {t}, not verified at {t + 1}"
            assert rid not in {r for r, _ in rec.of("draft", t + 1)}  # groups swap roles
        if drafts and verifies:
            d = [c for c in rec.calls if c[0] == t and c[1] == "draft"][0]
            v = [c for c in rec.calls if c[0] == t and c[1] == "verify"][0]
            assert d[3] != main and v[3] == main  # the draft call ran on the router's worker thread
            overlapped += d[4] < v[5] and v[4] < d[5]
    assert overlapped >= 1  # the two calls did run at the same time
    # Pipelined steps are costed as such (their wall time), apart from lock-step steps.
    assert engine.router.costs._pipe and all(k > 0 for _, k in engine.router.costs._pipe)
    # Both groups make progress: between its prefill and its last call, a request sits out a
    # pipelined step only when it joins or is moved to the other group (once or twice).
    for rid in {r for c in rec.calls for r, _ in c[2]}:
        steps = sorted({c[0] for c in rec.calls if rid in {r for r, _ in c[2]}})
        idle = [t for t in pipelined if steps[0] < t < steps[-1] and t not in steps]
        assert len(idle) <= 2, f"{rid} sat out pipelined steps {idle}"


def test_switching_between_pipelined_and_lock_step_stays_lossless(tiny_models, plain, monkeypatch):
    """pdv chooses pipelining step by step (measured costs); every switch must keep tokens exact, and a
    verify call must never mix the proposals of two draft calls (the split topology hands one draft
    call's proposals over in one device slot: a mixed call fails there)."""
    import itertools

    from verifypd.lanes.device_values import DeviceDraftTokens
    from verifypd.router import k_decision as k_decision_module

    choices = itertools.cycle([True, True, False, True, False, False, True])
    monkeypatch.setattr(k_decision_module, "pipelining_pays", lambda *args: next(choices))
    engine = make_engine(*tiny_models, k=3)
    verify_lane = engine.router.verify_lane
    sources: list[set] = []

    def verify(items):
        sources.append({id(i.draft_tokens.batch) for i in items if isinstance(i.draft_tokens, DeviceDraftTokens)})
        return type(verify_lane).verify(verify_lane, items)

    verify_lane.verify = verify
    tokens, rec = drive(engine, specs(), "pdv")
    assert tokens == plain
    plans = list(rec.plans.values())
    assert any(plans) and not all(plans)  # both kinds of step ran, interleaved
    assert sources and all(len(s) <= 1 for s in sources), [len(s) for s in sources]
    assert sum(len(s) == 1 for s in sources) >= 8  # device drafts were verified (the check had material)


@pytest.mark.parametrize("schedule", ["pd", "pdv"])
def test_step_costs_are_whole_steps_without_prefill(tiny_models, schedule):
    """Costs that decide k and pipelining are whole steps: the host work of committing tokens counts
    (a pipelined step pays it per half batch), a prefill run before or after decode does not."""
    # Overlap off: with it a regular plain step is costed by its verify call (the host work a chain
    # hides; tests/router/test_router_overlap.py), and this test is about whole steps.
    engine = make_engine(*tiny_models, k=3)
    router = engine.router
    router.config = router.config.updated(overlap=False)
    offset = [0.0]  # a clock that also advances by simulated host work
    ctx = router.context
    ctx.clock = lambda: time.monotonic() + offset[0]
    commit, call_prefill = ctx.commit_verdicts, ctx.call_prefill

    def slow_commit(*args):
        offset[0] += 1.0
        return commit(*args)

    def slow_prefill(items):
        offset[0] += 50.0
        return call_prefill(items)

    ctx.commit_verdicts, ctx.call_prefill = slow_commit, slow_prefill
    drive(engine, specs(), schedule)
    costs = router.costs
    samples = list(costs._step.values()) + list(costs._pipe.values())
    assert costs._step and (schedule == "pd" or costs._pipe)
    assert all(1.0 <= s < 50.0 for s in samples), samples


def test_pd_is_lock_step(tiny_models):
    engine = make_engine(*tiny_models, k=3)
    _, rec = drive(engine, specs(), "pd")
    steps = {c[0] for c in rec.calls if c[1] == "verify"}
    assert not any(rec.plans.values())
    for t in steps:
        drafts = rec.of("draft", t)
        assert {r for r, _ in drafts} == {r for r, k in rec.of("verify", t) if k > 0}
        assert set(drafts) <= set(rec.of("verify", t))


def test_seeded_sampling_identical_across_schedules(tiny_models):
    outputs = {}
    for schedule, pipeline in SCHEDULES:
        engine = make_engine(*tiny_models, k=3)
        outputs[schedule, pipeline], _ = drive(engine, specs(sampling=True), schedule, pipeline)
    first = outputs["pd", True]
    assert all(len(t) > 0 for t in first.values())
    for key, toks in outputs.items():
        assert toks == first, key


def test_lane_error_in_a_pipelined_step_propagates_with_committed_outputs(tiny_models):
    engine = make_engine(*tiny_models, k=3)
    router = engine.router
    router.config = router.config.updated(pipeline=True)
    rec = Recorder(router)
    for s in specs()[:4]:
        router.add_request(s)
    while not any(rec.plans.values()):
        rec.step += 1
        router.step()
    router.draft_lane.fail_at = rec.step + 2  # the draft call of a pipelined step fails
    rec.step += 1
    router.step()
    rec.step += 1
    with pytest.raises(LaneError) as info:
        router.step()
    # the concurrent verify call succeeded: its tokens are committed and handed over with the error
    assert info.value.outputs and all(len(o.token_ids) >= 1 for o in info.value.outputs)
    assert {o.request_id for o in info.value.outputs} == {r for r, _ in rec.of("verify", rec.step)}
    router.close()


def test_schedule_validation_and_cli():
    with pytest.raises(InvalidRequest, match="schedule must be one of baseline, pd, pdv"):
        RuntimeConfig(schedule="fast").validate()
    assert RuntimeConfig().schedule == "pdv" and not RuntimeConfig().pipelined  # overlap: opt-in (CLI: split)
    assert RuntimeConfig(pipeline=True).pipelined
    assert not RuntimeConfig(schedule="pd").pipelined and not RuntimeConfig(pipeline=False).pipelined
    from verifypd.cli import build_parser, schedule_changes
    from verifypd.launch.serve_args import engine_options

    args = build_parser().parse_args(["generate", "--offline", "--schedule", "baseline", "hi"])
    assert schedule_changes(args) == {
        "schedule": "baseline",
        "pipeline": False,
        "overlap": True,
        "admit_ahead": False,
    }  # auto, one process
    args = build_parser().parse_args(["serve", "--schedule", "pdv", "--topology", "split"])
    assert engine_options(args).config.pipelined  # auto: lane processes
    args = build_parser().parse_args(["serve", "--topology", "split", "--draft", "none"])
    assert not engine_options(args).config.pipelined  # auto: no draft call to overlap
    args = build_parser().parse_args(["serve", "--pipeline", "off", "--topology", "split"])
    assert not engine_options(args).config.pipelined
    args = build_parser().parse_args(["serve", "--pipeline", "on"])
    assert engine_options(args).config.pipelined
    args = build_parser().parse_args(["serve", "--schedule", "baseline"])
    assert engine_options(args).config.schedule == "baseline"
    for argv in (["generate", "--offline", "--schedule", "fast", "hi"], ["serve", "--schedule", "fast"]):
        r = subprocess.run([sys.executable, "-m", "verifypd.cli", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "--schedule: invalid choice: 'fast'" in r.stderr and "baseline" in r.stderr

"""Prefill beside decode: with lanes whose calls start asynchronously (in-process CUDA lanes), a
lock-step step queues its verify call, launches the step's prefill call behind it, and only then
waits for the verify results. Here the CPU lanes are made to report `starts_async` so the router
takes that path: tokens must not change, the order of starts and results must be the overlapped
one, and a step whose verify finished before the prefill launch ended must teach the cost model
nothing (its wall time holds the prefill's launch)."""

from __future__ import annotations

import pytest
from engine_cases import specs
from engine_helpers import DEVICE, make_engine

from verifypd.lanes.local import LocalPrefillLane
from verifypd.lanes.local_verify import LocalVerifyLane

pytestmark = pytest.mark.slow  # whole engine runs per schedule and overlap setting (tests/README.md)


class _Logged:
    def __init__(self, started, log):
        self._started, self._log = started, log

    def ready(self):
        return self._started.ready()

    def result(self):
        self._log.append("verify_result")
        return self._started.result()


def run(engine, overlap: bool):
    """Requests join two per step; returns (tokens by request, event log, steps that sampled a cost
    after launching a prefill beside their verify call)."""
    router = engine.router
    router.overlap_prefill = overlap
    log: list[str] = []
    verify_start, prefill_start = router.verify_lane.verify_start, router.prefill_lane.prefill_start

    def logged_verify_start(items):
        log.append("verify_start")
        return _Logged(verify_start(items), log)

    def logged_prefill_start(items):
        log.append("prefill_start")
        return prefill_start(items)

    router.verify_lane.verify_start, router.prefill_lane.prefill_start = logged_verify_start, logged_prefill_start
    observe, sampled = router.costs.observe_step, []

    def observing(batch, k, seconds):
        sampled.append(list(log))
        observe(batch, k, seconds)

    router.costs.observe_step = observing
    tokens: dict[str, list[int]] = {}
    pending = specs()
    while pending or router.has_work():
        for _ in range(2):
            if pending:
                tokens[router.add_request(pending.pop(0))] = []
        log.append("step")
        for out in router.step():
            tokens[out.request_id] += out.token_ids
    router.close()
    return tokens, log, sampled


def overlapped_steps(log: list[str]) -> int:
    steps = " ".join(log).split("step")
    return sum("verify_start prefill_start verify_result" in s for s in steps)


@pytest.fixture(scope="module")
def plain(tiny_models):
    """The tokens of `specs()` decoded without drafts (as test_engine_schedules' fixture)."""
    done = make_engine(*tiny_models, k=0).generate(specs())
    return {rid: c.token_ids for rid, c in done.items()}


@pytest.fixture
def async_lanes(monkeypatch):
    monkeypatch.setattr(LocalVerifyLane, "starts_async", True)
    monkeypatch.setattr(LocalPrefillLane, "starts_async", True)


@pytest.mark.parametrize("schedule", ["pd", "pdv"])
def test_prefill_beside_verify_is_lossless_and_overlapped(tiny_models, plain, async_lanes, schedule):
    engine = make_engine(*tiny_models, k=4)
    engine.router.config = engine.router.config.updated(schedule=schedule, pipeline=False)
    tokens, log, sampled = run(engine, overlap=True)
    assert tokens == plain
    assert overlapped_steps(log) >= 3, log
    # On the CPU a started call is done at once (ready() is True), so no overlapped step is a sample
    # (on CUDA one is, when the verify call was still running after the prefill's launch).
    for history in sampled if DEVICE == "cpu" else ():
        last = " ".join(history).split("step")[-1]
        assert "prefill_start" not in last, last


def test_without_overlap_prefill_waits_for_verify(tiny_models, plain, async_lanes):
    engine = make_engine(*tiny_models, k=4)
    tokens, log, sampled = run(engine, overlap=False)
    assert tokens == plain
    assert overlapped_steps(log) == 0
    assert sampled  # steps with a prefill after decode are still costed (without the prefill)


def test_only_cuda_lanes_start_async(tiny_models, plain):
    """Unpatched: CUDA lanes overlap by themselves; CPU lanes (no work runs on without the host) never do."""
    engine = make_engine(*tiny_models, k=4)
    cuda = DEVICE != "cpu"
    assert engine.router.verify_lane.starts_async == cuda and engine.router.prefill_lane.starts_async == cuda
    tokens, log, _ = run(engine, overlap=True)
    assert tokens == plain and (overlapped_steps(log) > 0) == cuda


def test_verify_lane_time_excludes_the_prefill_launch(tiny_models, async_lanes):
    """The verify lane's reported time (telemetry the operator scales on) must not include a slow
    prefill launched beside it; the prefill's own time does."""
    import time

    # The router's clock jumps SLOW seconds during each prefill launch (no real sleep): a verify time
    # that held a launch would be >= SLOW, one that holds none is a real CPU call (far below SLOW).
    SLOW = 1000.0
    engine = make_engine(*tiny_models, k=4)
    router = engine.router
    start = router.prefill_lane.prefill_start
    offset = [0.0]
    router.context.clock = lambda: time.monotonic() + offset[0]

    def slow_start(items):
        offset[0] += SLOW
        return start(items)

    router.prefill_lane.prefill_start = slow_start
    seen: dict[str, list[float]] = {"verify": [], "prefill": []}
    router.observer.on_lane_step = lambda lane, seconds, batch: seen.setdefault(lane, []).append(seconds)
    tokens, log, _ = run(engine, overlap=True)
    assert overlapped_steps(log) >= 3
    assert seen["verify"] and max(seen["verify"]) < SLOW, seen["verify"]
    assert max(seen["prefill"]) >= SLOW


class _StillRunning:
    """A CUDA verify call still running when the prefill launched beside it is launched: its step is a
    cost sample (on the CPU a started call is done at once, and such a step is not sampled)."""

    def __init__(self, started):
        self._started = started

    def ready(self):
        return False

    def result(self):
        return self._started.result()

    @property
    def next_tokens(self):
        return getattr(self._started, "next_tokens", None)


@pytest.mark.parametrize("k, overlap", [(0, True), (0, False), (4, True)])
def test_step_costs_exclude_prefill_of_arrivals(tiny_models, plain, async_lanes, k, overlap):
    """A step's cost (what the draft-length policy weighs) leaves out prefills of arriving requests:
    the launch of one beside the verify call, and in a chain of overlapped plain steps the launch and
    commit of those it admits. Once a 16-prompt launch (~0.9 ms, H200) made plain decoding at 16
    requests look 1.8 x as costly as it is, and the policy drafted at 0.7 x its speed."""
    import time

    # A prefill launch: the router's clock jumps SLOW seconds in it (no real sleep); what a sample
    # holds of it is measured against the step's own time on that clock.
    SLOW = 1000.0
    engine = make_engine(*tiny_models, k=k)
    router = engine.router
    router.config = router.config.updated(overlap=overlap)
    offset = [0.0]
    router.context.clock = lambda: time.monotonic() + offset[0]
    start, verify_start = router.prefill_lane.prefill_start, router.verify_lane.verify_start
    launches = []

    def slow_start(items):
        launches.append(len(items))
        offset[0] += SLOW
        return start(items)

    router.prefill_lane.prefill_start = slow_start
    router.verify_lane.verify_start = lambda items, **kw: _StillRunning(verify_start(items, **kw))
    samples: list[tuple[int, float]] = []
    observe = router.costs.observe_step
    router.costs.observe_step = lambda batch, kk, s: (samples.append((kk, s)), observe(batch, kk, s))
    tokens: dict[str, list[int]] = {}
    steps = []  # (wall seconds, prefill launches in it, its cost samples): load slows whole steps alike
    pending = specs()
    while pending or router.has_work():
        for _ in range(2):  # requests join two per step: most steps launch a prefill
            if pending:
                tokens[router.add_request(pending.pop(0))] = []
        n_launches, n_samples, t0 = len(launches), len(samples), router.context.clock()
        for out in router.step():
            tokens[out.request_id] += out.token_ids
        steps.append((router.context.clock() - t0, len(launches) - n_launches, samples[n_samples:]))
    assert tokens == plain
    assert len(launches) >= 3 and (not overlap or k > 0 or router.overlap.admitting >= 1), router.overlap.breaks
    assert samples
    # A sample holds none of the step's prefill launches: at most its wall time without them (a sample
    # with one launch in it would exceed that by SLOW), whatever else slows the machine.
    for wall, n, taken in steps:
        for _, s in taken:
            assert s <= wall - n * SLOW + SLOW / 4, (s, wall, n)
    assert any(n and taken for _, n, taken in steps)  # some sampled step launched a prefill

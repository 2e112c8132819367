"""Overlapped scheduling through arrivals (verifypd.router.overlap): a chained step admits the waiting
requests `plan` would admit and starts their prefill beside its verify call; they decode in the very
next step, their first token read on the device from the prefill's output. A served closed loop
admits a request nearly every step, so without this the chain broke at every arrival.

Each test runs the same requests with overlap off and on (arrivals and cancels between the same
`Router.step()` calls) and wants, per request, the same chunks (tokens, text, finish) — and checks
on the engine's counters that arrivals really were taken into the chain."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import make_engine
from test_router_overlap import check_blocks_returned, drive, fresh, make_specs, prompts

from verifypd.domain.requests import FinishReason, RequestSpec, SamplingParams
from verifypd.lanes.local import LocalPrefillLane
from verifypd.lanes.local_verify import LocalVerifyLane

pytestmark = pytest.mark.slow  # long overlapped decoding runs through the engine (tests/README.md)


def per_request(chunks) -> dict[str, list[tuple]]:
    """Each request's chunks in order (tokens, finished, reason), without the step they came in:
    with overlap a request's first token comes one `step()` call later by count (its prefill was
    launched behind the step already in flight), not later in time."""
    out: dict[str, list[tuple]] = {}
    for _, rid, tokens, finished, reason in chunks:
        out.setdefault(rid, []).append((tokens, finished, reason))
    return out


def staggered(n: int, first: int = 3, every: int = 2, start: int = 4) -> dict[int, list[int]]:
    """`first` requests at step 0, then one arrival every `every` steps from step `start`."""
    return {start + every * (i - first): [i] for i in range(first, n)}


def same_streams(want, want_chunks, got, got_chunks):
    assert got == want
    assert per_request(got_chunks) == per_request(want_chunks)


@pytest.mark.parametrize("path", ["ahead", "beside"])
def test_arrivals_join_the_chain_with_eos_length_stop_and_seeded_sampling(tiny_models, path):
    """Requests arrive one every other step while a chain runs; greedy and seeded-sampled ones,
    ending by EOS, max_tokens and stop strings. Every arrival is admitted by a chained step, and
    decodes in it (ahead: prefill first) or in the step after it (beside)."""
    engine = (lambda: ahead(fresh(tiny_models))) if path == "ahead" else (lambda: fresh(tiny_models))
    arrive = staggered(14)
    base, _, _ = drive(fresh(tiny_models), make_specs(14, seed=3), overlap=False, arrive=arrive)
    counts: dict[int, int] = {}
    for toks, _, _ in base.values():
        for t in toks[1:-1]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)  # an EOS that really occurs mid-generation
    words = {i: [base[f"q{i}"][1].split()[2]] for i in (5, 8, 10) if len(base[f"q{i}"][1].split()) > 3}
    specs = make_specs(14, seed=3, stop=words)
    want, want_chunks, _ = drive(fresh(tiny_models), specs, overlap=False, eos=(eos,), arrive=arrive)
    got, got_chunks, router = drive(engine(), specs, overlap=True, eos=(eos,), arrive=arrive)
    same_streams(want, want_chunks, got, got_chunks)
    reasons = {v[2] for v in got.values()}
    assert {FinishReason.EOS, FinishReason.LENGTH} <= reasons and (not words or FinishReason.STOP in reasons)
    assert any(s.sampling.seed is not None and s.request_id in got for s in specs)
    ov = router.overlap
    # 11 arrivals, each while a chain ran: each admitted by a chained step, each joining the next one.
    assert ov.admitting >= 10 and ov.joined >= 10, (ov.admitting, ov.joined, ov.breaks)
    assert "waiting" not in ov.breaks and "running" not in ov.breaks, ov.breaks
    check_blocks_returned(router)


@pytest.mark.parametrize("path", ["ahead", "beside"])
def test_a_request_ending_at_its_first_token_while_joining(tiny_models, path):
    """Arrivals that end at their first token: max_tokens 1 (left out of the next step: it surely
    ends) and an EOS first token (its row in the next step is dropped at commit)."""
    specs = make_specs(10, seed=7)
    base, _, _ = drive(fresh(tiny_models), specs, overlap=False)
    eos = base["q6"][0][0]  # q6's first token ends q6 (and maybe others) at once
    specs = [dataclasses.replace(s, max_tokens=1) if i in (4, 8) else s for i, s in enumerate(specs)]
    arrive = staggered(10)
    want, want_chunks, _ = drive(fresh(tiny_models), specs, overlap=False, eos=(eos,), arrive=arrive)
    engine = ahead(fresh(tiny_models)) if path == "ahead" else fresh(tiny_models)
    verified: set[str] = set()
    verify_start = engine.router.verify_lane.verify_start
    engine.router.verify_lane.verify_start = lambda items, **kw: (
        verified.update(i.request_id for i in items),
        verify_start(items, **kw),
    )[1]
    got, got_chunks, router = drive(engine, specs, overlap=True, eos=(eos,), arrive=arrive)
    same_streams(want, want_chunks, got, got_chunks)
    assert not verified & {"q4", "q8"}, "a request that surely ends at its first token got a decode row"
    assert len(got["q4"][0]) == len(got["q8"][0]) == 1 and got["q6"] == ((eos,), got["q6"][1], FinishReason.EOS)
    assert router.overlap.admitting >= 6 and router.overlap.dropped > 0
    check_blocks_returned(router)


def ahead(engine):
    """RuntimeConfig.admit_ahead (`--overlap ahead`): a request admitted into a chained step is
    prefilled ahead of it and decodes in it. Without it (the default) its prefill runs beside the
    step and it joins the step after."""
    engine.router.config = engine.router.config.updated(admit_ahead=True)
    return engine


def arrive_in_a_chain(engine):
    """Three requests chain for four steps, then q3 arrives while a step is in flight. Returns the router."""
    router = engine.router
    router.config = dataclasses.replace(router.config, overlap=True)
    specs = [dataclasses.replace(s, max_tokens=30, stop_at_eos=False) for s in make_specs(4, seed=2)]
    for spec in specs[:3]:
        router.add_request(spec)
    for _ in range(4):
        router.step()
    assert router.overlap.inflight is not None
    router.add_request(specs[3])
    return engine.router


def cancel_q3_then_finish(router) -> int:
    """Cancels q3 while a step (or prefill) holding it is in flight: its blocks stay out of the pool
    and nothing of it is committed by the next step; then runs to the end. Returns the rows dropped
    by then."""
    free_before = router.target_blocks.num_free
    out = router.abort("q3")
    assert out.finished and out.finish_reason is FinishReason.CANCELLED
    assert router.target_blocks.num_free == free_before, "blocks freed under a call still in flight"
    outputs = router.step()
    assert all(o.request_id != "q3" for o in outputs), "a cancelled request's token was streamed"
    assert "q3" not in router.overlap.inflight.members
    dropped = router.overlap.dropped
    while router.has_work():
        router.step()
    check_blocks_returned(router)
    return dropped


def test_an_arrival_decodes_in_the_step_launched_with_its_prefill(tiny_models):
    """k is 0 whatever the batch: the admitted request's prefill goes first, the chained step launched
    right after it decodes the request too (first token fed from the prefill on the device), and
    the first token is committed in the same `step()` call, with the step before. A cancel then
    drops its row in the step in flight and holds its blocks until that step's results are in."""
    router = arrive_in_a_chain(ahead(fresh(tiny_models)))
    outputs = router.step()
    inflight = router.overlap.inflight
    assert inflight is not None and "q3" in inflight.members, "the arrival does not decode in the new step"
    assert [o.token_ids for o in outputs if o.request_id == "q3"] and not inflight.admitted, (
        "the first token did not come in the call that launched its prefill"
    )
    assert cancel_q3_then_finish(router) == 1  # its row in the step in flight, dropped


def test_cancel_while_its_prefill_is_in_flight(tiny_models):
    """A request cancelled while the chained step that admitted it (and its prefill) is in flight:
    its chunk is dropped at commit, its blocks wait for that step; the others are unchanged."""
    router = arrive_in_a_chain(fresh(tiny_models))
    router.step()  # launches the step after the one in flight, with q3's prefill beside it
    inflight = router.overlap.inflight
    assert inflight is not None and "q3" in inflight.admitted, "the arrival was not taken into the chain"
    cancel_q3_then_finish(router)


@pytest.mark.parametrize("path", ["ahead", "beside"])
def test_cancels_of_arriving_and_joining_requests_same_chunks(tiny_models, path):
    """Cancels land one and two steps after an arrival (beside: its prefill in flight, then its
    first decode step; ahead: its first and second decode steps) and on long-running requests,
    with greedy and seeded requests."""
    engine = (lambda: ahead(fresh(tiny_models))) if path == "ahead" else (lambda: fresh(tiny_models))
    specs = make_specs(12, seed=8)
    arrive = staggered(12, first=4, every=3)
    cancel = {s + 1: [f"q{i[0]}"] for s, i in arrive.items() if i[0] % 3 == 0}
    cancel.update({s + 2: cancel.get(s + 2, []) + [f"q{i[0]}"] for s, i in arrive.items() if i[0] % 3 == 1})
    cancel.setdefault(6, []).append("q1")
    plan = dict(arrive=arrive, cancel=cancel)
    want, want_chunks, _ = drive(fresh(tiny_models), specs, overlap=False, **plan)
    got, got_chunks, router = drive(engine(), specs, overlap=True, **plan)
    assert got.keys() == want.keys()
    full = per_request(drive(fresh(tiny_models), specs, overlap=False, arrive=arrive)[1])
    streams, want_streams = per_request(got_chunks), per_request(want_chunks)
    for rid, (tokens, text, finish) in got.items():
        if want[rid][2] is FinishReason.CANCELLED:  # the cancel lands one step later by count
            assert finish is FinishReason.CANCELLED
            assert streams[rid][:-1] == full[rid][: len(streams[rid]) - 1], rid
        else:
            assert (tokens, text, finish) == want[rid] and streams[rid] == want_streams[rid], rid
    assert sum(v[2] is FinishReason.CANCELLED for v in got.values()) >= 4
    assert router.overlap.admitting >= 6 and router.overlap.dropped > 0
    check_blocks_returned(router)


def test_arrivals_under_block_pressure(tiny_models):
    """A pool too small for everyone: admissions wait for blocks, decoding preempts (the chain
    breaks there, counted), recomputes are admitted by regular steps; streams stay the same."""
    specs = [
        RequestSpec(
            p,
            max_tokens=24,
            stop_at_eos=False,
            request_id=f"p{i}",
            sampling=SamplingParams(temperature=0.8, seed=9 + i) if i % 2 else SamplingParams(),
        )
        for i, p in enumerate(prompts(8, 21))
    ]
    arrive = staggered(8, first=3, every=2)
    want, want_chunks, _ = drive(fresh(tiny_models, num_blocks=40), specs, overlap=False, arrive=arrive)
    preempted = []
    engine = fresh(tiny_models, num_blocks=40)
    engine.router.observer.on_request_finished = lambda seq: preempted.append(seq.stats.preemptions)
    got, got_chunks, router = drive(engine, specs, overlap=True, arrive=arrive)
    same_streams(want, want_chunks, got, got_chunks)
    assert sum(preempted) > 0, "the pool never forced a preemption"
    assert router.overlap.admitting >= 2, router.overlap.breaks
    check_blocks_returned(router)


def test_prompts_longer_than_the_budget_break_the_chain(tiny_models):
    """A prompt longer than the prefill budget is chunked over several steps: a chained step cannot
    take it (counted as a break for a waiting request); short ones are still admitted in the chain."""
    specs = [
        RequestSpec(p, max_tokens=16, stop_at_eos=False, request_id=f"l{i}") for i, p in enumerate(prompts(10, 13))
    ]
    long_ = [s.request_id for s in specs if len(s.prompt_ids) > 16]
    assert long_ and len(long_) < len(specs)
    arrive = staggered(10)
    runs = []
    for overlap in (False, True):
        engine = fresh(tiny_models)
        engine.router.config = engine.router.config.updated(prefill_token_budget=16)
        runs.append(drive(engine, specs, overlap=overlap, arrive=arrive))
    (want, want_chunks, _), (got, got_chunks, router) = runs
    same_streams(want, want_chunks, got, got_chunks)
    assert router.overlap.breaks.get("waiting", 0) >= 1 and router.overlap.admitting >= 1, router.overlap.breaks


def test_a_regular_step_with_a_prefill_beside_starts_a_chain(tiny_models, monkeypatch):
    """With lanes that start asynchronously (CUDA; here the CPU lanes say so) a regular step's prefill
    runs beside its verify call, and a chain may start there: the prefilled requests join it."""
    monkeypatch.setattr(LocalVerifyLane, "starts_async", True)
    monkeypatch.setattr(LocalPrefillLane, "starts_async", True)
    specs = make_specs(8, seed=12)
    arrive = {1: [3, 4], 6: [5], 9: [6, 7]}  # step 1: regular (step 0 only prefilled), decode + prefill
    want, want_chunks, _ = drive(fresh(tiny_models), specs, overlap=False, arrive=arrive)
    engine = fresh(tiny_models)
    starts = []
    start = engine.router.overlap.start
    engine.router.overlap.start = lambda *a, **kw: (
        starts.append(kw.get("beside", a[4] if len(a) > 4 else None)),
        start(*a, **kw),
    )
    got, got_chunks, router = drive(engine, specs, overlap=True, arrive=arrive)
    same_streams(want, want_chunks, got, got_chunks)
    assert any(b is not None for b in starts), "no chain was started by a step with a prefill beside"
    assert router.overlap.joined >= 1


def test_a_chain_started_beside_a_prefill_admits_the_requests_still_waiting(tiny_models, monkeypatch):
    """A regular step prefills what its budget allows beside its verify call and starts a chain; the
    chained step launched there admits requests still waiting (its prefill first, as `advance`
    does): every admitted request's first token is committed, by that regular step or the next call."""
    monkeypatch.setattr(LocalVerifyLane, "starts_async", True)
    monkeypatch.setattr(LocalPrefillLane, "starts_async", True)
    specs = [dataclasses.replace(s, prompt_ids=(tuple(s.prompt_ids) * 8)[:8]) for s in make_specs(9, seed=12)]
    budget = 2 * len(specs[0].prompt_ids)  # two whole prompts per step: the others wait
    arrive = {1: [3, 4, 5, 6, 7], 6: [8]}

    def engine():
        e = ahead(fresh(tiny_models))
        e.router.config = e.router.config.updated(prefill_token_budget=budget)
        return e

    want, want_chunks, _ = drive(engine(), specs, overlap=False, arrive=arrive)
    got, got_chunks, router = drive(engine(), specs, overlap=True, arrive=arrive)
    same_streams(want, want_chunks, got, got_chunks)
    assert router.overlap.joined >= 3, (router.overlap.joined, router.overlap.breaks)
    check_blocks_returned(router)


@pytest.mark.parametrize("off", ["overlap", "prefill_first"])
def test_no_admission_in_the_chain_when_the_regular_step_would_not_start_it_beside(tiny_models, off):
    """Prefill before decode (lane priorities) or overlap off: arrivals end the chain, no chained
    step carries a prefill."""
    specs = make_specs(8, seed=4)
    arrive = staggered(8)
    engine = fresh(tiny_models)
    if off == "prefill_first":
        from verifypd.domain.config import LanePriorities

        engine.router.config = engine.router.config.updated(priorities=LanePriorities(prefill=3))
    got, _, router = drive(engine, specs, overlap=off != "overlap", arrive=arrive)
    want, _, _ = drive(fresh(tiny_models), specs, overlap=False, arrive=arrive)
    assert got == want
    assert router.overlap.admitting == 0
    if off == "prefill_first":
        assert router.overlap.breaks.get("waiting", 0) >= 3 and router.overlap.steps > 5


def test_chained_steps_reach_telemetry(tiny_models):
    """verifypd.engine.chained_steps counts the steps launched ahead, split by whether they carried
    a prefill of admitted requests (served benchmarks divide it by the verify calls)."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from verifypd.core.telemetry import Telemetry
    from verifypd.domain import metric_names as mn

    reader = InMemoryMetricReader()
    engine = fresh(tiny_models)
    engine.router.observer = Telemetry(readers=[reader])
    _, _, router = drive(engine, make_specs(10, seed=3), overlap=True, arrive=staggered(10))
    points = {
        p.attributes[mn.ATTR_STEP_PREFILL]: p.value
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == mn.CHAINED_STEPS
        for p in m.data.data_points
    }
    assert router.overlap.admitting >= 5
    assert points == {"true": router.overlap.admitting, "false": router.overlap.steps - router.overlap.admitting}


def test_draft_none_plain_decodes_and_chains(tiny_models):
    """`--draft none` proposes nothing, so the adaptive policy never observes an acceptance and
    asked k_initial drafts every step (a draft call answering nothing, then a k = 0 verify): no step
    ever chained (bench/serving/serving_vs_engine.py's k0 rows). The scheduler knows k is 0 there."""
    engine = make_engine(tiny_models[0], "none", k=4, adaptive=True)
    calls = []
    draft = engine.router.draft_lane.draft
    engine.router.draft_lane.draft = lambda items: (calls.append(len(items)), draft(items))[1]
    specs = make_specs(8, seed=6)
    want, _, _ = drive(fresh(tiny_models), specs, overlap=False, arrive=staggered(8))
    got, _, router = drive(engine, specs, overlap=True, arrive=staggered(8))
    assert got == want
    assert not calls, "a draft lane that proposes nothing was called"
    assert router.overlap.steps > 10 and router.overlap.admitting >= 4, (router.overlap.steps, router.overlap.breaks)


def test_an_arrival_that_is_not_plain_breaks_the_chain_and_keeps_its_stream(tiny_models):
    """An arrival asking for logprobs is admitted beside a chained step, but its prefill leaves no
    first token on the device and no chained step may hold it (the verify lane refuses a feed with
    sampling controls or logprobs): the chain breaks there ("off") instead of taking it in with its
    token from the host, and every stream equals overlap off."""
    specs = make_specs(8, seed=11)
    specs[5] = dataclasses.replace(specs[5], sampling=SamplingParams(logprobs=True), stop_at_eos=False)
    arrive = staggered(8)
    want, want_chunks, _ = drive(fresh(tiny_models), specs, overlap=False, arrive=arrive)
    got, got_chunks, router = drive(fresh(tiny_models), specs, overlap=True, arrive=arrive)
    same_streams(want, want_chunks, got, got_chunks)
    assert router.overlap.breaks.get("off", 0) >= 1 and router.overlap.admitting >= 2, router.overlap.breaks
    check_blocks_returned(router)

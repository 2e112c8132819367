"""Drafts launched right after a verify call, fitted to its verdict on the device (engine.draft_after,
model.verdict_shift): the same proposals at every (request, position) as drafts made in their own
step, plain decoding's tokens (greedy and seeded), with requests finishing at different lengths,
joining, cancelled or preempted while they hold such drafts, and mixed with prompt lookup."""

from __future__ import annotations

import random

import pytest
import torch
from engine_cases import repeating_prompts, write_head
from engine_helpers import (
    DEVICE,
    assert_others_plain_and_blocks_free,
    eager_and_graphed,
    make_engine,
    run_and_cancel_once,
)

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.model.eagle_chain import CallInputs
from verifypd.model.verdict_shift import shift_reference, shift_to_verdict


@pytest.fixture(scope="module")
def head(tiny_models, tmp_path_factory):
    # std 0.6: a head that is sometimes right on the tiny target (partial acceptance moves the rows)
    return write_head(tiny_models, tmp_path_factory.mktemp("draft_after") / "head", std=0.6)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 90) for _ in range(rng.randrange(4, 12))] for _ in range(n)]


def _specs(prompts, **kw) -> list[RequestSpec]:
    # different lengths: requests finish (and leave drafts made after their last verify unused) apart
    return [
        RequestSpec(p, max_tokens=10 + 3 * i, stop_at_eos=False, request_id=f"r{i}", **kw)
        for i, p in enumerate(prompts)
    ]


def _proposals(engine) -> dict[tuple[str, int], list[int]]:
    """Wraps the router's commit of verify calls: each verified item's drafts (host values), by
    (request, pending position). (At commit: a verify call launched before the verdict before it is
    laid out for that verdict's longest outcome and gets its real positions only once it is known.)"""
    seen: dict[tuple[str, int], list[int]] = {}
    ctx = engine.router.context
    commit = ctx.commit_verdicts

    def recording(work, items, results):
        for i in items:
            if len(i.draft_tokens):
                seen[(i.request_id, i.start_pos)] = list(i.draft_tokens)
        return commit(work, items, results)

    ctx.commit_verdicts = recording
    return seen


def _inputs(rows: int, query: int, seed: int):
    """Random CallInputs of a right-aligned layout, a verdict and its fitting rows."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda *shape, hi=50: torch.randint(0, hi, shape, generator=g)  # noqa: E731
    vks = ri(rows, hi=query).clamp(max=query - 1)
    vrows = torch.randperm(rows + 2, generator=g)[:rows]
    vrows[0] = -1  # a padding row: left as it is
    width = 2 + int(vks.max())
    verdict = ri(rows + 2, width, hi=1000)
    verdict[:, 0] = 0
    for r in range(rows):  # an accepted count <= the row's k
        if vrows[r] >= 0:
            verdict[vrows[r], 0] = int(ri(1, hi=int(vks[r]) + 1)[0])
    inp = CallInputs(
        ids=ri(rows * query),
        positions=ri(rows * query, hi=300),
        slots=ri(rows * query, hi=300),
        feature_rows=ri(rows * query, hi=300),
        tables=torch.zeros(rows, 1, dtype=torch.long),
        last=ri(rows, hi=300) + 20,
        ks=ri(rows),
        top_k=ri(rows),
        seeds=ri(rows),
        temp_bits=ri(rows),
        top_p_bits=ri(rows),
        temp=torch.zeros(rows),
        top_p=torch.zeros(rows),
        query=query,
        vrows=vrows,
        vks=vks,
    )
    return inp, verdict


def _clone(inp: CallInputs, device: str = "cpu") -> CallInputs:
    return CallInputs(
        **{f: (v.to(device, copy=True) if isinstance(v, torch.Tensor) else v) for f, v in vars(inp).items()}
    )


@pytest.mark.parametrize("rows, query, seed", [(1, 2, 0), (4, 5, 1), (8, 9, 2), (3, 9, 3)])
def test_shift_kernel_equals_reference_and_the_rule(rows, query, seed):
    inp, verdict = _inputs(rows, query, seed)
    expected, got = _clone(inp), _clone(inp, DEVICE)
    shift_reference(expected, verdict, scratch_row=999)
    shift_to_verdict(got, verdict.to(DEVICE), scratch_row=999, use_triton=True)  # on the CPU: the interpreter
    for field in ("ids", "positions", "slots", "feature_rows", "last"):
        assert torch.equal(getattr(got, field).cpu(), getattr(expected, field)), field
    # The rule itself, row by row (the reference could be wrong the same way as the kernel).
    for r in range(rows):
        old = [getattr(inp, f).view(rows, query)[r].tolist() for f in ("ids", "positions", "slots", "feature_rows")]
        new = [
            getattr(expected, f).view(rows, query)[r].tolist() for f in ("ids", "positions", "slots", "feature_rows")
        ]
        if inp.vrows[r] < 0:
            assert new == old and expected.last[r] == inp.last[r]
            continue
        v, k = int(inp.vrows[r]), int(inp.vks[r])
        a, final, drafts = int(verdict[v, 0]), int(verdict[v, 1]), verdict[v, 2:].tolist()
        shift = k - a
        assert expected.last[r] == inp.last[r] - shift
        ys = drafts[:a] + [final]
        for c in range(query):
            src = c - shift
            if src < 0:
                assert (new[0][c], new[1][c], new[2][c], new[3][c]) == (0, old[1][0], -1, 999)
            else:
                i = src - (query - 1 - k)
                assert new[0][c] == (ys[i] if i >= 0 else old[0][src])
                assert (new[1][c], new[2][c], new[3][c]) == (old[1][src], old[2][src], old[3][src])


@pytest.mark.parametrize("k, adaptive, max_running", [(1, False, 8), (4, False, 8), (3, False, 3), (3, True, 8)])
def test_greedy_equals_plain_and_drafts_equal_those_made_in_their_own_step(tiny_models, head, k, adaptive, max_running):
    prompts = _prompts(6, seed=k)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    on = make_engine(tiny_models[0], head, k=k, adaptive=adaptive, max_running=max_running)
    off = make_engine(tiny_models[0], head, k=k, adaptive=adaptive, max_running=max_running)
    off.router.draft_after.enabled = False
    seen_on, seen_off = _proposals(on), _proposals(off)
    for engine in (on, off):
        done = engine.generate(_specs(prompts))
        assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    after = on.router.draft_after
    assert (after.calls > 0 and after.held > 0 or adaptive) and off.router.draft_after.calls == 0
    # Same head rows, same proposals: where both engines verified drafts at the same position, the
    # drafts agree (k may differ near a request's end: the cap a step early assumes the longest outcome).
    common = [key for key in seen_on if key in seen_off]
    # (adaptive k follows measured step times: how much both engines drafted alike is up to the machine)
    assert len(common) >= len(seen_on) // 2 > 0 or adaptive, (len(common), len(seen_on))
    for key in common:
        n = min(len(seen_on[key]), len(seen_off[key]))
        assert seen_on[key][:n] == seen_off[key][:n], key


@pytest.mark.parametrize("k, max_running", [(4, 8), (6, 8)])  # all at once: an arrival joins at k = 0
def test_partial_acceptance_moves_the_rows_as_drafting_in_their_own_step(tiny_models, head, k, max_running):
    """A random head is rarely right on the tiny target, so the verify lane keeps drafts by a seeded
    coin (its benchmark mode, not the target's distribution): every accepted count 0..k occurs, and
    the engine that drafts right after each verify call gives the tokens and, at every position both
    verified, the proposals of the engine that drafts in the step itself."""
    prompts = _prompts(6, seed=20 + k)
    engines = [make_engine(tiny_models[0], head, k=k, max_running=max_running) for _ in range(2)]
    engines[1].router.draft_after.enabled = False
    seen = [_proposals(e) for e in engines]
    outs, usage = [], []
    for e in engines:
        e.verify_lane.simulated_acceptance = 0.6
        done = e.generate(_specs(prompts))
        outs.append({r: c.token_ids for r, c in done.items()})
        usage.append(sum(c.usage["accepted_tokens"] for c in done.values()))
    assert engines[0].router.draft_after.held > 0 and 0 < usage[0]
    # The coin keeps drafts whatever they are, so the output follows k; k differs only near a request's
    # end (the cap decided a step early assumes every draft accepted): same tokens before that.
    compared = 0
    for n, rid in enumerate(outs[0]):
        a, b = outs[0][rid], outs[1][rid]
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        assert len(a) == len(b) and same >= len(a) - 2 * k - 2, (rid, same, len(a))
        end = len(prompts[n]) + same  # positions before it hold the same tokens in both engines
        for (r, pos), drafts in seen[0].items():
            if r == rid and (r, pos) in seen[1] and pos + k < end:
                other = seen[1][(r, pos)]
                assert drafts[: len(other)] == other[: len(drafts)], (r, pos)
                compared += 1
    assert compared >= 10, compared


def test_most_drafts_are_made_after_the_verify_before(tiny_models, head):
    prompts = _prompts(4, seed=5)
    specs = [RequestSpec(p, max_tokens=24, stop_at_eos=False) for p in prompts]
    engine = make_engine(tiny_models[0], head, k=3)
    calls = []
    draft = engine.draft_lane.draft
    engine.draft_lane.draft = lambda items: calls.append(len(items)) or draft(items)
    engine.generate(specs)
    after = engine.router.draft_after
    assert after.calls >= 4 and len(calls) <= 2, (after.calls, len(calls))


def test_graphed_call_path_fits_the_verdict_as_the_eager_path(tiny_models, head):
    """EagleGraphs.draft with `after` (on the CPU its functions over the static buffers) proposes what
    the eager path proposes."""
    prompts = _prompts(5, seed=9)
    eager, graphed, runner = eager_and_graphed(tiny_models[0], head)
    seen = [_proposals(e) for e in (eager, graphed)]
    outs = [{r: c.token_ids for r, c in e.generate(_specs(prompts)).items()} for e in (eager, graphed)]
    assert outs[0] == outs[1]
    assert seen[0] == seen[1] and runner.graphs.calls > 0 and graphed.router.draft_after.calls > 0


def test_seeded_output_equals_plain(tiny_models, head):
    prompts = _prompts(5, seed=11)
    specs = lambda: _specs(prompts, sampling=SamplingParams(temperature=0.7, seed=7))  # noqa: E731
    plain = make_engine(tiny_models[0], "none", k=0).generate(specs())
    engine = make_engine(tiny_models[0], head, k=4)
    done = engine.generate(specs())
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert engine.router.draft_after.held > 0


def test_cancel_and_preemption_while_holding_drafts(tiny_models, head):
    prompts = _prompts(6, seed=4)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    router = make_engine(tiny_models[0], head, k=4, num_blocks=40).router

    def holding(router):  # the last request holding drafts made after a verify call, if any
        held = [s for s in router.sequences() if s.held_draft is not None and s.held_draft.predrafted]
        return held[-1].request_id if held else None

    tokens, cancelled = run_and_cancel_once(router, _specs(prompts), holding)
    assert cancelled is not None
    assert_others_plain_and_blocks_free(router, tokens, cancelled, plain)


def test_arrivals_join_requests_holding_drafts(tiny_models, head):
    prompts = _prompts(6, seed=6)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    engine = make_engine(tiny_models[0], head, k=3)
    router = engine.router
    tokens: dict[str, list[int]] = {}
    specs = _specs(prompts)
    router.add_request(specs[0])
    router.add_request(specs[1])
    pending = specs[2:]
    while router.has_work() or pending:
        if pending and any(s.held_draft is not None and s.held_draft.predrafted for s in router.sequences()):
            router.add_request(pending.pop(0))
        for out in router.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert tokens == {r: c.token_ids for r, c in plain.items()}


@pytest.mark.parametrize("k", [2, 4])
def test_head_mixed_with_lookup(tiny_models, head, k):
    mixed = "eagle+ngram:" + head.removeprefix("eagle:")
    prompts = repeating_prompts(5, seed=k)
    specs = lambda: [RequestSpec(p, max_tokens=24, stop_at_eos=False) for p in prompts]  # noqa: E731
    plain = make_engine(tiny_models[0], "none", k=0).generate(specs())
    engine = make_engine(tiny_models[0], mixed, k=k)
    done = engine.generate(specs())
    assert [c.token_ids for c in done.values()] == [c.token_ids for c in plain.values()]
    assert engine.router.draft_after.held > 0 and engine.router.lookup.proposed > 0


# -- speculative steps launched before the step before them streams (engine.spec_ahead) -------------


@pytest.mark.parametrize("k, adaptive", [(3, False), (4, True)])
def test_steps_launched_ahead_give_the_same_tokens_and_proposals(tiny_models, head, k, adaptive):
    prompts = _prompts(6, seed=30 + k)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    on, off = (make_engine(tiny_models[0], head, k=k, adaptive=adaptive) for _ in range(2))
    off.router.ahead.enabled = False
    seen = [_proposals(e) for e in (on, off)]
    for e in (on, off):
        e.verify_lane.simulated_acceptance = None
        done = e.generate(_specs(prompts))
        assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert (on.router.ahead.steps > 0 or adaptive) and off.router.ahead.steps == 0
    if not adaptive:
        assert seen[0] == seen[1]  # same plans, same drafts: only launched earlier
    # Adaptive k follows measured step times, so the two engines' k (and positions) may differ; where
    # both verified drafts at a position, the drafts agree as far as both go.
    common = [key for key in seen[0] if key in seen[1]]
    assert adaptive or len(common) == len(seen[0]) > 0, (len(common), len(seen[0]))
    for key in common:
        n = min(len(seen[0][key]), len(seen[1][key]))
        assert seen[0][key][:n] == seen[1][key][:n], key


def test_steps_launched_ahead_with_partial_acceptance_match_the_regular_order(tiny_models, head):
    """The seeded coin keeps drafts whatever they are (benchmark mode): any difference in a plan, a k or
    a draft between the two orders would change the tokens."""
    prompts = _prompts(6, seed=41)
    on, off = (make_engine(tiny_models[0], head, k=4) for _ in range(2))
    off.router.ahead.enabled = False
    seen = [_proposals(e) for e in (on, off)]
    outs = []
    for e in (on, off):
        e.verify_lane.simulated_acceptance = 0.6
        outs.append({r: c.token_ids for r, c in e.generate(_specs(prompts)).items()})
    assert outs[0] == outs[1] and seen[0] == seen[1] and on.router.ahead.steps > 5


def test_stop_strings_and_cancel_with_a_step_in_flight(tiny_models, head):
    """A request with a stop string streams before the next step is planned (it ends there, or not);
    one cancelled while a step holding its row is in flight is dropped at commit; the others decode as
    plain decoding does."""
    prompts = _prompts(6, seed=7)
    plain_engine = make_engine(tiny_models[0], "none", k=0)
    plain = plain_engine.generate(_specs(prompts))
    text = plain_engine.codec.decode(plain["r2"].token_ids[4:6])
    specs = _specs(prompts)
    specs[2] = RequestSpec(prompts[2], max_tokens=specs[2].max_tokens, stop_at_eos=False, request_id="r2", stop=(text,))
    expected = make_engine(tiny_models[0], "none", k=0).generate([specs[2]])["r2"]
    engine = make_engine(tiny_models[0], head, k=3)
    router = engine.router
    for s in specs:
        router.add_request(s)
    tokens: dict[str, list[int]] = {}
    cancelled = None
    while router.has_work():
        for out in router.step():
            assert out.request_id != cancelled, "a chunk of a cancelled request"
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        if cancelled is None and router.ahead.inflight is not None and len(router.ahead.inflight.work) > 3:
            cancelled = router.ahead.inflight.work[-1].seq.request_id
            assert router.abort(cancelled) is not None
    assert cancelled is not None and router.ahead.steps > 0
    for rid in tokens:
        if rid == "r2":
            assert tokens[rid] == expected.token_ids
        elif rid != cancelled:
            assert tokens[rid] == plain[rid].token_ids, rid
    assert router.target_blocks.num_free == router.target_blocks.num_blocks
    assert router.draft_blocks.num_free == router.draft_blocks.num_blocks


def test_a_plan_that_cannot_go_ahead_is_the_next_steps(tiny_models, head, monkeypatch):
    """With the block check forced open, a plan made ahead preempts (a pool too small for everyone):
    it is kept for the next step, which runs it; tokens stay plain decoding's."""
    prompts = _prompts(6, seed=4)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    engine = make_engine(tiny_models[0], head, k=4, num_blocks=24)
    monkeypatch.setattr(type(engine.router.scheduler.blocks), "fits_ahead", lambda self, seqs: True)
    done = engine.generate(_specs(prompts))
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert engine.router.ahead.kept > 0 and engine.router.ahead.steps > 0


def test_drafts_after_verify_and_steps_ahead_reach_telemetry(tiny_models, head):
    """verifypd.speculation.drafts_after_verify, verifypd.engine.speculative_steps_ahead and
    verifypd.engine.verify_calls_fitted count what the engine did (its own counters, as deltas)."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from verifypd.core.telemetry import Telemetry
    from verifypd.domain import metric_names as mn

    reader = InMemoryMetricReader()
    engine = make_engine(tiny_models[0], head, k=3)
    engine.router.observer = Telemetry(readers=[reader])
    engine.generate(_specs(_prompts(4, seed=12)))
    wanted = (mn.DRAFTS_AFTER_VERIFY, mn.STEPS_AHEAD, mn.VERIFY_FITTED)
    points = {
        m.name: [p.value for p in m.data.data_points]
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name in wanted
    }
    router = engine.router
    assert router.draft_after.requests > 0 and router.ahead.steps > 0
    assert points[mn.DRAFTS_AFTER_VERIFY] == [router.draft_after.requests]
    assert points[mn.STEPS_AHEAD] == [router.ahead.steps]
    assert router.ahead.fitted > 0 and points[mn.VERIFY_FITTED] == [router.ahead.fitted]

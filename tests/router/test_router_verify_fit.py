"""Verify calls launched before the verdict of the verify call before them, fitted to it on the device
(engine.spec_ahead.fit_next, model.verify_fit): the kernel equals its reference and the rule; the
engine gives plain decoding's tokens and verifies the same drafts at the same positions as with
fitting off, with requests ending at different lengths, cancelled while such a call is in flight,
and through the graphs' static buffers; sampled requests are not fitted."""

from __future__ import annotations

import pytest
import torch
from engine_cases import write_head
from engine_helpers import DEVICE, assert_others_plain_and_blocks_free, make_engine, run_and_cancel_once
from test_router_draft_after import _prompts, _proposals, _specs

from verifypd.domain.requests import SamplingParams
from verifypd.model.graph_runner import GraphRunner
from verifypd.model.kernels.fit import fit_kernel
from verifypd.model.verify_fit import fit_reference, fit_to_verdict


@pytest.fixture(scope="module")
def head(tiny_models, tmp_path_factory):
    # std 0.6: a head that is sometimes right on the tiny target (partial acceptance moves the rows)
    return write_head(tiny_models, tmp_path_factory.mktemp("verify_fit") / "head", std=0.6)


def _layout(rows: int, query: int, block_size: int, seed: int):
    """A left-aligned verify layout laid out for the longest outcome, a verdict and fitting rows."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda *shape, hi=50: torch.randint(0, hi, shape, generator=g)  # noqa: E731
    width = max(6, (query + 16) // block_size + 2)
    tables = ri(rows, width, hi=90) + 1
    vks = ri(rows, hi=5)
    vrows = torch.randperm(rows + 2, generator=g)[:rows]
    if rows > 1:
        vrows[-1], vks[-1] = -1, 0  # a padding row: left as it is
    verdict = ri(rows + 2, 2 + 4, hi=1000)
    for r in range(rows):
        verdict[vrows[r], 0] = int(ri(1, hi=int(vks[r]) + 1)[0]) if vrows[r] >= 0 else 0
    ids, positions, slots = (torch.zeros(rows * query, dtype=torch.long) for _ in range(3))
    for r in range(rows):
        n_real = int(ri(1, hi=query)[0]) + 1  # the row's tokens: pending + drafts
        start = int(vks[r]) + 1 + int(ri(1, hi=width * block_size - query - 6)[0])
        for c in range(query):
            j = min(c, n_real - 1)  # padding repeats the last real position
            positions[r * query + c] = start + j
            ids[r * query + c] = 500 + c
            slots[r * query + c] = (
                int(tables[r, (start + j) // block_size]) * block_size + (start + j) % block_size if c < n_real else -1
            )
    return ids, positions, slots, tables, vrows, vks, verdict


@pytest.mark.parametrize("rows, query, block_size, seed", [(1, 2, 4, 0), (4, 5, 4, 1), (8, 9, 16, 2), (3, 9, 2, 3)])
def test_fit_kernel_equals_reference_and_the_rule(rows, query, block_size, seed):
    ids, positions, slots, tables, vrows, vks, verdict = _layout(rows, query, block_size, seed)
    expected = [t.clone() for t in (ids, positions, slots)]
    fit_reference(*expected, tables, vrows, vks, verdict, query, block_size)
    got = [t.to(DEVICE, copy=True) for t in (ids, positions, slots)]
    dev = [t.to(DEVICE) for t in (tables, vrows, vks, verdict)]
    if got[0].is_cuda:
        fit_to_verdict(*got, *dev, query, block_size)
    else:  # the kernel itself, under the Triton interpreter (conftest sets TRITON_INTERPRET=1)
        fit_kernel[(rows,)](*got, *dev, verdict.stride(0), tables.stride(0), query, block_size, BLOCK=16)
    for name, a, b in zip(("ids", "positions", "slots"), got, expected):
        assert torch.equal(a.cpu(), b), name
    # The rule, row by row (the reference could be wrong the same way as the kernel).
    for r in range(rows):
        cells = slice(r * query, (r + 1) * query)
        new_ids, new_pos, new_slots = (t[cells].tolist() for t in expected)
        if vrows[r] < 0:
            assert (new_ids, new_pos, new_slots) == (
                ids[cells].tolist(),
                positions[cells].tolist(),
                slots[cells].tolist(),
            )
            continue
        shift = int(vks[r]) - int(verdict[vrows[r], 0])
        assert new_ids == [int(verdict[vrows[r], 1])] + ids[cells].tolist()[1:]
        assert new_pos == [p - shift for p in positions[cells].tolist()]
        for p, old, new in zip(new_pos, slots[cells].tolist(), new_slots):
            assert new == (-1 if old < 0 else int(tables[r, p // block_size]) * block_size + p % block_size)


def _engine(tiny_models, head, **kw):
    return make_engine(tiny_models[0], head, k=kw.pop("k", 4), **kw)


@pytest.mark.slow
@pytest.mark.parametrize("k, adaptive", [(1, False), (4, False), (3, True)])
def test_greedy_equals_plain_and_verifies_the_drafts_of_unfitted_calls(tiny_models, head, k, adaptive):
    prompts = _prompts(6, seed=20 + k)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    on, off = (_engine(tiny_models, head, k=k, adaptive=adaptive) for _ in range(2))
    off.router.ahead.fit = False
    seen_on, seen_off = _proposals(on), _proposals(off)
    for engine in (on, off):
        done = engine.generate(_specs(prompts))
        assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
        router = engine.router
        assert router.target_blocks.num_free == router.target_blocks.num_blocks  # nothing reserved is kept
    assert (on.router.ahead.fitted > 0 or adaptive) and off.router.ahead.fitted == 0
    common = [key for key in seen_on if key in seen_off]
    assert len(common) >= len(seen_on) // 2 > 0 or adaptive, (len(common), len(seen_on))
    for key in common:
        n = min(len(seen_on[key]), len(seen_off[key]))
        assert seen_on[key][:n] == seen_off[key][:n], key


def test_graphed_static_buffers_fit_as_eager(tiny_models, head):
    """The same calls through the target's graph runner (its static buffers; on the CPU the captured
    functions run directly over them): the fitted rows are rewritten there after the load's copy."""
    prompts = _prompts(5, seed=31)
    eager, graphed = (_engine(tiny_models, head, k=3) for _ in range(2))
    target = graphed.verify_lane.target
    eager.verify_lane.target.graphs = None
    if DEVICE == "cpu":
        target.graphs = GraphRunner(
            target.model, target.pool.tensor, target.block_size, target.staging, buckets=(1, 2, 4, 8), replay="eager"
        )
    outs = [{r: c.token_ids for r, c in e.generate(_specs(prompts)).items()} for e in (eager, graphed)]
    assert outs[0] == outs[1]
    assert eager.router.ahead.fitted > 0 and graphed.router.ahead.fitted > 0
    assert any(key[0] == "accept" for key in target.graphs._graphs)


def test_cancel_while_a_fitted_call_is_in_flight(tiny_models, head):
    prompts = _prompts(6, seed=5)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    router = _engine(tiny_models, head, k=4, num_blocks=60).router

    def in_fitted_call(router):  # a request of the fitted call in flight: its row is in two calls
        fitted = router.ahead.pending
        return fitted.work[0].seq.request_id if fitted is not None else None

    tokens, cancelled = run_and_cancel_once(router, _specs(prompts), in_fitted_call)
    assert cancelled is not None and router.ahead.fitted > 0
    assert_others_plain_and_blocks_free(router, tokens, cancelled, plain)


def test_sampled_requests_are_not_fitted(tiny_models, head):
    prompts = _prompts(4, seed=12)
    specs = lambda: _specs(prompts, sampling=SamplingParams(temperature=0.7, seed=7))  # noqa: E731
    plain = make_engine(tiny_models[0], "none", k=0).generate(specs())
    engine = _engine(tiny_models, head, k=4)
    done = engine.generate(specs())
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert engine.router.ahead.fitted == 0 and engine.router.draft_after.held > 0


@pytest.mark.slow
def test_a_quiet_prompt_lookup_lets_verify_calls_launch_ahead(tiny_models, head):
    """`eagle+ngram:` with lookup's proposals rarely taken: most steps skip lookup and their verify
    calls are fitted ahead, one step in CONSULT_EVERY still consults it; the tokens stay plain's."""
    from verifypd.spec_decode.lookup_mix import CONSULT_EVERY

    prompts = _prompts(6, seed=41)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    engine = _engine(tiny_models, "eagle+ngram:" + head.removeprefix("eagle:"), k=3)
    lookup = engine.router.lookup
    consulted = []
    take = lookup.take
    lookup.take = lambda work: consulted.append(len(work)) or take(work)
    lookup.rate = 0.0  # quiet from the start (a fresh mix is loud until its rate falls)
    done = engine.generate(_specs(prompts))
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    fitted = engine.router.ahead.fitted
    assert fitted > 0 and consulted, (fitted, consulted)
    if lookup.rate < 0.05:  # quiet throughout: at most CONSULT_EVERY - 1 fitted steps per consult
        assert fitted <= (CONSULT_EVERY - 1) * len(consulted)

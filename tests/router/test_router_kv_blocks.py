"""Paged-KV bookkeeping: no leaks, no double ownership, and an over-subscribed pool still
finishes every request with the right output (queueing or preemption-by-recompute)."""

from __future__ import annotations

import random

import pytest
from engine_helpers import VOCAB, make_engine

from verifypd.domain.requests import InvalidRequest, RequestSpec
from verifypd.router.block_manager import BlockManager


def test_block_manager_grow_trim_free_invariants():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = [], []
    assert bm.grow(a, 9) and len(a) == 3  # ceil(9 / 4)
    assert bm.grow(a, 12) and len(a) == 3  # still fits
    assert bm.grow(b, 20) and len(b) == 5
    bm.check([a, b])
    assert not bm.grow(b, 40) and len(b) == 5  # all-or-nothing: needs 5 more, 2 free
    bm.trim(a, 4)  # rollback to 4 positions keeps 1 block
    assert len(a) == 1 and bm.num_free == 4
    bm.check([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 10 and a == [] and b == []
    bm.check([])
    with pytest.raises(RuntimeError):
        bm._release(3)  # double free is caught


def _prompts(n, seed):
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 14))) for _ in range(n)]


def _check_pools(router):
    tables_t = [s.target_blocks for s in router.sequences()]
    tables_d = [s.draft_blocks for s in router.sequences()]
    router.target_blocks.check(tables_t)
    router.draft_blocks.check(tables_d)


@pytest.mark.slow
@pytest.mark.parametrize("num_blocks", [14, 24])
def test_oversubscribed_pool_finishes_everything_correctly(tiny_models, num_blocks):
    prompts = _prompts(10, seed=3)
    specs = [RequestSpec(p, max_tokens=20, stop_at_eos=False, request_id=f"r{i}") for i, p in enumerate(prompts)]
    roomy = make_engine(*tiny_models, k=4, num_blocks=512)
    expected = {rid: c.token_ids for rid, c in roomy.generate(specs).items()}

    tight = make_engine(*tiny_models, k=4, num_blocks=num_blocks)  # 4 tokens a block: ~2 requests fit
    router = tight.router
    for spec in specs:
        router.add_request(spec)
    got: dict[str, list[int]] = {}
    max_running = 0
    while router.has_work():
        for out in router.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        _check_pools(router)
        max_running = max(max_running, len(router.scheduler.running))
    assert got == expected
    assert max_running < len(specs)  # the pool really was the bottleneck
    assert router.target_blocks.num_used == 0 and router.draft_blocks.num_used == 0


@pytest.mark.slow
def test_preemption_by_recompute_happens_and_is_lossless(tiny_models):
    """Long generations in a pool too small for all of them at once force preemption."""
    prompts = _prompts(4, seed=5)
    specs = [RequestSpec(p, max_tokens=40, stop_at_eos=False, request_id=f"p{i}") for i, p in enumerate(prompts)]
    expected = {rid: c.token_ids for rid, c in make_engine(*tiny_models, k=4, num_blocks=512).generate(specs).items()}
    engine = make_engine(*tiny_models, k=4, num_blocks=30)
    preemptions = {}
    router = engine.router
    for spec in specs:
        router.add_request(spec)
    got: dict[str, list[int]] = {}
    while router.has_work():
        for out in router.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
            preemptions[out.request_id] = out.stats.preemptions
        _check_pools(router)
    assert got == expected
    assert sum(preemptions.values()) > 0
    assert router.target_blocks.num_used == 0 and router.draft_blocks.num_used == 0


def test_cancel_returns_blocks_immediately(tiny_models):
    engine = make_engine(*tiny_models, k=4, num_blocks=64)
    router = engine.router
    rids = [router.add_request(RequestSpec(p, max_tokens=30, stop_at_eos=False)) for p in _prompts(3, 9)]
    for _ in range(3):
        router.step()
    assert router.target_blocks.num_used > 0
    for rid in rids:
        router.abort(rid)
    assert router.target_blocks.num_used == 0 and router.draft_blocks.num_used == 0
    assert not router.has_work()


def test_request_that_can_never_fit_the_pool_is_rejected_up_front_not_truncated(tiny_models):
    engine = make_engine(*tiny_models, k=4, num_blocks=3)  # 12 positions in all
    # 5 + 40 positions can never be held: rejected, with a message saying why (it used to end
    # silently with `length` after a few tokens).
    with pytest.raises(InvalidRequest, match="can never fit the target KV pool"):
        engine.router.add_request(RequestSpec((5, 6, 7, 8, 9), max_tokens=40, stop_at_eos=False))
    with pytest.raises(InvalidRequest, match="never fit"):
        engine.router.add_request(RequestSpec(tuple(range(3, 20)), max_tokens=4))
    # Exactly the pool's capacity (prompt + max_tokens - 1 positions = 12) completes in full, k or not.
    done = engine.generate([RequestSpec((5, 6, 7, 8, 9), max_tokens=8, stop_at_eos=False, request_id="a")])
    assert done["a"].finish_reason == "length" and len(done["a"].token_ids) == 8
    assert engine.router.target_blocks.num_used == 0


@pytest.mark.slow
def test_requests_that_fit_alone_are_never_truncated_under_pressure(tiny_models):
    """Several requests that each fit alone but not together: all complete with max_tokens (they
    wait or are preempted; none is cut short)."""
    engine = make_engine(*tiny_models, k=4, num_blocks=6)  # 24 positions
    specs = [RequestSpec((5 + n, 6, 7), max_tokens=20, stop_at_eos=False, request_id=f"r{n}") for n in range(4)]
    done = engine.generate(specs)
    assert all(len(done[f"r{n}"].token_ids) == 20 and done[f"r{n}"].finish_reason == "length" for n in range(4))


def test_max_tokens_beyond_the_context_is_rejected_with_the_limit(tiny_models):
    engine = make_engine(*tiny_models, k=0)
    ctx = engine.router.max_context
    with pytest.raises(InvalidRequest, match=f"at most {ctx - 3}"):
        engine.router.add_request(RequestSpec((5, 6, 7), max_tokens=ctx))

"""A lane that dies mid-step must not leave the prefix cache pointing at KV that was never (or no
longer is) written: after a recovery (Router.reset_kv) a request that shares a cached prefix is
recomputed and decodes exactly as a fault-free run does. Two faults, in process: the prefill lane
writes garbage over its blocks and dies before replying (killed mid-write), and the pool owner
restarts (its pool comes back zeroed) while cached blocks are registered."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_engine

from verifypd.domain.lanes import LaneError
from verifypd.domain.requests import RequestSpec

pytestmark = pytest.mark.slow  # two engines decoding on the tiny models (tests/README.md)

PREFIX = [7, 19, 23, 4, 88, 61, 5, 5, 40, 12, 9, 77, 3, 50, 21, 64]  # 4 full blocks of 4


def spec(rid: str, tail: list[int]) -> RequestSpec:
    return RequestSpec(PREFIX + tail, max_tokens=10, stop_at_eos=False, request_id=rid)


TAILS = {"a": [31, 8], "b": [31, 9, 10], "c": [2, 2, 2, 2, 2], "d": [44]}


@pytest.fixture(scope="module")
def reference(tiny_models):
    engine = make_engine(*tiny_models, k=0, prefix_cache=False)
    done = engine.generate([spec(rid, tail) for rid, tail in TAILS.items()])
    return {rid: c.token_ids for rid, c in done.items()}


def run(router, specs) -> dict[str, list[int]]:
    tokens = {router.add_request(s): [] for s in specs}
    while router.has_work():
        for out in router.step():
            tokens[out.request_id] += out.token_ids
    return tokens


class DiesMidWrite:
    """The prefill lane: writes its KV, then garbage over every block it was given, then dies."""

    def __init__(self, lane, pool: torch.Tensor):
        self.lane, self.pool, self.armed = lane, pool, True

    def __getattr__(self, name):
        return getattr(self.lane, name)

    def prefill(self, items):
        if not self.armed:
            return self.lane.prefill(items)
        self.armed = False
        self.lane.prefill(items)
        for item in items:
            for block in item.target_kv.block_ids:
                self.pool[:, :, block] = 1e4
        raise LaneError("prefill lane killed mid-step")


def test_prefill_lane_killed_mid_write_leaves_no_cached_garbage(tiny_models, reference):
    engine = make_engine(*tiny_models, k=3)
    router = engine.router
    assert router.context.prefix is not None, "the prefix cache is on by default"
    assert run(router, [spec("a", TAILS["a"])]) == {"a": reference["a"]}
    assert router.context.target_blocks.num_cached >= 4  # the shared prefix is cached
    pool = router.prefill_lane.target.pool.tensor
    router.prefill_lane = DiesMidWrite(router.prefill_lane, pool)
    tokens = {router.add_request(spec("b", TAILS["b"])): [], router.add_request(spec("c", TAILS["c"])): []}
    with pytest.raises(LaneError):
        while router.has_work():
            for out in router.step():
                tokens[out.request_id] += out.token_ids
    router.reset_kv()  # what the engine loop does once the lanes serve again
    assert router.context.target_blocks.num_cached == 0
    while router.has_work():
        for out in router.step():
            tokens[out.request_id] += out.token_ids
    tokens.update(run(router, [spec("d", TAILS["d"])]))  # hits the prefix cached after the recovery
    assert tokens == {r: reference[r] for r in ("b", "c", "d")}
    router.close()


def test_pool_owner_restarted_with_cached_blocks(tiny_models, reference):
    engine = make_engine(*tiny_models, k=3)
    router = engine.router
    assert run(router, [spec("a", TAILS["a"]), spec("b", TAILS["b"])]) == {r: reference[r] for r in "ab"}
    assert router.context.target_blocks.num_cached >= 4
    # The owners restart: their pools come back as new memory (zeros here), the old KV is gone.
    router.prefill_lane.target.pool.tensor.zero_()
    draft_pool = router.prefill_lane.draft.pool.tensor
    draft_pool.zero_()
    router.reset_kv()
    assert router.context.target_blocks.num_cached == 0
    assert run(router, [spec("c", TAILS["c"]), spec("d", TAILS["d"])]) == {r: reference[r] for r in "cd"}
    router.close()

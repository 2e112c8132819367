"""The direct KV transport in a prefill lane (lane_server's ImportPools, lanes/rpc/peer_copy.py), with
the lanes in this process on the CPU and the owners' pools in /dev/shm. The owners are faked onto
another GPU (not co-located, reachable as a peer) so that `auto` chooses as it does across GPUs: owner
pools larger than the prefill lane's bound (lane_setup.pool_blocks) are written directly (the forward
lands in the owners' memory; nothing is staged or copied), pools that fit are staged and copied (peer).
Either way the owners end up holding the same KV.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from services_helpers import engine_options

from verifypd.lanes.rpc import kv_transport as kv
from verifypd.lanes.rpc import peer_copy
from verifypd.lanes.rpc.lane_setup import pool_blocks
from verifypd.v1 import generate_pb2, lanes_pb2

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # BLOCK_SIZE 4: blocks 3, 1, 6 of each pool
BLOCKS = [3, 1, 6]
CPU = torch.device("cpu")


class Context:
    """What the RPCs use of a grpc.ServicerContext."""

    def abort(self, code: grpc.StatusCode, details: str):
        raise AssertionError(f"{code.name}: {details}")

    def invocation_metadata(self):
        return ()


@pytest.fixture(scope="module")
def prefill(tiny_models):
    from verifypd.lanes.rpc.lane_server import LaneServicer

    servicer = LaneServicer("prefill", engine_options(*tiny_models, num_blocks=None))  # bound: what memory allows
    yield servicer
    servicer.close()


def owners(tiny_models, num_blocks: int):
    from verifypd.lanes.rpc.lane_server import LaneServicer

    options = engine_options(*tiny_models, num_blocks=num_blocks)
    return [LaneServicer(role, options) for role in ("verify", "draft")]


def prefill_batch(descriptors: dict[str, lanes_pb2.PoolDescriptor]) -> lanes_pb2.PrefillBatch:
    def handle(role: str) -> lanes_pb2.KvHandle:
        d = descriptors[role]
        return lanes_pb2.KvHandle(pool_id=d.pool_id, generation=d.generation, block_ids=BLOCKS, seq_len=0)

    item = lanes_pb2.PrefillItem(
        request_id="a",
        token_ids=PROMPT,
        start_pos=0,
        target_kv=handle("target"),
        draft_kv=handle("draft"),
        is_last_chunk=True,
        sampling=lanes_pb2.LaneSampling(params=generate_pb2.SamplingParams(temperature=0.0), seed=7),
    )
    return lanes_pb2.PrefillBatch(items=[item])


def wire_and_prefill(prefill, pool_owners, monkeypatch) -> tuple[dict[str, str], int, dict[str, torch.Tensor]]:
    """ImportPools (auto) and one prefill; returns the modes, the bytes copied and each owned pool's
    KV at the prefilled blocks."""
    monkeypatch.setattr(peer_copy, "colocated", lambda d, device: False)  # the owners: "another GPU"
    descriptors = {}
    for owner in pool_owners:
        (pool,) = owner.owned.values()
        descriptors[pool.role] = kv.describe_pool(pool)
    reply = prefill.ImportPools(
        lanes_pb2.ImportPoolsRequest(pools=list(descriptors.values()), kv_transport="auto"), Context()
    )
    for pool in (p for owner in pool_owners for p in owner.owned.values()):
        assert torch.all(pool.tensor == 0)  # nothing written yet
    result = prefill.Prefill(prefill_batch(descriptors), Context())
    assert len(result.outputs) == 1 and result.outputs[0].HasField("first_token")
    written = {}
    for pool in (p for owner in pool_owners for p in owner.owned.values()):
        untouched = [b for b in range(pool.geometry.num_blocks) if b not in BLOCKS]
        assert torch.all(pool.tensor[:, :, untouched] == 0)  # only this prefill's blocks
        written[pool.role] = pool.tensor[:, :, BLOCKS].clone()
    return {role: reply.mode_by_pool[d.pool_id] for role, d in descriptors.items()}, result.kv_bytes_copied, written


def test_auto_writes_directly_where_staging_would_exceed_the_lane_bound_and_stages_where_it_fits(
    tiny_models, prefill, monkeypatch, caplog
):
    caplog.set_level("INFO", logger="verifypd.lane.kv")
    # The prefill lane's bound for each pool; the owners' pools within it, then above it.
    small = owners(tiny_models, 64)
    try:
        for owner in small:
            (pool,) = owner.owned.values()
            assert pool.geometry.num_blocks <= pool_blocks(prefill.options, pool.geometry, CPU, pool.dtype)
        modes, copied, staged = wire_and_prefill(prefill, small, monkeypatch)
        assert modes == {"target": "peer", "draft": "peer"}
        assert copied > 0
    finally:
        for owner in small:
            owner.close()
    large = owners(tiny_models, 5000)
    try:
        for owner in large:
            (pool,) = owner.owned.values()
            assert pool.geometry.num_blocks > pool_blocks(prefill.options, pool.geometry, CPU, pool.dtype)
        modes, copied, direct = wire_and_prefill(prefill, large, monkeypatch)
        assert modes == {"target": "direct", "draft": "direct"}
        assert copied == 0  # written where the owners read it: nothing staged, nothing copied
        assert "direct transport (a 5000-block staging pool exceeds this lane's" in caplog.text
        assert not prefill.peers and not prefill.pushers
    finally:
        for owner in large:
            owner.close()
    for role in ("target", "draft"):
        assert not torch.all(direct[role] == 0)  # real KV
        assert torch.equal(direct[role], staged[role]), role  # the same KV as staged and copied

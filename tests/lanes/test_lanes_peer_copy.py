"""The peer KV transport's copier (lanes/rpc/peer_copy.py) on the CPU: a prefill forward into a staging
pool copies each layer's touched blocks into the owner's pool as soon as the forward announces that
layer (before the next layer runs), to the same block ids, and nothing else; a forward that announces
no layers (a CUDA graph replay) is caught up by `finish()`. Which pools the transport can reach, too.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import VOCAB

from verifypd.lanes.rpc import peer_copy
from verifypd.lanes.rpc.kv_transport import describe_pool, touched_blocks
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.layout import TokenRun
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import load_model
from verifypd.model.runner import ModelRunner

CPU = torch.device("cpu")
BLOCK, NUM_BLOCKS = 4, 64


@pytest.fixture(scope="module")
def model(tiny_models):
    loaded = load_model(tiny_models[0], CPU, torch.float32)
    return PagedLlama(loaded.shape, loaded.weights)


def pools(model: PagedLlama) -> tuple[KvPool, KvPool]:
    s = model.shape
    g = PoolGeometry(model.num_layers, NUM_BLOCKS, BLOCK, s.num_kv_heads, s.head_dim)
    owner = KvPool("target", g, torch.float32, CPU)
    owner.tensor.fill_(-7.0)  # an owner's other blocks hold other requests' KV: must stay untouched
    staging = KvPool("target", g, torch.float32, CPU, pool_id=owner.pool_id, owner=False)
    return staging, owner


def prefill(model: PagedLlama, staging: KvPool, copier: peer_copy.PeerCopier, runs: list[TokenRun]) -> int:
    runner = ModelRunner(model, staging, graphs=False)
    blocks = [b for r in runs for b in touched_blocks(r.block_ids, r.start_pos, r.start_pos + len(r.token_ids), BLOCK)]
    copier.begin(blocks)
    model.after_layer_kv = copier.layer_written
    try:
        runner.forward(runs, "last")
    finally:
        model.after_layer_kv = None
    return copier.finish()


def test_each_layer_lands_in_the_owners_blocks_before_the_next_layer_runs(model):
    staging, owner = pools(model)
    copier = peer_copy.PeerCopier(staging, owner)
    seen_before: list[bool] = []  # at layer i's announcement: layers < i already in the owner's pool
    hook = copier.layer_written

    def watch(layer: int) -> None:
        seen_before.append(all(torch.equal(owner.tensor[:, j, 5], staging.tensor[:, j, 5]) for j in range(layer)))
        hook(layer)

    copier.layer_written = watch  # type: ignore[method-assign]
    rng = random.Random(1)
    runs = [
        TokenRun([rng.randrange(3, VOCAB) for _ in range(13)], 0, (5, 9, 2, 30)),  # 13 tokens: 4 blocks
        TokenRun([rng.randrange(3, VOCAB) for _ in range(6)], 0, (11, 40)),
    ]
    nbytes = prefill(model, staging, copier, runs)
    touched = [5, 9, 2, 30, 11, 40]
    assert nbytes == len(touched) * staging.geometry.bytes_per_block(torch.float32)
    assert seen_before == [True] * model.num_layers  # per layer, not all at the end
    stats = copier.collect()
    assert stats is not None and stats.layers_hooked == model.num_layers and stats.blocks == len(touched)
    for b in range(NUM_BLOCKS):
        if b in touched:
            assert torch.equal(owner.tensor[:, :, b], staging.tensor[:, :, b]), b
            assert not torch.all(owner.tensor[:, :, b] == 0)  # real KV, not an empty staging block
        else:
            assert torch.all(owner.tensor[:, :, b] == -7.0), f"block {b} was not written by this prefill"


def test_a_forward_without_announcements_is_copied_by_finish(model):
    """A prefill graph replay calls no hook: every layer is copied after the forward instead."""
    staging, owner = pools(model)
    copier = peer_copy.PeerCopier(staging, owner)
    copier.begin([3, 4])
    ModelRunner(model, staging, graphs=False).forward([TokenRun([7, 8, 9, 10, 11], 0, (3, 4))], None)
    assert copier.finish() > 0
    assert copier.last is not None and copier.last.layers_hooked == 0
    assert torch.equal(owner.tensor[:, :, [3, 4]], staging.tensor[:, :, [3, 4]])
    assert copier.finish() == 0  # disarmed: a second finish copies nothing


def test_a_chunk_after_a_prefix_copies_only_its_blocks(model):
    staging, owner = pools(model)
    copier = peer_copy.PeerCopier(staging, owner)
    prompt = list(range(3, 3 + 11))
    prefill(model, staging, copier, [TokenRun(prompt[:8], 0, (20, 21, 22))])  # blocks 20, 21
    owner.tensor[:, :, 20] = -7.0  # the owner's copy of the first chunk's block 20, marked
    prefill(model, staging, copier, [TokenRun(prompt[8:], 8, (20, 21, 22))])  # positions 8..10: block 22
    assert torch.all(owner.tensor[:, :, 20] == -7.0)  # not re-sent
    assert torch.equal(owner.tensor[:, :, 22], staging.tensor[:, :, 22])


def test_geometry_mismatch_is_refused(model):
    staging, owner = pools(model)
    other = KvPool("target", PoolGeometry(model.num_layers, 8, BLOCK, 1, 4), torch.float32, CPU)
    with pytest.raises(ValueError, match="geometry"):
        peer_copy.PeerCopier(staging, other)
    peer_copy.PeerCopier(staging, owner)


def test_reachability(model):
    s = model.shape
    g = PoolGeometry(model.num_layers, 4, BLOCK, s.num_kv_heads, s.head_dim)
    shared = KvPool.create_shared_cpu("target", g, torch.float32)
    try:
        d = describe_pool(shared)
        assert peer_copy.unreachable(d, CPU) is None
        opened = peer_copy.open_owner_pool(d, CPU)
        opened.tensor[0, 0, 1].fill_(3.0)
        assert torch.all(shared.tensor[0, 0, 1] == 3.0)  # the same bytes
        d.host_boot_id = "another-host"
        assert "another host" in (peer_copy.unreachable(d, CPU) or "")
        private = describe_pool(KvPool("target", g, torch.float32, CPU))  # no /dev/shm file
        assert "not in /dev/shm" in (peer_copy.unreachable(private, CPU) or "")
    finally:
        shared.close()


def test_nixl_detection_is_a_plain_bool():
    assert peer_copy.nixl_available() in (True, False)


def test_choose_transport(model):
    s = model.shape
    g = PoolGeometry(model.num_layers, 4, BLOCK, s.num_kv_heads, s.head_dim)
    shared = KvPool.create_shared_cpu("target", g, torch.float32)
    try:
        d = describe_pool(shared)
        asks = ("auto", "handle", "peer", "direct", "copy")
        got = {asked: peer_copy.choose_transport(asked, d, CPU) for asked in asks}
        assert got == {"auto": "imported", "handle": "imported", "peer": "peer", "direct": "direct", "copy": "copy"}
        d.host_boot_id = "another-host"
        assert peer_copy.choose_transport("auto", d, CPU) == "copy"
        for asked, words in (
            ("handle", "another host or device"),
            ("peer", "kv_transport peer: the owner runs"),
            ("direct", "kv_transport direct: the owner runs"),
        ):
            with pytest.raises(ValueError, match=words):
                peer_copy.choose_transport(asked, d, CPU)
    finally:
        shared.close()


def test_auto_stages_where_the_stage_fits_and_writes_directly_where_not(model, monkeypatch, caplog):
    """An owner on another GPU (faked: not co-located, reachable): auto stages (peer) while a pool as
    large as the owner's fits this lane's bound, and writes the owner's pool directly otherwise; a
    transport asked for by name is what the lane gets, whatever the bound."""
    s = model.shape
    g = PoolGeometry(model.num_layers, 40, BLOCK, s.num_kv_heads, s.head_dim)
    d = describe_pool(KvPool("target", g, torch.float32, CPU))
    monkeypatch.setattr(peer_copy, "colocated", lambda d, device: False)
    monkeypatch.setattr(peer_copy, "unreachable", lambda d, device: None)
    gpu = torch.device("cuda", 0)  # a label only: nothing touches a device
    caplog.set_level("INFO", logger="verifypd.lane.kv")
    assert peer_copy.choose_transport("auto", d, gpu) == "peer"  # no bound
    assert peer_copy.choose_transport("auto", d, gpu, stage_bound=40) == "peer"
    assert peer_copy.choose_transport("auto", d, gpu, stage_bound=39) == "direct"
    assert f"pool {d.pool_id}: direct transport (a 40-block staging pool exceeds this lane's 39 blocks)" in caplog.text
    assert peer_copy.choose_transport("peer", d, gpu, stage_bound=1) == "peer"
    assert peer_copy.choose_transport("direct", d, gpu, stage_bound=None) == "direct"

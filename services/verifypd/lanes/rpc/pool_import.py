"""ImportPools, lane side: what a lane opens of its peers' memory when the lanes are wired.

A prefill lane checks each owner's pool descriptor against its own models (lane_validate.py), chooses
the pool's KV transport (peer_copy.choose_transport) and opens the pool for it: the owner's pool
itself (imported), a local staging pool and a KvPusher (copy) or a PeerCopier (peer), or the owner's
pool mapped into this lane's GPU (direct). The follower ranks of a sharded prefill lane open the
verify lane's rank shards. A verify lane opens the draft lane's DraftHandoff buffer.

Every refusal is a `LaneInvalid` with its status code, which the servicer (lane_server.py) aborts the
RPC with: a bad request INVALID_ARGUMENT, a pool this lane cannot reach FAILED_PRECONDITION.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import torch

from verifypd.domain.options import KV_TRANSPORTS, EngineOptions
from verifypd.lanes.rpc import kv_transport as kv
from verifypd.lanes.rpc import lane_convert as lc
from verifypd.lanes.rpc import lane_validate as lv
from verifypd.lanes.rpc import peer_copy
from verifypd.lanes.rpc.draft_handoff import OpenedHandoff
from verifypd.lanes.rpc.lane_setup import model_geometry, pool_blocks
from verifypd.model.kv_pool import LAYOUT, SHM_DIR, KvPool
from verifypd.model.llama import PagedLlama
from verifypd.net.auth import lane_metadata
from verifypd.v1 import lanes_pb2

if TYPE_CHECKING:
    from verifypd.lanes.tensor_parallel.ranks import LeaderRanks
    from verifypd.net.lane_tls import LaneTls

MAX_PEER_POOL_BLOCKS = 1 << 22


@dataclass
class OpenedPools:
    """What ImportPools opened for a prefill lane, by pool role ("target", "draft")."""

    pools: dict[str, KvPool] = field(default_factory=dict)  # the pools its forward writes
    pushers: dict[str, kv.KvPusher] = field(default_factory=dict)  # copy transport to the owner
    peers: dict[str, peer_copy.PeerCopier] = field(default_factory=dict)  # peer transport to the owner
    modes: dict[str, str] = field(default_factory=dict)  # pool id -> its transport


def pool_spec(model: PagedLlama, options: EngineOptions, kv_dtype: torch.dtype) -> lv.PoolSpec:
    """What this lane expects of a peer's pool for `model`."""
    geometry = model_geometry(model, options)
    # The bound on a peer's pool: --num-blocks, else a sanity cap. Not this lane's free memory: an
    # imported pool allocates nothing here, and the owners have already taken theirs (a staging
    # pool that does not fit fails to allocate, FAILED_PRECONDITION).
    max_blocks = options.num_blocks if options.num_blocks is not None else MAX_PEER_POOL_BLOCKS
    return lv.PoolSpec(
        geometry.num_layers,
        geometry.num_kv_heads,
        geometry.head_dim,
        geometry.block_size,
        kv.dtype_name(kv_dtype),  # the KV's element type (`--kv-cache-dtype`), not the weights'
        kv_dtype.itemsize,
        max_blocks,
    )


def open_pools(
    request: lanes_pb2.ImportPoolsRequest,
    models: dict[str, PagedLlama],
    options: EngineOptions,
    device: torch.device,
    kv_dtype: torch.dtype,
    ranks: LeaderRanks | None,
    secret: str | None,
    tls: LaneTls | None,
) -> OpenedPools:
    """Opens the pools `request` names for a prefill lane running `models` (by pool role: no "draft"
    for a pool-less draft) on `device`; `secret` and `tls` go with its KV pushes (copy transport)."""
    mode_arg = request.kv_transport or "auto"
    if mode_arg not in KV_TRANSPORTS:
        raise lv.LaneInvalid(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}; got {mode_arg!r}")
    # A re-wiring (an owner restarted: new pools) forgets the old mappings; the copiers still wired
    # hold theirs until they are replaced below, so an owner's memory goes with its last user.
    peer_copy.release_mapped()
    opened = OpenedPools()
    roles = [lc.ROLE_FROM_PB.get(d.role, "") for d in request.pools]  # "": no pool role (refused below)
    if "draft" not in models:  # pool-less draft (prompt lookup): the prefill lane writes no draft KV
        if roles != ["target"]:
            raise lv.LaneInvalid(f"pools: need one target pool (draft {options.draft!r} has no pool)")
    elif sorted(roles) != ["draft", "target"]:
        raise lv.LaneInvalid("pools: need one target and one draft pool")
    for n, (d, role) in enumerate(zip(request.pools, roles)):
        lv.check_pool_descriptor(f"pools[{n}]", d, role, pool_spec(models[role], options, kv_dtype), LAYOUT, SHM_DIR)
        try:
            bound = pool_blocks(options, kv.geometry_of(d), device, kv_dtype)
            mode = peer_copy.choose_transport(mode_arg, d, device, stage_bound=bound)
        except ValueError as exc:
            raise lv.LaneInvalid(str(exc), grpc.StatusCode.FAILED_PRECONDITION) from None
        opened.modes[d.pool_id] = mode
        try:
            if mode == "imported":
                opened.pools[role] = kv.open_pool(d)
            elif mode == "peer":
                opened.pools[role] = kv.staging_pool(d, device)
                opened.peers[role] = peer_copy.PeerCopier(opened.pools[role], peer_copy.open_owner_pool(d, device))
            elif mode == "direct":  # the forward writes the owner's pool, mapped here
                opened.pools[role] = peer_copy.open_owner_pool(d, device)
            else:
                opened.pools[role] = kv.staging_pool(d, device)
                opened.pushers[role] = kv.KvPusher(
                    opened.pools[role], d.kv_transfer_addr, metadata=lane_metadata(secret), tls=tls
                )
        except (ValueError, OSError, RuntimeError) as exc:
            raise lv.LaneInvalid(f"cannot open pool {d.pool_id}: {exc}", grpc.StatusCode.FAILED_PRECONDITION) from None
    if ranks is not None:
        target_d = next(d for d, role in zip(request.pools, roles) if role == "target")
        spec = pool_spec(models["target"], options, kv_dtype)
        import_rank_shards(ranks, target_d, opened.modes[target_d.pool_id], options.tensor_parallel, spec)
    return opened


def import_rank_shards(
    ranks: LeaderRanks, d: lanes_pb2.PoolDescriptor, mode: str, world: int, spec: lv.PoolSpec
) -> None:
    """A sharded prefill lane: follower r opens the verify lane's rank r pool (handle only)."""
    if mode != "imported":
        raise lv.LaneInvalid(
            f"--tensor-parallel {world}: the prefill lane's ranks must import the target pool "
            "(same host and devices); copying sharded KV is not supported",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    if len(d.rank_shards) != world - 1:
        raise lv.LaneInvalid(
            f"pool {d.pool_id} has {len(d.rank_shards)} rank shards; this prefill lane runs "
            f"--tensor-parallel {world} (the verify lane must run the same)",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    for n, shard in enumerate(d.rank_shards):  # checked as the rank-0 pool is, before a follower maps it
        lv.check_pool_descriptor(f"pools[target].rank_shards[{n}]", shard, "target", spec, LAYOUT, SHM_DIR)
    try:
        ranks.import_pool([s.SerializeToString() for s in d.rank_shards])
    except RuntimeError as exc:
        raise lv.LaneInvalid(
            f"cannot open the rank shards of {d.pool_id}: {exc}", grpc.StatusCode.FAILED_PRECONDITION
        ) from None


def open_handoff(d: lanes_pb2.DraftHandoff, device: torch.device) -> OpenedHandoff:
    """The verify lane opens the draft lane's DraftHandoff buffer (CUDA, same device only)."""
    if device.type != "cuda":
        raise lv.LaneInvalid("draft_handoff: this verify lane runs on the CPU", grpc.StatusCode.FAILED_PRECONDITION)
    try:
        return OpenedHandoff(d, device)
    except (ValueError, RuntimeError) as exc:
        raise lv.LaneInvalid(f"draft_handoff: cannot open: {exc}", grpc.StatusCode.FAILED_PRECONDITION) from None

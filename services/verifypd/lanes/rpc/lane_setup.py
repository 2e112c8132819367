"""What a lane process loads and owns at start: its models and its KV pools. Used by lane_server."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from verifypd.domain.models import DraftSpec, ModelLoadError, draft_spec
from verifypd.domain.options import EngineOptions
from verifypd.model.build import load_draft_model, pool_window, resolve_device, resolve_dtype
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.kv_quant import kv_cache_dtype
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import LoadedModel, load_model

if TYPE_CHECKING:
    from verifypd.lanes.tensor_parallel.ranks import LeaderRanks

log = logging.getLogger("verifypd.lane")


class LaneModels(NamedTuple):
    target: LoadedModel | None  # the target as loaded (its tokenizer, eos ids); rank 0's shard with ranks
    target_model: PagedLlama | None  # the lanes that run the target: prefill, verify
    draft_model: PagedLlama | None  # the lanes that run a draft model: prefill, draft
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV pools' (`--kv-cache-dtype`, model.kv_quant)


def load_lane_models(options: EngineOptions, need_target: bool, need_draft: bool) -> LaneModels:
    """The lane's models (each None where the lane needs none). With --tensor-parallel N the target
    is rank 0's shard (start_lane_ranks starts the others)."""
    spec = draft_spec(options.draft)
    if spec.kind == "eagle":  # docs/engine.md "Feature drafts": split lanes would need a shared feature pool
        raise _colocated_only(spec)
    if options.tensor_parallel != 1 and need_target:
        return load_lane_shard(options, spec, need_draft)
    need_draft = need_draft and spec.needs_model  # pool-less drafts (ngram, none) load nothing
    device = resolve_device(options.device) if (need_target or need_draft) else torch.device("cpu")
    if device.type == "cuda" and device.index is not None:  # a lane on its own GPU (--lane-devices):
        torch.cuda.set_device(device)  # loading and graph capture on this thread run there
    dtype = resolve_dtype(options.dtype, device)
    kv_dtype = kv_cache_dtype(options.kv_cache_dtype, dtype, device)  # a bad flag fails before loading
    self_draft = spec.kind == "self"
    target = (
        load_model(options.target, device, dtype, options.max_context, options.quantization)
        if (need_target or (need_draft and self_draft))
        else None
    )
    target_model = PagedLlama(target.shape, target.weights) if need_target and target is not None else None
    draft_model = lane_draft_model(spec, target, device, dtype, options.max_context) if need_draft else None
    return LaneModels(target, target_model, draft_model, device, dtype, kv_dtype)


def _colocated_only(spec: DraftSpec) -> ModelLoadError:
    return ModelLoadError(f"--draft {spec.text} runs co-located only (`verifypd serve` without split lanes)")


def lane_draft_model(
    spec: DraftSpec, target: LoadedModel | None, device: torch.device, dtype: torch.dtype, max_context: int | None
) -> PagedLlama | None:
    """The draft model of a lane (a model draft: never a feature draft, which load_lane_models refuses)."""
    draft = load_draft_model(spec, target, device, dtype, max_context)
    if draft is not None and not isinstance(draft, PagedLlama):
        raise _colocated_only(spec)
    return draft


def pool_blocks(options: EngineOptions, geometry: PoolGeometry, device, dtype) -> int:
    """Blocks of a pool with this geometry and element type: `--num-blocks`, else what memory allows. Also the
    bound on pools a peer asks this lane to import or stage (ImportPools)."""
    if options.num_blocks is not None:
        return options.num_blocks
    per_block = geometry.bytes_per_block(dtype)
    if device.type == "cuda":  # the GPU's free memory, shared by the lane processes placed on it
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * options.gpu_memory_fraction / options.device_lanes) // per_block
    return min(4096, max(256, (1 << 29) // per_block))


def model_geometry(model: PagedLlama, options: EngineOptions) -> PoolGeometry:
    s = model.shape
    return PoolGeometry(model.num_layers, 1, options.block_size, s.num_kv_heads, s.head_dim)


def owned_pool(
    role: str,
    model: PagedLlama,
    options: EngineOptions,
    device: torch.device,
    dtype: torch.dtype,
    generation: int = 1,
    ranks: LeaderRanks | None = None,
) -> KvPool:
    """A pool of element type `dtype` (the KV dtype). `ranks` (a sharded target): num_blocks is the
    smallest of the ranks' budgets."""
    geometry = model_geometry(model, options)
    blocks = pool_blocks(options, geometry, device, dtype)
    geometry = replace(geometry, num_blocks=ranks.agreed_blocks(blocks) if ranks is not None else blocks)
    if device.type == "cpu":  # /dev/shm so the prefill lane can map the same bytes
        pool = KvPool.create_shared_cpu(role, geometry, dtype)
    else:
        pool = KvPool(role, geometry, dtype, device)
    pool.generation = generation
    pool.window = pool_window(model)  # PoolInfo.window: the router frees behind a window all layers share
    log.info("%s", pool.summary())
    return pool


def load_lane_shard(options: EngineOptions, spec: DraftSpec, need_draft: bool) -> LaneModels:
    """load_lane_models for a target over `options.tensor_parallel` ranks: rank 0's shard."""
    from verifypd.lanes.tensor_parallel import ranks as tp_ranks
    from verifypd.model.tensor_parallel import load_target_shard, shard_shape

    world = options.tensor_parallel
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    kv_dtype = kv_cache_dtype(options.kv_cache_dtype, dtype, device)
    tp_ranks.check_devices(device, world, options.tp_all_reduce)
    if need_draft and spec.kind == "self":
        raise ModelLoadError(
            f"--draft {spec.text} runs on the target's own weights, which --tensor-parallel "
            f"{world} splits across ranks: use a draft model, ngram or none"
        )
    target = load_target_shard(options.target, 0, world, device, dtype, options.max_context, options.quantization)
    target_model = PagedLlama(shard_shape(target.shape, world), target.weights)
    draft_model = (
        lane_draft_model(spec, target, device, dtype, options.max_context) if need_draft and spec.needs_model else None
    )
    return LaneModels(target, target_model, draft_model, device, dtype, kv_dtype)


def start_lane_ranks(
    role: str,
    options: EngineOptions,
    target_model: PagedLlama,
    device: torch.device,
    dtype: torch.dtype,
    generation: int,
) -> LeaderRanks:
    """The follower ranks of a lane's sharded target: the verify lane's own a shared pool each (their
    descriptors become the pool's rank_shards), the prefill lane's open the verify lane's on ImportPools."""
    from verifypd.lanes.tensor_parallel.assembly import follower_options
    from verifypd.lanes.tensor_parallel.ranks import LeaderRanks

    mode = "shared" if role == "verify" else "import"
    ranks = LeaderRanks(options.tensor_parallel, device, follower_options(options, dtype, mode, generation))
    target_model.tp_group = ranks.group
    return ranks

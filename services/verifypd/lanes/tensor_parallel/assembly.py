"""Assembling a target over `--tensor-parallel N` ranks: rank 0's shard in this process, the
followers started (ranks.py), and what a follower needs to build the same runner.
"""

from __future__ import annotations

import torch

from verifypd.domain.models import ModelLoadError, draft_spec
from verifypd.domain.options import EngineOptions
from verifypd.lanes.tensor_parallel import ranks as tp_ranks
from verifypd.model.build import Models, load_draft_model, resolve_device, resolve_dtype
from verifypd.model.kv_quant import kv_cache_dtype
from verifypd.model.llama import PagedLlama
from verifypd.model.tensor_parallel import load_target_shard, shard_shape


def load_tensor_parallel(options: EngineOptions) -> Models:
    """Rank 0 of a target sharded over `options.tensor_parallel` processes: its shard, the started
    followers, and the draft (whole, on rank 0's device). An EAGLE head reads the features rank 0's
    forwards write (core.assembly attaches them): the residual stream is whole after each all-reduce,
    and the embeddings and lm_head it shares are replicated. A bad head fails before any follower starts."""
    spec = draft_spec(options.draft)  # a bad --draft fails before anything starts
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    world = options.tensor_parallel
    kv_dtype = kv_cache_dtype(options.kv_cache_dtype, dtype, device)
    tp_ranks.check_devices(device, world, options.tp_all_reduce)
    if spec.kind == "self":
        raise ModelLoadError(
            f"--draft {spec.text} runs on the target's own layers, which --tensor-parallel {world} "
            "splits across ranks: use a draft model, an EAGLE head (eagle:DIR), ngram or none"
        )
    # checks divisibility
    target = load_target_shard(options.target, 0, world, device, dtype, options.max_context, options.quantization)
    draft_model = load_draft_model(spec, target, device, dtype, options.max_context)
    ranks = tp_ranks.LeaderRanks(world, device, follower_options(options, dtype, pool="private"))
    target_model = PagedLlama(shard_shape(target.shape, world), target.weights)
    target_model.tp_group = ranks.group
    return Models(target, target_model, draft_model, options.draft, device, dtype, ranks=ranks, kv_dtype=kv_dtype)


def follower_options(options: EngineOptions, dtype: torch.dtype, pool: str, generation: int = 1) -> dict:
    """What a follower rank needs to build the same target runner (follower.py's --options; `pool`:
    private | shared | import, see there)."""
    return dict(
        pool=pool,
        generation=generation,
        target=options.target,
        dtype=str(dtype).removeprefix("torch."),
        max_context=options.max_context,
        quantization=options.quantization,
        kv_cache_dtype=options.kv_cache_dtype,
        block_size=options.block_size,
        num_blocks=options.num_blocks,
        gpu_memory_fraction=options.gpu_memory_fraction,
        cuda_graphs=options.cuda_graphs,
        graph_buckets=list(options.graph_buckets) if options.graph_buckets else None,
        k_max=options.config.k_max,
        tp_all_reduce=options.tp_all_reduce,
    )

"""Tensor parallelism for PagedLlama (Megatron-style), behind a tiny process-group abstraction.

Each of `world` ranks holds one slice of every layer and runs the same forward on the same batch:

    qkv      column-parallel: rank r keeps its heads' q rows and its kv heads' k and v rows
    o        row-parallel:    the columns of its heads; partial sums -> all_reduce (1 per layer)
    gate_up  column-parallel: its slice of gate rows and of up rows (still [gate; up] stacked)
    down     row-parallel:    the matching columns; partial sums -> all_reduce (1 per layer)
    embed, lm_head, norms: replicated (every rank ends with the full logits)

A rank's model is an ordinary PagedLlama over `shard_shape` (its heads, its slice of the MLP) with
`tp_group` set: the forward all-reduces the attention and MLP outputs and nothing else changes. Its KV
pool holds only its kv heads (PoolGeometry with the rank shape's num_kv_heads), so block ids, slots
and block tables are the same on every rank: the torch-free engine and the lanes never see ranks.
World 1 is not sharded at all: PagedLlama.tp_group stays None and the forward is today's.

Sharding rules: heads % world == 0, kv_heads % world == 0 (kv heads are split, not replicated, so a
rank's q heads keep using the kv heads of their GQA group: head h uses kv head h // (heads / kv_heads),
and rank r owns heads [r*heads/w, (r+1)*heads/w) and kv heads [r*kv/w, (r+1)*kv/w)), and
intermediate_size % world == 0.
"""

from __future__ import annotations

import dataclasses

import torch

from verifypd.model.fp8 import Fp8Weight
from verifypd.model.fp8_load import quantize_layer
from verifypd.model.llama import LayerWeights, Linear, LlamaShape, LlamaWeights, TpGroup, unit_norms
from verifypd.model.loader import (
    LoadedModel,
    ModelLoadError,
    check_quantization,
    load_weights,
    open_checkpoint,
    random_shape,
)


class SingleRank:
    """World 1: nothing to reduce (shard_model then builds the unsharded model and sets no group)."""

    rank, world = 0, 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass


class TorchDistributedGroup:
    """A torch.distributed process group (gloo on CPU, NCCL on GPUs), already initialized."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist, self._group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._dist.all_reduce(tensor, group=self._group)

    def all_reduce_min(self, tensor: torch.Tensor) -> None:
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN, group=self._group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Rank `src`'s tensor into every rank's (same shape and dtype), in place."""
        self._dist.broadcast(tensor, src=src, group=self._group)  # src: a global rank (one group today)


def shard_shape(shape: LlamaShape, world: int) -> LlamaShape:
    """The shape one rank's PagedLlama runs: its heads, its kv heads, its slice of the MLP."""
    if world < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {world}")
    for field in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(shape, field) % world:
            raise ValueError(
                f"tensor parallel size {world} must divide {field} ({getattr(shape, field)}); "
                f"kv heads are split across ranks, not replicated"
            )
    moe = shape.moe
    if moe is not None and moe.intermediate_size % world:
        raise ValueError(
            f"tensor parallel size {world} must divide the experts' intermediate size ({moe.intermediate_size})"
        )
    return dataclasses.replace(
        shape,
        num_heads=shape.num_heads // world,
        num_kv_heads=shape.num_kv_heads // world,
        intermediate_size=shape.intermediate_size // world,
        moe=None if moe is None else dataclasses.replace(moe, intermediate_size=moe.intermediate_size // world),
    )


def shard_weights(shape: LlamaShape, weights: LlamaWeights, rank: int, world: int) -> LlamaWeights:
    """Rank `rank`'s slices of the full weights (views where contiguous, copies otherwise)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    local = shard_shape(shape, world)
    D = shape.head_dim
    q_rows, kv_rows = shape.num_heads * D, shape.num_kv_heads * D  # full q and k (= v) row counts
    q_local, kv_local, i_local = local.num_heads * D, local.num_kv_heads * D, local.intermediate_size
    # Row ranges of the fused qkv [(heads + 2 kv_heads) * D, H] that rank `rank` keeps, in q, k, v order.
    qkv_ranges = [
        (rank * q_local, q_local),
        (q_rows + rank * kv_local, kv_local),
        (q_rows + kv_rows + rank * kv_local, kv_local),
    ]
    gate_up_ranges = [(rank * i_local, i_local), (shape.intermediate_size + rank * i_local, i_local)]

    def rows(t: torch.Tensor, ranges) -> torch.Tensor:
        return torch.cat([t.narrow(0, start, n) for start, n in ranges]).contiguous()

    def cols(t: torch.Tensor, width: int) -> torch.Tensor:
        return t.narrow(1, rank * width, width).contiguous()

    def linear_rows(w: Linear, ranges) -> Linear:
        if isinstance(w, Fp8Weight):  # the rows keep their own scales
            return Fp8Weight(rows(w.weight, ranges), rows(w.scale, ranges), w.input_scale)
        return rows(w, ranges)

    def linear_cols(w: Linear, width: int) -> Linear:
        if isinstance(w, Fp8Weight):  # a row's scale covers any slice of its columns
            return Fp8Weight(cols(w.weight, width), w.scale, w.input_scale)
        return cols(w, width)

    def experts(m):
        # Every expert's slice of the intermediate dim: gate_up [E, 2I, H] rows, down [E, H, I] columns.
        assert shape.moe is not None and local.moe is not None
        full, part = shape.moe.intermediate_size, local.moe.intermediate_size
        gate_up = torch.cat([m.gate_up.narrow(1, start + rank * part, part) for start in (0, full)], 1)
        down = m.down.narrow(2, rank * part, part)
        return dataclasses.replace(m, gate_up=gate_up.contiguous(), down=down.contiguous())  # router replicated

    layers = [  # the q/k norms and the output norms are per head_dim / hidden: replicated (replace keeps them)
        dataclasses.replace(
            lw,
            qkv=linear_rows(lw.qkv, qkv_ranges),
            qkv_bias=None if lw.qkv_bias is None else rows(lw.qkv_bias, qkv_ranges),
            o=linear_cols(lw.o, q_local),
            gate_up=None if lw.gate_up is None else linear_rows(lw.gate_up, gate_up_ranges),
            down=None if lw.down is None else linear_cols(lw.down, i_local),
            moe=None if lw.moe is None else experts(lw.moe),
        )
        for lw in weights.layers
    ]
    return LlamaWeights(embed=weights.embed, layers=layers, final_norm=weights.final_norm, lm_head=weights.lm_head)


def shard_model(shape: LlamaShape, weights: LlamaWeights, group: TpGroup, **model_options):
    """Rank `group.rank`'s PagedLlama: sharded shape and weights, all-reducing over `group`.
    World 1 returns the unsharded model with no group (the single-GPU forward, no extra ops)."""
    from verifypd.model.llama import PagedLlama

    if group.world == 1:
        return PagedLlama(shape, weights, **model_options)
    local = shard_shape(shape, group.world)
    model = PagedLlama(local, shard_weights(shape, weights, group.rank, group.world), **model_options)
    model.tp_group = group
    return model


def check_tensor_parallel(shape: LlamaShape, world: int) -> LlamaShape:
    """shard_shape with the CLI's error: `--tensor-parallel N` that does not divide a field exits 2."""
    try:
        return shard_shape(shape, world)
    except ValueError as exc:
        raise ModelLoadError(f"--tensor-parallel {world}: {exc}") from None


def load_target_shard(
    spec: str,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    max_context: int | None,
    quantization: str | None = None,
) -> LoadedModel:
    """Rank `rank`'s target: the full shape (vocabulary, context, tokenizer, eos ids as the unsharded
    model), weights = this rank's shard on `device`. Raises ModelLoadError (exit 2) when `world` does
    not divide heads, kv heads or the intermediate size, before any weight is read.

    A checkpoint's tensors are read as this rank's slices straight onto `device` (loader.load_weights
    with model.families.shard_rule: a column-parallel tensor's rows, a row-parallel tensor's
    columns, the replicated ones whole; a published FP8 projection's per-channel scales with their
    rows), so no rank reads or holds the whole model. A `random:`
    shape makes its shard directly on the device: layer weights seeded per rank, the replicated
    embeddings, head and norms with one seed, so every rank holds the same replicated tensors (its
    output is meaningless either way; such shapes are for timing)."""
    if spec.startswith("random:"):
        shape, tied = random_shape(spec.removeprefix("random:"), max_context)
        check_tensor_parallel(shape, world)
        weights = random_shard_weights(shape, tied, rank, world, device, dtype, quantization)
        return LoadedModel(spec, shape, weights, None, ())
    checkpoint = open_checkpoint(spec, max_context)
    check_tensor_parallel(checkpoint.shape, world)
    return load_weights(checkpoint, device, dtype, rank, world, quantization)


def random_shard_weights(
    shape: LlamaShape, tied: bool, rank: int, world: int, device, dtype, quantization: str | None = None
) -> LlamaWeights:
    """Random weights of one rank's shard, made on `device` (scaled as loader.random_model);
    `quantization` "fp8": each layer's projections quantized as the layer is made."""
    check_quantization(quantization)
    quantize = quantize_layer if quantization == "fp8" else (lambda lw: lw)
    local = shard_shape(shape, world)
    shared = torch.Generator(device=device).manual_seed(0)
    own = torch.Generator(device=device).manual_seed(1 + rank)

    def rand(gen, rows: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(rows, fan_in, generator=gen, device=device, dtype=torch.float32) * fan_in**-0.5).to(dtype)

    H, D = shape.hidden_size, shape.head_dim
    qkv_rows = (local.num_heads + 2 * local.num_kv_heads) * D
    ones = torch.ones(H, device=device, dtype=dtype)
    layers = [
        quantize(
            LayerWeights(
                qkv=rand(own, qkv_rows, H),
                qkv_bias=rand(own, 1, qkv_rows)[0] if shape.qkv_bias else None,
                o=rand(own, H, local.num_heads * D),
                gate_up=rand(own, 2 * local.intermediate_size, H),
                down=rand(own, H, local.intermediate_size),
                input_norm=ones,
                post_norm=ones,
                **unit_norms(shape, device, dtype),
            )
        )
        for _ in range(shape.num_layers)
    ]
    embed = rand(shared, shape.vocab_size, H)
    head = embed if tied else rand(shared, shape.vocab_size, H)
    return LlamaWeights(embed=embed, layers=layers, final_norm=ones, lm_head=head)

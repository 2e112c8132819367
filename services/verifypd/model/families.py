"""Checkpoint families: how a transformers config becomes a LlamaShape, and how a checkpoint's
tensor names become LayerWeights / LlamaWeights.

The mapping reads tensors through a `TensorSource` (model.checkpoint): `get(name)` returns the
tensor already converted to the serving dtype on its device and, under tensor parallelism, already
cut to this rank's slice by `shard_rule(name)`. So the mapping is the same for one rank or many:
concatenating each rank's q/k/v slices gives that rank's fused qkv shard (model.tensor_parallel's
layout).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from verifypd.domain.models import ModelLoadError
from verifypd.model.llama import LayerWeights, LlamaShape, LlamaWeights
from verifypd.model.moe import MoeShape, MoeWeights

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "gemma", "mixtral", "qwen3_moe")

# transformers' hidden_act -> LlamaShape.mlp_activation. Gemma configs saying "gelu" mean the tanh
# approximation (transformers rewrites it so).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class TensorSource(Protocol):
    """Named checkpoint tensors (model.checkpoint implements it over safetensors and state dicts)."""

    dtype: torch.dtype  # the serving dtype
    device: torch.device

    def has(self, name: str) -> bool: ...

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor on the serving device in `dtype` (default: the serving dtype), already cut to
        this rank's slice under tensor parallelism. Raises ModelLoadError naming the tensor when
        the checkpoint lacks it."""
        ...


# How a rank cuts a tensor: (dim, sections). The tensor's `dim` is split into `sections` consecutive
# parts of the given sizes (None: the whole dim is one section), each part cut into `world` equal
# slices, and the rank keeps slice `rank` of every part, concatenated. None: replicated.
ShardRule = tuple[int, tuple[int, ...] | None] | None

# Mixtral's per-expert w1 (gate), w3 (up), w2 (down) shard as gate_proj, up_proj, down_proj.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")  # output rows split
ROW_PARALLEL = ("o_proj", "down_proj", "w2")  # input columns split (partial sums all-reduced)


def shard_rule(name: str, shape: LlamaShape) -> ShardRule:
    """How `name` is cut across tensor-parallel ranks (model.tensor_parallel's layout)."""
    parts = name.split(".")
    if shape.moe is not None and parts[-2:] == ["experts", "gate_up_proj"]:  # stacked [E, 2I, H]
        return (1, (shape.moe.intermediate_size,) * 2)
    if parts[-2:] == ["experts", "down_proj"]:  # stacked [E, H, I]
        return (2, None)
    if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
        module = parts[-2]
        if module in COLUMN_PARALLEL:
            return (0, None)
        if module in ROW_PARALLEL and parts[-1] == "weight":
            return (1, None)
    return None


def shape_from_config(config: Any, max_context: int | None) -> LlamaShape:
    if config.model_type not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"architecture {config.model_type!r} is not supported; verifypd supports {', '.join(SUPPORTED_TYPES)} only"
        )
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ModelLoadError(f"RoPE scaling {rope_type!r} is not supported (default, linear, llama3 are)")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    gemma = config.model_type == "gemma"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    act = "gelu_pytorch_tanh" if gemma and act == "gelu" else act
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"MLP activation {act!r} is not supported ({', '.join(ACTIVATIONS)} are)")
    if getattr(config, "use_sliding_window", False):
        raise ModelLoadError("sliding-window attention (config field 'use_sliding_window') is not supported")
    ctx = config.max_position_embeddings if max_context is None else min(max_context, config.max_position_embeddings)
    return LlamaShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(theta),
        max_context=ctx,
        rope_scaling=rope if rope_type != "default" else None,
        qkv_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
        mlp_activation=ACTIVATIONS[act],
        embed_scale=gemma,
        norm_offset=1.0 if gemma else 0.0,
        qk_norm=config.model_type == "qwen3_moe",
        moe=moe_shape(config),
    )


def moe_shape(config: Any) -> MoeShape | None:
    """The experts of a Mixtral or Qwen3-MoE config (None: a dense model)."""
    if config.model_type == "mixtral":
        return MoeShape(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            normalize_topk=True,
            float32_weights=True,
        )
    if config.model_type != "qwen3_moe" or not config.num_experts:
        return None
    # transformers' Qwen3MoeDecoderLayer: MoE unless listed in mlp_only_layers or off the sparse step.
    step, only = config.decoder_sparse_step, set(config.mlp_only_layers or ())
    dense = tuple(i for i in range(config.num_hidden_layers) if i in only or (i + 1) % step)
    return MoeShape(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        normalize_topk=bool(config.norm_topk_prob),
        float32_weights=False,
        dense_layers=dense,
    )


def weights_from_source(source: TensorSource, shape: LlamaShape, tied: bool) -> LlamaWeights:
    """The model's weights from checkpoint tensor names (Llama / Mistral / Qwen2 / Gemma layout).
    Each tensor is read once; the fused projections are concatenated on the device."""

    def norm(name: str) -> torch.Tensor:
        # Gemma's RMSNorm multiplies by (1 + w), in float32, then casts. Folded here: 1 + w is added
        # in float32 (as transformers does) and stored in the model dtype. Exact in float32; in half
        # precision the folded weight is rounded once, and the product is taken after x is cast (the
        # Llama order), a difference of the order of the dtype's rounding.
        return (source.get(name, torch.float32) + shape.norm_offset).to(source.dtype)

    def cat(names: list[str]) -> torch.Tensor:
        return torch.cat([source.get(n) for n in names])

    layers = []
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{x}_proj" for x in "qkv"]
        bias = cat([a + ".bias" for a in attn]) if shape.qkv_bias and source.has(attn[0] + ".bias") else None
        moe = shape.moe is not None and shape.moe.is_moe_layer(i)
        layers.append(
            LayerWeights(
                qkv=cat([a + ".weight" for a in attn]),
                qkv_bias=bias,
                o=source.get(p + "self_attn.o_proj.weight"),
                gate_up=None if moe else cat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=None if moe else source.get(p + "mlp.down_proj.weight"),
                input_norm=norm(p + "input_layernorm.weight"),
                post_norm=norm(p + "post_attention_layernorm.weight"),
                moe=experts_from_source(source, p, shape) if moe else None,
                q_norm=norm(p + "self_attn.q_norm.weight") if shape.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight") if shape.qk_norm else None,
            )
        )
    embed = source.get("model.embed_tokens.weight")
    head = embed if tied or not source.has("lm_head.weight") else source.get("lm_head.weight")
    return LlamaWeights(embed=embed, layers=layers, final_norm=norm("model.norm.weight"), lm_head=head)


# Per-expert tensor names (gate, up, down) as published checkpoints and transformers' save_pretrained
# write them; a transformers 5 model's state dict holds them stacked (experts.gate_up_proj / down_proj).
EXPERT_NAMES = {"block_sparse_moe.": ("w1", "w3", "w2"), "mlp.": ("gate_proj", "up_proj", "down_proj")}


def experts_from_source(source: TensorSource, prefix: str, shape: LlamaShape) -> MoeWeights:
    """Layer `prefix`'s router and stacked experts: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""
    assert shape.moe is not None
    experts = shape.moe.num_experts
    block = prefix + ("block_sparse_moe." if source.has(prefix + "block_sparse_moe.gate.weight") else "mlp.")
    router = source.get(block + "gate.weight")
    if router.shape[0] != experts:
        raise ModelLoadError(f"tensor {block + 'gate.weight'!r}: {router.shape[0]} experts, the config says {experts}")
    if source.has(block + "experts.gate_up_proj"):
        gate_up, down = source.get(block + "experts.gate_up_proj"), source.get(block + "experts.down_proj")
        if gate_up.shape[0] != experts or down.shape[0] != experts:
            raise ModelLoadError(f"tensor {block + 'experts.gate_up_proj'!r}: expected {experts} experts")
        return MoeWeights(router, gate_up, down)
    gate, up, down_name = EXPERT_NAMES[block.removeprefix(prefix)]
    stacked_gate_up: torch.Tensor | None = None
    stacked_down: torch.Tensor | None = None
    for e in range(experts):  # filled in place: one expert's tensors at a time beside the stacks
        name = f"{block}experts.{e}."
        g, u, d = (source.get(name + n + ".weight") for n in (gate, up, down_name))
        if stacked_gate_up is None or stacked_down is None:
            stacked_gate_up = g.new_empty(experts, 2 * g.shape[0], g.shape[1])
            stacked_down = d.new_empty(experts, *d.shape)
        if g.shape != u.shape or 2 * g.shape[0] != stacked_gate_up.shape[1] or d.shape != stacked_down.shape[1:]:
            raise ModelLoadError(f"tensor {name + gate + '.weight'!r}: expert {e}'s shapes differ from expert 0's")
        stacked_gate_up[e, : g.shape[0]] = g
        stacked_gate_up[e, g.shape[0] :] = u
        stacked_down[e] = d
    assert stacked_gate_up is not None and stacked_down is not None  # experts >= 1
    return MoeWeights(router, stacked_gate_up, stacked_down)

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

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "gemma")

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

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split
ROW_PARALLEL = ("o_proj", "down_proj")  # input columns split (partial sums all-reduced)


def shard_rule(name: str, shape: LlamaShape) -> ShardRule:
    """How `name` is cut across tensor-parallel ranks (model.tensor_parallel's layout)."""
    parts = name.split(".")
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
        layers.append(
            LayerWeights(
                qkv=cat([a + ".weight" for a in attn]),
                qkv_bias=bias,
                o=source.get(p + "self_attn.o_proj.weight"),
                gate_up=cat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=source.get(p + "mlp.down_proj.weight"),
                input_norm=norm(p + "input_layernorm.weight"),
                post_norm=norm(p + "post_attention_layernorm.weight"),
            )
        )
    embed = source.get("model.embed_tokens.weight")
    head = embed if tied or not source.has("lm_head.weight") else source.get("lm_head.weight")
    return LlamaWeights(embed=embed, layers=layers, final_norm=norm("model.norm.weight"), lm_head=head)

"""Checkpoint families: how a transformers config becomes a LlamaShape, and how a checkpoint's
tensor names become LayerWeights / LlamaWeights.

The mapping reads tensors through a `TensorSource` (model.checkpoint): `get(name)` returns the
tensor already converted to the serving dtype on its device and, under tensor parallelism, already
cut to this rank's slice by `shard_rule(name)`. So the mapping is the same for one rank or many:
concatenating each rank's q/k/v slices gives that rank's fused qkv shard (model.tensor_parallel's
layout).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from verifypd.domain.models import ModelLoadError
from verifypd.model.fp8_load import load_linear
from verifypd.model.llama import LayerWeights, Linear, LlamaShape, LlamaWeights
from verifypd.model.moe import MoeShape, MoeWeights

# transformers' model_type -> the family's name in the README's "Supported models" (a test compares them).
FAMILY_NAMES = {
    "llama": "Llama 2/3.x",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma": "Gemma",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "phi3": "Phi-3",
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3-MoE",
}
SUPPORTED_TYPES = tuple(FAMILY_NAMES)
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")  # (1 + w) norms, embeddings scaled by sqrt(hidden)
ROPE_TYPES = ("default", "linear", "llama3", "longrope")

# transformers' hidden_act -> LlamaShape.mlp_activation. Gemma configs saying "gelu" mean the tanh
# approximation (transformers rewrites it so).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class TensorSource(Protocol):
    """Named checkpoint tensors (model.checkpoint implements it over safetensors and state dicts)."""

    dtype: torch.dtype  # the serving dtype
    device: torch.device

    def has(self, name: str) -> bool: ...

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype the checkpoint stores `name` in (FP8 projections are read as they are)."""
        ...

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


def shard_rule(name: str, shape: LlamaShape, stored: tuple[int, ...]) -> ShardRule:
    """How `name`, stored with dims `stored`, is cut across tensor-parallel ranks (model.tensor_parallel's
    layout). Phi-3's fused qkv_proj / gate_up_proj are cut per section: each rank keeps its q, k, v
    (gate, up) rows. A published FP8 projection's scales follow its weight's rows (`fp8_scale_rule`)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] == "weight_scale":
        return fp8_scale_rule(shard_rule(name.removesuffix("_scale"), shape, stored), stored)
    if shape.moe is not None and parts[-2:] == ["experts", "gate_up_proj"]:  # stacked [E, 2I, H]
        return (1, (shape.moe.intermediate_size,) * 2)
    if parts[-2:] == ["experts", "down_proj"]:  # stacked [E, H, I]
        return (2, None)
    if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
        module = parts[-2]
        if module in COLUMN_PARALLEL:
            return (0, None)
        if module == "qkv_proj":
            q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
            return (0, (q, kv, kv))
        if module == "gate_up_proj":
            return (0, (shape.intermediate_size, shape.intermediate_size))
        if module in ROW_PARALLEL and parts[-1] == "weight":
            return (1, None)
    return None


def fp8_scale_rule(weight_rule: ShardRule, stored: tuple[int, ...]) -> ShardRule:
    """The rule of a `weight_scale` (model.fp8_load) beside a weight cut by `weight_rule`. Per output
    channel ([N] or [N, 1]) a column-parallel rank keeps the scales of its rows: the weight's rule,
    sections included (the scale's dim 0 is the weight's). A row-parallel rank keeps every output row,
    so it keeps every scale: its partial sums over its columns are scaled by the whole row's scale
    before the all-reduce, which is the unsharded product (scaling is linear). One value (per tensor,
    stored [] or [1]) is the same for every row: whole on every rank. A static `input_scale` (one
    value) is replicated by shard_rule's default."""
    per_tensor = math.prod(stored) == 1
    if weight_rule is None or weight_rule[0] != 0 or per_tensor:
        return None
    return weight_rule


def shape_from_config(config: Any, max_context: int | None) -> LlamaShape:
    kind = config.model_type
    if kind == "gemma3":
        raise ModelLoadError(
            "Gemma 3 multimodal checkpoints (model_type 'gemma3') are not supported: serve a text-only "
            "Gemma 3 checkpoint (model_type 'gemma3_text', e.g. gemma-3-1b)"
        )
    if kind not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"architecture {kind!r} is not supported; verifypd supports {', '.join(SUPPORTED_TYPES)} only"
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    gemma = kind in GEMMA_TYPES
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    act = "gelu_pytorch_tanh" if gemma and act == "gelu" else act
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"MLP activation {act!r} is not supported ({', '.join(ACTIVATIONS)} are)")
    if getattr(config, "use_sliding_window", False):
        raise ModelLoadError("sliding-window attention (config field 'use_sliding_window') is not supported")
    ctx = config.max_position_embeddings if max_context is None else min(max_context, config.max_position_embeddings)
    rope, local_theta = rope_from_config(config, head_dim)
    if rope["rope_type"] == "longrope":
        # transformers rotates by the short factors while a sequence fits the original context and,
        # once it grows past it, re-encodes the whole sequence with the long factors (Phi-3's
        # generate drops its cache there). Paged KV keeps the keys it wrote, so the context is
        # held to the original one, where both agree exactly.
        original = rope["original_max_position_embeddings"]
        if max_context is None:
            ctx = min(ctx, original)
        elif ctx > original:
            raise ModelLoadError(
                f"longrope RoPE scaling: a context of {ctx} tokens is past the original "
                f"{original} (original_max_position_embeddings), where transformers re-encodes every "
                f"earlier token with the long factors; verifypd serves such models up to "
                f"{original} tokens: pass --max-context {original} or less"
            )
    window, sliding = sliding_from_config(config, ctx)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return LlamaShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        max_context=ctx,
        rope_scaling=rope if rope["rope_type"] != "default" else None,
        qkv_bias=bool(getattr(config, "attention_bias", False)) or kind == "qwen2",
        mlp_activation=ACTIVATIONS[act],
        embed_scale=gemma,
        norm_offset=1.0 if gemma else 0.0,
        qk_norm=kind in ("qwen3", "gemma3_text", "qwen3_moe"),
        moe=moe_shape(config),
        sandwich_norms=kind in ("gemma2", "gemma3_text"),
        attn_scale=float(scalar) ** -0.5 if scalar else None,
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it (the
        # released configs set none): neither do we, so that a set value stays exact.
        attn_softcap=None if kind == "gemma3_text" else getattr(config, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(config, "final_logit_softcapping", None) or None,
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=local_theta,
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


def rope_from_config(config: Any, head_dim: int) -> tuple[dict, float | None]:
    """(the global layers' rope parameters with rope_type and rope_theta, the sliding layers' own
    base or None). transformers 5 keeps them in `rope_parameters` (per layer type for Gemma 3);
    older configs in rope_theta + rope_scaling."""
    raw = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    local_theta = None
    if "full_attention" in raw:  # Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}
        local = dict(raw.get("sliding_attention") or {})
        raw = dict(raw["full_attention"])
        if local:
            if local.get("rope_type", "default") != "default":
                raise ModelLoadError(f"RoPE scaling {local['rope_type']!r} on sliding layers is not supported")
            local_theta = float(local["rope_theta"])
    raw.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    raw["rope_type"] = raw.get("rope_type", raw.pop("type", "default"))
    kind = raw["rope_type"]
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"RoPE scaling {kind!r} is not supported ({', '.join(ROPE_TYPES)} are)")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"partial_rotary_factor {raw['partial_rotary_factor']} is not supported (1.0 is)")
    if kind == "longrope":  # Phi-3 128k: the short factors, and cos/sin times the attention factor
        raw["original_max_position_embeddings"] = longrope_original_context(config, raw)
        if len(raw.get("short_factor") or ()) != head_dim // 2:
            raise ModelLoadError(f"longrope needs short_factor with head_dim / 2 = {head_dim // 2} entries")
        factor = raw.get("factor") or config.max_position_embeddings / raw["original_max_position_embeddings"]
        if raw.get("attention_factor") is None:  # transformers' default
            log_ctx = math.log(raw["original_max_position_embeddings"])
            raw["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / log_ctx)
    return raw, local_theta


def longrope_original_context(config: Any, rope: dict) -> int:
    return int(rope.get("original_max_position_embeddings") or config.original_max_position_embeddings)


def sliding_from_config(config: Any, max_context: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that slide). transformers 5 names each layer's kind in `layer_types`;
    without it, a `sliding_window` applies to every layer (Mistral, Phi-3). A window that covers
    the whole context is dropped (those layers then run as full attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ModelLoadError(f"layer types {sorted(unknown)} are not supported")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        sliding = tuple(range(config.num_hidden_layers))
    if not window or window >= max_context or not sliding:
        return None, ()
    return int(window), sliding


def weights_from_source(
    source: TensorSource, shape: LlamaShape, tied: bool, quantize: bool = False, published_fp8: bool = False
) -> LlamaWeights:
    """The model's weights from checkpoint tensor names (the Llama layout, Phi-3's fused projections,
    Qwen3's and Gemma 3's q/k norms, Gemma 2/3's four norms). Each tensor is read once; the fused
    projections are concatenated on the device. The dense projections are fp8 where a published FP8
    checkpoint (`published_fp8`) stores them so, or with `quantize` (model.fp8_load); everything else
    stays in the model dtype."""

    def linear(names: list[str]) -> Linear:
        return load_linear(source, names, quantize, published_fp8)

    def norm(name: str) -> torch.Tensor:
        # Gemma's RMSNorm multiplies by (1 + w), in float32, then casts. Folded here: 1 + w is added
        # in float32 (as transformers does) and stored in the model dtype. Exact in float32; in half
        # precision the folded weight is rounded once, and the product is taken after x is cast (the
        # Llama order), a difference of the order of the dtype's rounding.
        return (source.get(name, torch.float32) + shape.norm_offset).to(source.dtype)

    def cat(names: list[str]) -> torch.Tensor:
        return torch.cat([source.get(n) for n in names])

    def fused(name: str, parts: list[str]) -> Linear:
        """Phi-3 stores the fused projection (already cut per section); others its parts."""
        return linear([name] if source.has(name) else parts)

    # Gemma 2/3's post_attention_layernorm norms the attention output; their pre-MLP norm is
    # pre_feedforward_layernorm. Llama's post_attention_layernorm is the pre-MLP norm.
    sandwich = shape.sandwich_norms
    pre_mlp = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    layers = []
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{x}_proj" for x in "qkv"]
        bias = cat([a + ".bias" for a in attn]) if shape.qkv_bias and source.has(attn[0] + ".bias") else None
        moe = shape.moe is not None and shape.moe.is_moe_layer(i)
        layers.append(
            LayerWeights(
                qkv=fused(p + "self_attn.qkv_proj.weight", [a + ".weight" for a in attn]),
                qkv_bias=bias,
                o=linear([p + "self_attn.o_proj.weight"]),
                gate_up=None
                if moe
                else fused(p + "mlp.gate_up_proj.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=None if moe else linear([p + "mlp.down_proj.weight"]),
                moe=experts_from_source(source, p, shape) if moe else None,
                input_norm=norm(p + "input_layernorm.weight"),
                post_norm=norm(p + pre_mlp + ".weight"),
                q_norm=norm(p + "self_attn.q_norm.weight") if shape.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight") if shape.qk_norm else None,
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
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

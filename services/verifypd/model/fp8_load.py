"""FP8 weights while loading: a checkpoint's published FP8 projections read as they are, or a
high-precision checkpoint quantized per output channel (`--quantization fp8`).

Published FP8 checkpoints say so in config.json's `quantization_config`:

    quant_method "compressed-tensors"  (llm-compressor's "FP8" and "FP8-dynamic")
        <module>.weight        float8_e4m3fn [N, K]
        <module>.weight_scale  float32 [N, 1] (channel strategy) or one value (tensor strategy)
        <module>.input_scale   one value, static activations ("FP8"; absent in "FP8-dynamic")
    quant_method "fbgemm_fp8"  (FBGEMM, e.g. Llama 3.1 FP8)
        <module>.weight, <module>.weight_scale [N, 1]; `input_scale_ub` (a clamp of the dynamic
        activation scale) is not read: activations are scaled per token by their own amax.

Which projections are FP8 is read from the file (a `.weight` stored as F8_E4M3 with a
`.weight_scale` beside it), so a config's ignore list (lm_head, usually) needs no parsing. Embeddings,
norms, lm_head and MoE experts stay in the model dtype in every mode.

A static input scale is honoured: activations of that projection are quantized by it (clamped to
the fp8 range), as the checkpoint was calibrated. Fused projections (q/k/v, gate/up) take the
largest of their parts' input scales, so no part's activations clip earlier than calibrated.

Under tensor parallelism the source hands each projection already cut to the rank
(families.shard_rule): a column-parallel weight's rows with the scales of those rows, a row-parallel
weight's columns with every row's scale, a per-tensor or input scale whole. So a rank's Fp8Weight is
model.tensor_parallel.shard_weights' cut of the unsharded one, and nothing here knows about ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from verifypd.domain.models import ModelLoadError
from verifypd.model.fp8 import FP8, Fp8Weight, quantize_weight
from verifypd.model.llama import LayerWeights, Linear

CHECKPOINT_METHODS = ("compressed-tensors", "fbgemm_fp8")  # quant_method values read as published


def checkpoint_quantization(config: Any) -> str | None:
    """The checkpoint's quantization method (one of CHECKPOINT_METHODS), None for plain weights;
    ModelLoadError naming the field for any other kind (GPTQ, AWQ, block-wise FP8, ...)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ModelLoadError(
            f"config.json field 'quantization_config.quant_method' {method!r} is not supported "
            f"({', '.join(CHECKPOINT_METHODS)} FP8 checkpoints are)"
        )
    if method == "compressed-tensors":
        for name, group in (qc.get("config_groups") or {}).items():
            weights = (group or {}).get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise ModelLoadError(
                    f"config.json field 'quantization_config.config_groups.{name}.weights': only 8-bit float "
                    f"(FP8) weights are supported, got type {weights.get('type')!r} "
                    f"num_bits {weights.get('num_bits')!r}"
                )
            if weights.get("strategy") not in ("channel", "tensor"):
                raise ModelLoadError(
                    f"config.json field 'quantization_config.config_groups.{name}.weights.strategy' "
                    f"{weights.get('strategy')!r} is not supported (channel and tensor are)"
                )
    return str(method)


def load_linear(source: Any, names: list[str], quantize: bool, published_fp8: bool = False) -> Linear:
    """The projection fused from `names` (each '<module>.weight', concatenated along the output rows):
    fp8 as published when `published_fp8` (the config names an FP8 method) and the checkpoint stores
    them so, else in the model dtype, quantized per output channel when `quantize`. `source` is a
    model.families.TensorSource (an FP8 tensor of a checkpoint without the config is refused there)."""
    fp8 = [published_fp8 and source.stored_dtype(n) == FP8 for n in names]
    if any(fp8):
        if not all(fp8):
            raise ModelLoadError(f"tensors {names}: some are FP8 and some are not; a fused projection needs one kind")
        return fuse([published(source, n) for n in names])
    w = source.get(names[0]) if len(names) == 1 else torch.cat([source.get(n) for n in names])
    return quantize_weight(w) if quantize else w


def published(source: Any, name: str) -> Fp8Weight:
    """One published FP8 projection: its weight, per-channel scale and static input scale (if any)."""
    prefix = name.removesuffix("weight")
    scale_name = prefix + "weight_scale"
    if not source.has(scale_name):
        raise ModelLoadError(f"tensor {name!r} is FP8 but the checkpoint has no {scale_name!r}")
    weight = source.get(name, FP8)
    rows = weight.shape[0]
    scale = source.get(scale_name, torch.float32).reshape(-1)
    if scale.numel() == 1:  # per-tensor: the same scale for every row (whole on every rank)
        scale = scale.expand(rows)
    elif scale.numel() != rows:
        raise ModelLoadError(
            f"tensor {scale_name!r}: {scale.numel()} scales for {rows} output rows (expected [{rows}, 1] or one)"
        )
    input_name = prefix + "input_scale"
    input_scale = source.get(input_name, torch.float32).reshape(-1) if source.has(input_name) else None
    if input_scale is not None and input_scale.numel() != 1:
        raise ModelLoadError(f"tensor {input_name!r}: {input_scale.numel()} values, a per-tensor scale has one")
    return Fp8Weight(weight.contiguous(), scale.contiguous(), None if input_scale is None else input_scale[0])


def fuse(parts: list[Fp8Weight]) -> Fp8Weight:
    """Parts stacked along the output rows (each row keeps its scale)."""
    if len(parts) == 1:
        return parts[0]
    statics = [p.input_scale for p in parts]
    if any(s is None for s in statics) and not all(s is None for s in statics):
        raise ModelLoadError("a fused projection mixes static and dynamic activation scales")
    input_scale = None if statics[0] is None else torch.stack([s for s in statics if s is not None]).amax()
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), input_scale)


def quantize_layer(lw: LayerWeights) -> LayerWeights:
    """`lw` with its dense projections quantized per output channel (random-weight models: each
    layer right after it is made, so the model's high-precision copy never exists whole)."""
    for field in ("qkv", "o", "gate_up", "down"):
        w = getattr(lw, field)
        if isinstance(w, torch.Tensor):
            setattr(lw, field, quantize_weight(w))
    return lw

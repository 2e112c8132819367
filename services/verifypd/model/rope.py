"""Rotary position embeddings (HF's rotate-half convention): the inverse frequencies of a shape under
its scaling (llama3, linear, longrope's short factors), the cos/sin tables of every position, and the
rotation the reference path applies (the Triton path rotates in model.kernels.rope_kv)."""

from __future__ import annotations

from typing import Protocol

import torch


class RopeShape(Protocol):
    """What RoPE reads of a shape (model.llama.LlamaShape, which imports this module)."""

    head_dim: int
    max_context: int
    rope_theta: float
    rope_scaling: dict | None
    local_rope_theta: float | None


def rope_inv_freq(
    shape: RopeShape, device: torch.device, theta: float | None = None, scaling: dict | None = None
) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies: base `theta` (default shape.rope_theta) under `scaling`
    (default shape.rope_scaling): llama3, linear, or longrope's short factors (families.py holds
    longrope models to their original context, where transformers uses those)."""
    theta = shape.rope_theta if theta is None else theta
    scaling = shape.rope_scaling if scaling is None else scaling
    inv = 1.0 / (theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim))
    kind = scaling.get("rope_type") if scaling else None
    if kind == "llama3":
        assert scaling is not None
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        assert scaling is not None
        inv = inv / scaling["factor"]
    elif kind == "longrope":
        assert scaling is not None
        inv = inv / torch.tensor(scaling["short_factor"], dtype=torch.float64)
    return inv.float().to(device)


def rope_tables(shape: RopeShape, dtype: torch.dtype, device: torch.device, local: bool = False):
    """(cos, sin) [max_context + slack, head_dim] of every position, looked up per step.
    `local`: the sliding layers' tables of a model with their own base (Gemma 3; no scaling).
    longrope (Phi-3) also multiplies cos and sin by its attention factor."""
    positions = torch.arange(shape.max_context + 64, device=device, dtype=torch.float32)
    scaling: dict = {} if local else dict(shape.rope_scaling or {})
    theta = shape.local_rope_theta if local else None
    freqs = positions[:, None] * rope_inv_freq(shape, device, theta, scaling)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = scaling.get("attention_factor", 1.0)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D]. HF's rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

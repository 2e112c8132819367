"""model.fp8.linear spelled out in float32, path by path, for the fp8 tests."""

from __future__ import annotations

import torch

from verifypd.model import fp8
from verifypd.model.fp8 import FP8, FP8_MAX, Fp8Weight


def dequantized_tokens(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """What the quantized product multiplies: each row of x rounded to fp8 by its own amax (or by `scale`)."""
    s = (x.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX) if scale is None else scale
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


def reference_linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] through `w` as model.fp8 computes it: forwards of at most WEIGHT_ONLY_TOKENS tokens
    multiply the unquantized activations by the dequantized weight; larger ones fp8-rounded tokens."""
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w, bias)
    weight = w.dequantize(torch.float32)
    if x.shape[0] <= fp8.WEIGHT_ONLY_TOKENS:
        return torch.nn.functional.linear(x.float(), weight, bias).to(x.dtype)
    return torch.nn.functional.linear(dequantized_tokens(x.float(), w.input_scale), weight, bias).to(x.dtype)

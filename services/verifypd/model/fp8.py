"""FP8 (float8_e4m3fn) linear layers: weights stored in fp8 with one float32 scale per output
channel, activations quantized per token inside the forward, the product on fp8 tensor cores
(`torch._scaled_mm`, Hopper and later; torch's CPU kernel on the host).

    Fp8Weight          weight [N, K] fp8, scale [N] float32 (w ~= weight * scale[:, None]),
                       input_scale: a checkpoint's static activation scale (or None: dynamic)
    quantize_weight    a high-precision [N, K] weight -> Fp8Weight, per output channel
    linear             F.linear over a plain tensor or an Fp8Weight (the forward's one entry)

The forward has no host sync (amax, division and the cast stay on the device), so it is captured
in CUDA graphs as the bf16 forward is. `_scaled_mm` needs K and N multiples of 16: a linear of
another shape runs on its dequantized weight instead (one warning per shape; no model served today
has such a projection).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
# The smallest amax a scale is taken from: an all-zero row or token gets scale MIN_AMAX / FP8_MAX
# instead of 0 (a zero scale would turn 0 / 0 into NaN).
MIN_AMAX = 1e-12
ALIGN = 16  # _scaled_mm's alignment of K and N

WARNED: set[tuple[int, int]] = set()  # shapes already warned about (the fallback warns once each)


@dataclass
class Fp8Weight:
    """A linear's weight in fp8: w[n, k] ~= weight[n, k] * scale[n]."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn, contiguous (so weight.t() is the column-major mat2)
    scale: torch.Tensor  # [N] float32
    # A checkpoint's static activation scale (compressed-tensors "FP8", not "-dynamic"): 0-d float32.
    # None: each token is scaled by its own amax.
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`: the weight the fp8 one stands for (the reference of tests, the fallback)."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scale.numel()


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] (any float dtype, on its device) -> fp8 with one scale per output row (amax / 448)."""
    amax = w.abs().amax(dim=1).float()
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q.contiguous(), scale)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scale [M, 1] float32): each row by its own amax."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] by one given 0-d scale -> (fp8 [M, K], that scale as [M, 1] (what row-wise wants))."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) in x's dtype; w [N, K] plain or fp8."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return fp8_linear(x, w, bias)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    n, k = w.weight.shape
    if n % ALIGN or k % ALIGN:
        if (n, k) not in WARNED:
            WARNED.add((n, k))
            warnings.warn(
                f"fp8 linear [{n}, {k}]: _scaled_mm needs both dims multiples of {ALIGN}; this "
                "projection runs on its dequantized weight",
                stacklevel=2,
            )
        return F.linear(x, w.dequantize(x.dtype), bias)
    lead = x.shape[:-1]
    flat = x.reshape(-1, k)
    if flat.shape[0] == 0:  # no tokens (a shape, known on the host: no sync)
        return x.new_zeros(*lead, n)
    if x.is_cuda:  # one Triton launch (model.kernels.fp8_quant); the torch functions are its reference
        from verifypd.model.kernels.fp8_quant import quantize_rows

        flat = flat if flat.stride(1) == 1 else flat.contiguous()
        q, x_scale = quantize_rows(flat, w.input_scale, FP8_MAX, MIN_AMAX)
    else:
        q, x_scale = quantize_tokens(flat) if w.input_scale is None else quantize_static(flat, w.input_scale)
    if x.is_cuda:  # Hopper's fp8 tensor cores; row-wise scaling writes bfloat16 only: other dtypes cast after
        y = torch._scaled_mm(q, w.weight.t(), scale_a=x_scale, scale_b=w.scale.view(1, n), out_dtype=torch.bfloat16)
    else:
        # The same product in float32 (the fp8 values are exact in it): CPU _scaled_mm takes row-wise
        # scales only in some torch releases (2.11 refuses them) and is no faster than this.
        y = (q.float() @ w.weight.float().t()) * x_scale * w.scale.view(1, n)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, n)

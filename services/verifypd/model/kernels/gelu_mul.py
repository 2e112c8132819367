"""GELU(gate, tanh approximation) * up of the fused gate/up projection (Triton), one launch: Gemma's
GeGLU MLP (transformers' "gelu_pytorch_tanh").

    gate_up [T, 2I] (gate in the first half)  ->  [T, I] in the same dtype (math in float32)

0.5 x (1 + tanh(u)) is computed as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the same
function without a tanh (which Triton's core language lacks); e^(-2u) is clamped at e^80 (very negative x:
x e^-80 instead of ~0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verifypd.model.kernels.silu_mul import launch_gated

SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)  # jit globals must be constexpr


@triton.jit
def _gelu_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    u = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    out = gate / (1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0))) * up  # clamped: no float32 overflow
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return launch_gated(_gelu_mul_kernel, gate_up)

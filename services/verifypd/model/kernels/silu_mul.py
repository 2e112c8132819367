"""SiLU(gate) * up of the fused gate/up projection (Triton), one launch.

gate_up [T, 2I] (gate in the first half)  ->  [T, I] in the same dtype (math in float32)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def launch_gated(kernel, gate_up: torch.Tensor) -> torch.Tensor:
    """Runs a gated-activation kernel of this shape (silu_mul, gelu_mul): [T, 2I] -> [T, I]."""
    rows, double = gate_up.shape
    width = double // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        kernel[(rows, triton.cdiv(width, block))](
            gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return launch_gated(_silu_mul_kernel, gate_up)

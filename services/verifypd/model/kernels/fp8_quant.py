"""Per-token fp8 quantization of a linear's input (Triton), one launch instead of the eight torch ops
of model.fp8.quantize_tokens (on a decode step of a 32-layer model those are ~1000 launches).

    x [M, K] (any float dtype)  ->  q [M, K] float8_e4m3fn, scale [M, 1] float32
    dynamic: scale[m] = max(amax(|x[m]|), floor) / 448;  static: scale[m] = the given 0-d scale
    (model.fp8 passes its constants: this module imports nothing of the model)
    q = clamp(x / scale, -448, 448) rounded to e4m3 (the same rounding as torch's .to(float8_e4m3fn))

One program per row; the whole row in registers (K <= 32768 fits a block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_ptr, width, stride_x, FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr,
    STATIC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR) / FP8_LIMIT
    q = tl.minimum(tl.maximum(x / scale, -FP8_LIMIT), FP8_LIMIT)
    # Rounded to e4m3's grid here (ties to even), so the cast below only converts exact values: the
    # hardware cast rounds the same way, Triton's CPU interpreter does not (it truncates past a binade).
    # Normals (|q| >= 2^-6): keep 3 of float32's 23 mantissa bits, a carry may bump the exponent.
    bits = q.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormals: multiples of 2^-9; adding 1.5 * 2^14 leaves float32 an ulp of exactly 2^-9.
    # (on the magnitude, so that small negatives keep their sign as -0, as torch's cast does).
    sub = (tl.abs(q) + 24576.0) - 24576.0
    sub = tl.where(q < 0, -sub, sub)
    q = tl.where(tl.abs(q) < 0.015625, sub, normal)
    tl.store(q_ptr + row * width + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


def quantize_rows(
    x: torch.Tensor, static_scale: torch.Tensor | None, limit: float, floor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) -> (float8_e4m3fn [M, K] contiguous, scale [M, 1] float32);
    `limit`: the fp8 maximum (448), `floor`: the smallest amax a dynamic scale is taken from."""
    rows, width = x.shape
    q = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(width)
        static = static_scale if static_scale is not None else scale  # unread when dynamic
        _quantize_rows_kernel[(rows,)](
            x,
            q,
            scale,
            static,
            width,
            x.stride(0),
            FP8_LIMIT=limit,
            FLOOR=floor,
            STATIC=static_scale is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return q, scale

"""The fp8 KV cache (`--kv-cache-dtype fp8`): what a pool stores and how attention reads it back.

    kv_cache_dtype(name, dtype, device)   "auto" -> the model dtype; "fp8" -> float8_e4m3fn, or a
                                          ModelLoadError naming the flag where the device can't
    quantize / dequantize                 the torch reference of what the kernels do (the CPU path,
                                          the oracle of the kernel tests)

The pool is the same tensor ([2, layers, blocks, block_size, kv_heads, head_dim]) in float8_e4m3fn:
one byte an element, so a budget holds twice the tokens it holds in bf16. The kernel that writes
K/V (kernels/rope_kv.py) quantizes, `k / K_SCALE` saturated to +-448; the attention kernel
(kernels/paged_attention.py) loads fp8, converts to the query's dtype and folds the scales into the
softmax scale (K) and the output (V); the reference attention dequantizes the gathered context.

Scales: one static per-tensor scale for K and one for V, both 1.0 (vLLM's default when a checkpoint
carries no calibrated KV scales), with saturation. Why not calibrated or per-head scales:
  * Every process that touches a pool must read it with the scales it was written with: the prefill
    lane writes what the verify lane reads (split topology, by handle or by copy), tensor-parallel
    ranks each hold their heads, and a restarted lane re-prefills into a pool others still read. A
    constant needs no exchange, no descriptor field and no calibration pass; scales taken from the
    first prefill would make every later request's KV depend on which request came first, and a
    restarted lane that took other scales would misread the blocks already written.
  * e4m3 is a float format: 3 mantissa bits keep any value in [2^-6, 448] within 2^-4 of itself
    (smaller ones to 2^-10 absolute), so a scale only matters for values outside that range.
    Post-RoPE keys and values of Llama-family models sit inside it (bench/engine/fp8_kv.py reports
    the measured max |K| and |V| of the model it runs, and the share of values that saturate).
A model whose K or V exceed 448 would need calibrated scales: the kernels and the reference already
take `k_scale` / `v_scale` (tests exercise non-unit scales), so that is a change of where the numbers
come from, not of the kernels.
"""

from __future__ import annotations

import torch

from verifypd.domain.models import ModelLoadError
from verifypd.domain.options import KV_CACHE_DTYPES
from verifypd.model.fp8 import FP8, FP8_MAX

K_SCALE = 1.0  # stored k = k / K_SCALE (saturated); see the module doc for why static and 1.0
V_SCALE = 1.0
MIN_CAPABILITY = (8, 9)  # Triton's float8e4nv conversions: Ada / Hopper and later


def kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pools' element type for `--kv-cache-dtype name` with model dtype `dtype` on `device`."""
    if name not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "auto":
        return dtype
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < MIN_CAPABILITY:
            raise ModelLoadError(
                f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use --kv-cache-dtype auto"
            )
    elif device.type != "cpu":
        raise ModelLoadError(f"--kv-cache-dtype fp8 runs on cuda or cpu devices, not {device.type}")
    return FP8


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> fp8: x / scale, saturated to +-448 explicitly (how a plain cast treats
    overflow differs between torch versions: NaN past 480 in some, 448 in others)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """fp8 x -> `dtype`: x * scale (fp8 values are exact in bf16, fp16 and float32)."""
    y = x.to(dtype)
    return y if scale == 1.0 else y * scale

"""model.kernels.fp8_gemm (the fused quantize + split-K GEMV of forwards of few tokens) against
model.fp8's torch product (per-token quantization, then the fp8 values multiplied in float32): one
slice of K and several (the ragged last one included), dynamic and static activation scales, with
and without bias, ragged M, N and K. float16 activations under the interpreter (it multiplies
bfloat16 as raw bits); the GPU run covers bfloat16 too."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from verifypd.model.fp8 import FP8_MAX, MIN_AMAX, quantize_static, quantize_tokens, quantize_weight

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if torch.cuda.is_available() else [torch.float16]
SHAPES = [(1, 48, 96), (2, 40, 64), (3, 80, 200), (5, 24, 1040), (16, 56, 512)]  # (M, N, K)


def reference(x, q, input_scale, bias):
    """model.fp8's CPU product: the tokens rounded to fp8, times the fp8 weight, both scales after."""
    xq, s = quantize_tokens(x) if input_scale is None else quantize_static(x, input_scale)
    y = (xq.float() @ q.weight.float().t()) * s * q.scale
    return (y if bias is None else y + bias.float()).to(x.dtype)


def operands(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # Weight rows and tokens of very different range: each scale must land on its own row / column.
    q = quantize_weight(torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, n)[:, None])
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]
    x[-1, : k // 3] = 0  # part of a row empty: its amax comes from the rest
    q.weight, q.scale = q.weight.to(DEVICE), q.scale.to(DEVICE)
    return x.to(DEVICE, dtype), q, torch.randn(n, generator=gen).to(DEVICE, dtype)


def close(got, want):
    # The same products in float32: only the summation order and the output's rounding differ.
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.float().abs().max().item())


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_gemv_equals_the_quantized_product(m, n, k, dtype, static, with_bias):
    from verifypd.model.kernels.fp8_gemm import fp8_gemv

    x, q, bias = operands(m, n, k, dtype, seed=m * 1000 + n + k)
    input_scale = torch.tensor(2.0 / FP8_MAX, device=DEVICE) if static else None  # |x| > 2 clips
    bias = bias if with_bias else None
    y = fp8_gemv(x, q.weight, q.scale, input_scale, FP8_MAX, MIN_AMAX, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    close(y, reference(x, q, input_scale, bias))


@pytest.mark.parametrize("splits_wanted", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [3, 7])  # the CUDA-core kernel, the tensor-core one
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_split_of_k_gives_the_same_product(splits_wanted, m, with_bias):
    """K = 1040 in steps of 64: 17 steps, so 3 and 5 slices leave a short last one."""
    from verifypd.model.kernels.fp8_gemm import ROWS_MAX, fp8_gemv, plan

    x, q, bias = operands(m, 72, 1040, torch.float16, seed=9)
    bias = bias if with_bias else None
    # waves * sms / tiles = splits: 2 column tiles of 64, so sms = splits * 2 at one wave.
    launch = plan(m, 72, 1040, sms=2 * splits_wanted, block_n=64, block_k=64, waves=1)
    assert launch.cuda_cores == (m <= ROWS_MAX)
    assert launch.splits == splits_wanted and (launch.splits - 1) * launch.iters < 17 <= launch.splits * launch.iters
    close(fp8_gemv(x, q.weight, q.scale, None, FP8_MAX, MIN_AMAX, bias, launch=launch), reference(x, q, None, bias))


def test_activation_rounding_is_not_skipped():
    """The token's fp8 rounding is part of the product: the kernel is much nearer the rounded product
    than the unrounded one."""
    from verifypd.model.kernels.fp8_gemm import fp8_gemv

    x, q, _ = operands(4, 64, 512, torch.float16, seed=3)
    y = fp8_gemv(x, q.weight, q.scale, None, FP8_MAX, MIN_AMAX).float()
    rounded = reference(x, q, None, None).float()
    unrounded = (x.float() @ q.weight.float().t()) * q.scale
    assert (y - rounded).abs().max() < 0.2 * (y - unrounded).abs().max()


def test_plan_fills_the_gpu_without_empty_slices():
    from verifypd.model.kernels.fp8_gemm import MAX_TOKENS, fp8_gemv, plan

    for m, n, k in itertools.product((1, 3, 4, 5, 16), (12288, 4096, 22016, 960), (4096, 11008, 576)):
        go = plan(m, n, k, sms=132)
        steps = -(-k // go.block_k)
        assert (go.splits - 1) * go.iters < steps <= go.splits * go.iters, (n, k, go)
        programs = -(-n // go.block_n) * go.splits
        assert (programs <= 8 * 132 or go.splits == 1) and (programs >= 2 * 132 or go.splits == steps), (m, n, k, go)
        assert go.cuda_cores == (m <= 4) and go.block_k >= 16
    x, q, _ = operands(MAX_TOKENS + 1, 16, 32, torch.float16, seed=1)
    with pytest.raises(ValueError, match=f"1..{MAX_TOKENS} tokens, got {MAX_TOKENS + 1}"):
        fp8_gemv(x, q.weight, q.scale, None, FP8_MAX, MIN_AMAX)

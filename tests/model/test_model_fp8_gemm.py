"""model.kernels.fp8_gemm (the fused quantize + GEMV of forwards of few tokens) against model.fp8's
torch product (per-token quantization, then the fp8 values multiplied in float32), for every bucket of
its launch table, ragged edges in M, N and K, dynamic and static activation scales, with and
without bias. float16 activations under the interpreter (it multiplies bfloat16 as raw bits); the
GPU run covers bfloat16 too."""

from __future__ import annotations

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


def test_activation_rounding_is_not_skipped():
    """The token's fp8 rounding is part of the product: a tolerance that passes the unrounded product
    would not tell the two apart, so compare both against the kernel."""
    from verifypd.model.kernels.fp8_gemm import fp8_gemv

    x, q, _ = operands(4, 64, 512, torch.float16, seed=3)
    y = fp8_gemv(x, q.weight, q.scale, None, FP8_MAX, MIN_AMAX).float()
    rounded = reference(x, q, None, None).float()
    unrounded = (x.float() @ q.weight.float().t()) * q.scale
    assert (y - rounded).abs().max() < 0.2 * (y - unrounded).abs().max()


def test_every_launch_configuration_computes_the_same_product():
    from verifypd.model.kernels.fp8_gemm import CONFIGS, fp8_gemv

    x, q, _ = operands(16, 72, 272, torch.float16, seed=9)
    for bucket, launch in CONFIGS.items():
        for m in {bucket, max(1, bucket - 3)}:  # all rows of the program used, and some padded
            got = fp8_gemv(x[:m], q.weight, q.scale, None, FP8_MAX, MIN_AMAX, launch=launch)
            close(got, reference(x[:m], q, None, None))


def test_launch_table_holds_every_token_count():
    from verifypd.model.kernels.fp8_gemm import MAX_TOKENS, config

    assert all(config(m)[0] >= 16 for m in range(1, MAX_TOKENS + 1))  # tl.dot's least M
    with pytest.raises(ValueError, match=f"1..{MAX_TOKENS} tokens, got {MAX_TOKENS + 1}"):
        config(MAX_TOKENS + 1)

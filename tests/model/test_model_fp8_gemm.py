"""model.kernels.fp8_gemm (the weight-only fp8 product of few-token forwards) against its float32
spelling, for every M bucket of its launch table, ragged edges in M, N and K, with and without bias.
float16 here: the Triton interpreter multiplies bfloat16 dot operands as raw bits (the GPU run of
tests/model covers bfloat16)."""

from __future__ import annotations

import os

import pytest
import torch

from verifypd.model.fp8 import quantize_weight

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, q, bias):
    y = (x.float() @ q.weight.float().t()) * q.scale
    return (y if bias is None else y + bias.float()).to(x.dtype)


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 48, 96), (3, 80, 200), (16, 64, 512), (17, 40, 64), (64, 96, 48), (100, 24, 160)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_gemm_equals_its_float32_spelling(m, n, k, with_bias):
    from verifypd.model.kernels.fp8_gemm import fp8_weight_gemm

    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    # Rows of the weight and tokens of very different range: the per-channel scale must land on its column.
    q = quantize_weight(torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, n)[:, None])
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]).half()
    bias = torch.randn(n, generator=gen).half() if with_bias else None
    q.weight, q.scale = q.weight.to(DEVICE), q.scale.to(DEVICE)
    x = x.to(DEVICE)
    bias = bias.to(DEVICE) if bias is not None else None
    y = fp8_weight_gemm(x, q.weight, q.scale, bias)
    want = reference(x, q, bias)
    assert y.shape == (m, n) and y.dtype == torch.float16
    # float32 accumulation of exact products: only the summation order and the output rounding differ.
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-3, atol=2e-3 * want.float().abs().max().item())


def test_every_launch_configuration_computes_the_same_product():
    from verifypd.model.kernels.fp8_gemm import CONFIGS, fp8_weight_gemm

    gen = torch.Generator().manual_seed(9)
    q = quantize_weight(torch.randn(72, 272, generator=gen))
    x = torch.randn(33, 272, generator=gen).half()
    q.weight, q.scale, x = q.weight.to(DEVICE), q.scale.to(DEVICE), x.to(DEVICE)
    want = reference(x, q, None).float()
    for launch in CONFIGS.values():
        got = fp8_weight_gemm(x, q.weight, q.scale, launch=launch).float()
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item(), msg=str(launch))


def test_launch_table_keeps_the_gpu_busy():
    """Narrow matrices get narrower tiles, down to 16 channels, so the grid fills the SMs."""
    from verifypd.model.kernels.fp8_gemm import MAX_TOKENS, MIN_PROGRAMS, config

    for m in (1, 2, 16, 17, 33, 64, MAX_TOKENS):
        for n in (576, 4096, 12288, 22016):
            block_m, block_n, *_ = config(m, n)
            assert block_m >= min(m, 16) and block_n >= 16
            programs = -(-n // block_n) * -(-m // block_m)
            assert programs >= MIN_PROGRAMS or block_n == 16, (m, n, block_n)
    with pytest.raises(ValueError, match="1..128 tokens, got 129"):
        config(MAX_TOKENS + 1, 64)

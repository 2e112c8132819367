"""The fused Triton kernels against their torch twins (interpreter on CPU, native on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import DEVICE

pytest.importorskip("triton")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1", allow_module_level=True)

from verifypd.model.kernels.gelu_mul import gelu_mul
from verifypd.model.kernels.rms_norm import add_rms_norm
from verifypd.model.kernels.rope_kv import rope_and_store_kv
from verifypd.model.kernels.silu_mul import silu_mul
from verifypd.model.llama import rms_norm
from verifypd.model.rope import apply_rope


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(with_delta):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(5, 96, generator=gen).to(DEVICE)
    delta = torch.randn(5, 96, generator=gen).to(DEVICE) if with_delta else None
    weight = torch.randn(96, generator=gen).to(DEVICE)
    expected_h = h + delta if with_delta else h.clone()
    expected = rms_norm(expected_h, weight, 1e-5)
    got = add_rms_norm(h, delta, weight, 1e-5)
    assert rel(got, expected) < 1e-6
    assert rel(h, expected_h) < 1e-7  # residual updated in place


def test_silu_mul():
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(DEVICE)  # crosses a 1024 block
    gate, up = x.chunk(2, dim=-1)
    assert rel(silu_mul(x), F.silu(gate) * up) < 1e-6


def test_gelu_mul():
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(4)) * 3  # crosses a 1024 block
    x[0, :6] = torch.tensor([-200.0, -30.0, -1e-3, 0.0, 30.0, 200.0])  # tails: exp overflow must stay finite
    x = x.to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    got = gelu_mul(x)
    assert torch.isfinite(got).all()
    assert rel(got, F.gelu(gate, approximate="tanh") * up) < 1e-6
    half = gelu_mul(x.half())
    assert rel(half, (F.gelu(gate, approximate="tanh") * up).half()) < 1e-3


def test_rope_and_store_kv_skips_negative_slots():
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, tokens = 4, 2, 16, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE)
    half = torch.randn(10, dim // 2, generator=gen)
    table = torch.cat((half, half), dim=-1)  # HF rotate-half tables: both halves equal
    cos, sin = table.cos().to(DEVICE), table.sin().to(DEVICE)
    positions = torch.tensor([7, 2, 9], device=DEVICE)
    slots = torch.tensor([5, -1, 0], device=DEVICE)
    k_cache = torch.full((6, kv_heads, dim), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    q = rope_and_store_kv(qkv, cos, sin, positions, slots, k_cache, v_cache, heads)
    c, s = cos[positions][:, None], sin[positions][:, None]
    q_ref = apply_rope(qkv[:, : heads * dim].view(tokens, heads, dim), c, s)
    k_ref = apply_rope(qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim), c, s)
    v_ref = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    assert rel(q, q_ref) < 1e-6
    for token, slot in ((0, 5), (2, 0)):
        assert rel(k_cache[slot], k_ref[token]) < 1e-6
        assert torch.equal(v_cache[slot], v_ref[token])
    untouched = [1, 2, 3, 4]  # the slot -1 token wrote nowhere
    assert torch.isnan(k_cache[untouched]).all() and torch.isnan(v_cache[untouched]).all()


def test_rope_and_store_kv_with_qk_norm():
    """Qwen3 / Gemma 3: every q and k head RMS-normed over head_dim (own weights) before the rotation."""
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, tokens = 4, 2, 16, 3
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 5).to(DEVICE)
    half = torch.randn(10, dim // 2, generator=gen)
    table = torch.cat((half, half), dim=-1)
    cos, sin = table.cos().to(DEVICE), table.sin().to(DEVICE)
    q_norm, k_norm = (torch.randn(dim, generator=gen).to(DEVICE) for _ in range(2))
    positions, slots = torch.tensor([7, 2, 9], device=DEVICE), torch.tensor([5, 1, 0], device=DEVICE)
    k_cache = torch.zeros(6, kv_heads, dim, device=DEVICE)
    v_cache = k_cache.clone()
    q = rope_and_store_kv(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, q_norm, k_norm, 1e-6)
    c, s = cos[positions][:, None], sin[positions][:, None]
    q_in = qkv[:, : heads * dim].view(tokens, heads, dim)
    k_in = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    q_ref = apply_rope(rms_norm(q_in, q_norm, 1e-6), c, s)
    k_ref = apply_rope(rms_norm(k_in, k_norm, 1e-6), c, s)
    assert rel(q, q_ref) < 1e-6
    assert rel(k_cache[slots], k_ref) < 1e-6
    assert rel(q, apply_rope(q_in, c, s)) > 0.1  # the norm changed the answer

"""The Triton paged-attention kernel against a float64 reference: decode, verify, prefill, chunked
prefill over a cached prefix, GQA and MHA, block sizes 16 and 32, contexts crossing blocks, and
NaN garbage in slots no query may see. On CPU the kernel runs under TRITON_INTERPRET=1 (set
before triton is imported: see conftest.py); on a GPU (VERIFYPD_TEST_DEVICE=cuda) natively."""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import DEVICE

triton = pytest.importorskip("triton")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1", allow_module_level=True)

from verifypd.model.kernels.paged_attention import paged_attention  # noqa: E402


def reference(q, k_cache, v_cache, tables, positions, query_start, scale, window=0, softcap=0.0):
    """Per sequence: gather its context through the block table, causal softmax in float64 (keys
    > p - window only, with a window; scores capped to softcap * tanh(score / softcap), with a cap)."""
    out = torch.empty_like(q, dtype=torch.float64)
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    for b in range(query_start.numel() - 1):
        lo, hi = int(query_start[b]), int(query_start[b + 1])
        if hi == lo:
            continue
        ctx = int(positions[lo:hi].max()) + 1
        slots = [int(tables[b, p // bs]) * bs + p % bs for p in range(ctx)]
        keys = k_cache.reshape(-1, kv_heads, k_cache.shape[-1])[slots].double()  # [C, kvh, D]
        vals = v_cache.reshape(-1, kv_heads, v_cache.shape[-1])[slots].double()
        if window:  # slots before every query's window may hold garbage (a freed, reused block)
            first = int(positions[lo:hi].min()) - window + 1
            keys[: max(first, 0)], vals[: max(first, 0)] = 0, 0
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        vals = vals.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("thd,chd->htc", q[lo:hi].double(), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = positions[lo:hi].cpu()[:, None]
        allowed = torch.arange(ctx)[None, :] <= qpos
        if window:
            allowed &= torch.arange(ctx)[None, :] > qpos - window
        scores = scores.masked_fill(~allowed.to(scores.device)[None], float("-inf"))
        out[lo:hi] = torch.einsum("htc,chd->thd", scores.softmax(-1), vals)
    return out


def make_case(runs, *, heads, kv_heads, head_dim, block_size, dtype, gen):
    """runs: list of (context_before, new_tokens). Returns kernel inputs with shuffled block ids
    and NaN in every slot past each sequence's last position."""
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in runs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(len(runs), width, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    positions, query_start, used = [], [0], 0
    for b, ((ctx, new), nb) in enumerate(zip(runs, blocks_per_seq)):
        ids = perm[used : used + nb]
        used += nb
        tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        for p in range(ctx + new):
            blk, off = ids[p // block_size], p % block_size
            k_cache[blk, off] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[blk, off] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
        positions += list(range(ctx, ctx + new))
        query_start.append(query_start[-1] + new)
    q = torch.randn(len(positions), heads, head_dim, generator=gen).to(dtype)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return (
        to(q),
        to(k_cache),
        to(v_cache),
        to(tables),
        to(torch.tensor(positions, dtype=torch.long)),
        to(torch.tensor(query_start, dtype=torch.int32)),
        max(n for _, n in runs),
    )


CASES = {
    "decode": [(5, 1), (40, 1), (0, 1), (17, 1)],
    "verify": [(20, 5), (3, 2), (33, 7), (16, 1)],
    "prefill": [(0, 37), (0, 5), (0, 70)],
    "chunked_prefill": [(32, 20), (16, 48), (0, 9)],
}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_reference_fp32(kind, heads, kv_heads, block_size):
    gen = torch.Generator().manual_seed(hash((kind, heads, block_size)) % 1000)
    q, kc, vc, tables, pos, qs, max_q = make_case(
        CASES[kind], heads=heads, kv_heads=kv_heads, head_dim=32, block_size=block_size, dtype=torch.float32, gen=gen
    )
    out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
    paged_attention(q, kc, vc, tables, pos, qs, max_q, 32**-0.5, out=out)
    ref = reference(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), pos.cpu(), qs.cpu(), 32**-0.5)
    assert torch.isfinite(out).all()
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_half_precision(dtype):
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bfloat16 dot on CPU; checked on the GPU")
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, tables, pos, qs, max_q = make_case(
        CASES["verify"] + CASES["chunked_prefill"],
        heads=8,
        kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        gen=gen,
    )
    out = paged_attention(q, kc, vc, tables, pos, qs, max_q, 64**-0.5)
    ref = reference(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), pos.cpu(), qs.cpu(), 64**-0.5)
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("heads,kv_heads", [(2, 1), (2, 2)])
def test_kernel_head_dim_256(heads, kv_heads):
    """Gemma's head_dim (the kernel's smaller BLOCK_N and more warps), verify and prefill runs."""
    gen = torch.Generator().manual_seed(7)
    q, kc, vc, tables, pos, qs, max_q = make_case(
        [(20, 5), (0, 37), (40, 1)],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=256,
        block_size=16,
        dtype=torch.float32,
        gen=gen,
    )
    out = paged_attention(q, kc, vc, tables, pos, qs, max_q, 256**-0.5)
    ref = reference(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), pos.cpu(), qs.cpu(), 256**-0.5)
    assert torch.isfinite(out).all()
    assert (out.cpu().double() - ref).norm() / ref.norm() < 1e-5


def test_padded_grid_and_empty_sequences():
    """A CUDA graph's padded batch: max_query larger than any run, and sequences with no tokens."""
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, tables, pos, qs, _ = make_case(
        [(9, 3), (0, 0), (30, 1)], heads=4, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, gen=gen
    )
    out = paged_attention(q, kc, vc, tables, pos, qs, 8, 32**-0.5)
    ref = reference(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), pos.cpu(), qs.cpu(), 32**-0.5)
    assert (out.cpu().double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("kind", ["decode", "verify", "prefill", "chunked_prefill"])
@pytest.mark.parametrize("window,softcap", [(7, 0.0), (20, 0.0), (0, 2.0), (20, 2.0)])
def test_sliding_window_and_softcap(kind, window, softcap):
    """Gemma 2 / Mistral features: a query at p sees keys > p - window only (windows shorter than the
    contexts, one inside a 64-key tile and one across tiles), scores capped by softcap * tanh (a cap
    of 2 clips scores of this size). Slots before every window are NaN: never loaded."""
    gen = torch.Generator().manual_seed(11)
    q, kc, vc, tables, pos, qs, max_q = make_case(
        CASES[kind], heads=8, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, gen=gen
    )
    q = q * 3  # scores well past the cap
    if window:
        bs = kc.shape[1]
        for b in range(qs.numel() - 1):
            lo = int(qs[b])
            for p in range(max(int(pos[lo]) - window + 1, 0)):
                kc[tables[b, p // bs], p % bs] = float("nan")
                vc[tables[b, p // bs], p % bs] = float("nan")
    out = paged_attention(q, kc, vc, tables, pos, qs, max_q, 32**-0.5, window=window, softcap=softcap)
    args = (q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), pos.cpu(), qs.cpu(), 32**-0.5)
    ref = reference(*args, window=window, softcap=softcap)
    assert torch.isfinite(out).all()
    assert (out.cpu().double() - ref).norm() / ref.norm() < 1e-5
    plain = reference(*[a.nan_to_num() for a in args[:3]], *args[3:])  # the feature changes the answer
    assert (plain - ref).norm() / ref.norm() > 1e-2

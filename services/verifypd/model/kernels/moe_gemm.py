"""Grouped GEMM of the MoE experts (Triton): one kernel, launched twice per layer over a block
schedule (model.moe.align_to_blocks: pairs sorted by expert, blocks of BLOCK_M rows, one expert each).

    gate/up  (GATED):  hidden[slot] = act(x[pair // k] @ gate_e.T) * (x[pair // k] @ up_e.T)
             x [T, H], gate_up [E, 2I, H]              -> hidden [num_blocks * BLOCK_M, I]
    down:              out[pair] = round(hidden[slot] @ down_e.T) * weight[pair]
             hidden [S, I], down [E, H, I], weight [T*k] -> out [T * k, H]

`slot` is a row of the schedule, `pair` = t * k + j the pair it holds (padding rows hold T * k and are
neither read from x nor written to out). Program (m, n) computes block m's rows x columns
[n * BLOCK_N, (n + 1) * BLOCK_N); an idle block (expert -1) returns at once. Grid and shapes depend
only on T * k and E, so a CUDA graph replays the launches. Accumulation in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weight_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    top_k,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    slots = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + slots)
    real = pairs < num_pairs
    # Rows of A: the token of each pair (gate/up) or the schedule's own slot (down).
    a_rows = pairs // top_k if GATED else slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + ks)[None, :], mask=real[:, None] & k_ok[None, :], other=0.0
        )
        # B tile [BLOCK_K, BLOCK_N] of the expert's [N(, +N), K] matrix, read transposed.
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(b_base + cols[None, :] * stride_bn + (k0 + ks)[:, None], mask=b_mask, other=0.0)
        # float32 models: exact products (no TF32 on the GPU), as transformers' float32 reference.
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if GATED:  # the up rows sit N rows below the gate rows
            up = tl.load(b_base + (cols + N)[None, :] * stride_bn + (k0 + ks)[:, None], mask=b_mask, other=0.0)
            if IEEE:
                acc_up = tl.dot(a, up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, up, acc_up)
    out_mask = real[:, None] & col_ok[None, :]
    dtype = c_ptr.dtype.element_ty
    if GATED:
        # Each projection rounded to the model dtype first, as the unfused linear -> act -> mul does.
        gate = acc.to(dtype).to(tl.float32)
        if GELU:  # tanh GELU, written with exp of a non-positive argument (no overflow)
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            e = tl.exp(-2.0 * tl.abs(inner))
            th = (1.0 - e) / (1.0 + e)
            act = 0.5 * gate * (1.0 + tl.where(inner >= 0, th, -th))
        else:
            act = gate / (1.0 + tl.exp(-gate))
        out = act.to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
        tl.store(c_ptr + slots[:, None] * stride_cm + cols[None, :], out.to(dtype), mask=out_mask)
    else:
        w = tl.load(weight_ptr + pairs, mask=real, other=0.0).to(tl.float32)
        out = acc.to(dtype).to(tl.float32) * w[:, None]
        tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :], out.to(dtype), mask=out_mask)


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block from the mean pairs per expert (shapes only: the same for a graph's replays).
    16 is tl.dot's minimum; a decode step of a 128-expert model puts about 1 pair on each expert hit."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def _block(n: int) -> int:
    """A tile edge for a dimension of n: 64, or the power of two >= n (at least tl.dot's 16)."""
    return 64 if n >= 64 else max(16, triton.next_power_of_2(n))


def _launch(a, b, c, weight, schedule, num_pairs: int, top_k: int, n: int, gated: bool, gelu: bool) -> None:
    """One grouped GEMM: C rows from A rows times expert B [E, N(+N), K] transposed (see the module doc)."""
    pairs, block_expert, block_m = schedule
    k = a.shape[1]
    assert a.stride(1) == 1 and b.stride(2) == 1 and c.stride(1) == 1, "rows must be contiguous"
    block_n = _block(n)
    _moe_gemm_kernel[(block_expert.numel(), triton.cdiv(n, block_n))](
        a,
        b,
        c,
        weight,
        pairs,
        block_expert,
        num_pairs,
        top_k,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        GATED=gated,
        GELU=gelu,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=_block(k),
        num_warps=4,
    )


def moe_gate_up(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    activation: str,
    block_m: int,
) -> torch.Tensor:
    """hidden [len(sorted_pairs), I] in x.dtype: act(gate) * up of each scheduled pair. Padding rows
    are left unwritten; the down launch reads them but never stores their results."""
    inter = gate_up.shape[1] // 2
    hidden = torch.empty(sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    schedule = (sorted_pairs, block_expert, block_m)
    # The gated launch reads no routing weight: sorted_pairs stands in for the unused pointer.
    _launch(
        x, gate_up, hidden, sorted_pairs, schedule, x.shape[0] * top_k, top_k, inter, True, activation == "gelu_tanh"
    )
    return hidden


def moe_down(
    hidden: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    block_m: int,
) -> torch.Tensor:
    """[T * k, H] in hidden.dtype: each pair's expert output (rounded to the dtype) times its routing
    weight (`weights` [T, k], float32 or the model dtype)."""
    num_pairs = weights.numel()
    out = torch.empty(num_pairs, down.shape[1], dtype=hidden.dtype, device=hidden.device)
    schedule = (sorted_pairs, block_expert, block_m)
    _launch(hidden, down, out, weights.reshape(-1), schedule, num_pairs, 1, down.shape[1], False, False)
    return out

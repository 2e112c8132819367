"""The feature head's input in one launch (Triton): embedding gather, its RMSNorm, the hidden state's
RMSNorm and their concatenation; for a chain step also the row's position and KV slot.

    ids [T] long             tokens fed (a negative id wraps, as torch indexing does)
    embed [V, H]             the target's embeddings
    g [T, H]                 fc(features) in the catch-up, the previous row's pre-norm output in the chain
    returns x [T, 2H]        concat(input_norm(embed[ids]), hidden_norm(g)), each as `add_rms_norm`
                             computes it (statistics in float32, weight * normed in the model dtype)
Chain step j (1-based, a Python int baked into a CUDA graph): row r is active while j < ks[r]; it
feeds at position base[r] + j - 1 and writes KV at that position's slot, an inactive row sits at
base[r] - 1 (its catch-up's last row, whose KV exists) and writes nowhere (slot -1). This replaces
~14 small kernels per chain step (index, where, gather, div/mod, clone, two norms, cat).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _head_input_kernel(
    ids_ptr,
    embed_ptr,
    g_ptr,
    w_in_ptr,
    w_hid_ptr,
    out_ptr,
    base_ptr,
    ks_ptr,
    tables_ptr,
    positions_ptr,
    slots_ptr,
    vocab,
    width,
    eps,
    stride_g,
    stride_o,
    stride_tab,
    step,
    block_size,
    STEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    tok = tl.load(ids_ptr + row)
    tok = tl.where(tok < 0, tok + vocab, tok)
    e = tl.load(embed_ptr + tok * width + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(e * e, axis=0) / width + eps)
    w = tl.load(w_in_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, w * (e * rstd).to(out_ptr.dtype.element_ty), mask=ok)
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(g * g, axis=0) / width + eps)
    w = tl.load(w_hid_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + width + cols, w * (g * rstd).to(out_ptr.dtype.element_ty), mask=ok)
    if STEP:
        base = tl.load(base_ptr + row)
        active = step < tl.load(ks_ptr + row)
        pos = tl.where(active, base + step - 1, base - 1)
        block = tl.load(tables_ptr + row * stride_tab + pos // block_size)
        tl.store(positions_ptr + row, pos)
        tl.store(slots_ptr + row, tl.where(active, block * block_size + pos % block_size, -1))


def head_input(
    ids: torch.Tensor,
    embed: torch.Tensor,
    g: torch.Tensor,
    w_in: torch.Tensor,
    w_hid: torch.Tensor,
    eps: float,
    step: tuple | None = None,
) -> torch.Tensor:
    """x [T, 2H]. `step` = (j, base, ks, tables, block_size, positions_out, slots_out) for a chain step."""
    rows, width = g.shape
    assert g.stride(-1) == 1 and embed.is_contiguous() and embed.shape[1] == width
    out = torch.empty(rows, 2 * width, dtype=g.dtype, device=g.device)
    if not rows:
        return out
    if step is None:
        j, base, ks, tables, block_size, positions, slots = 0, ids, ids, ids, 1, ids, ids  # unused
    else:
        j, base, ks, tables, block_size, positions, slots = step
        assert tables.stride(-1) == 1
    block = triton.next_power_of_2(width)
    _head_input_kernel[(rows,)](
        ids,
        embed,
        g,
        w_in,
        w_hid,
        out,
        base,
        ks,
        tables,
        positions,
        slots,
        embed.shape[0],
        width,
        eps,
        g.stride(0),
        out.stride(0),
        tables.stride(0),
        j,
        block_size,
        STEP=step is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out

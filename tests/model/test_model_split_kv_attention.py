"""Split-KV paged attention (kernels/paged_attention.py `splits`): each program's keys cut into parts run
by programs of their own, their partial softmax sums combined by a second kernel, equal the float64
reference for decode, verify, prefill and a short suffix over a long cached prefix; GQA and MHA, a
sliding window, a padded graph grid and contexts shorter than the split count (idle parts). On CPU the
kernels run under TRITON_INTERPRET=1 (conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import DEVICE
from test_model_paged_attention import CASES, make_case, reference

triton = pytest.importorskip("triton")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1", allow_module_level=True)

from verifypd.model.kernels.paged_attention import paged_attention  # noqa: E402
from verifypd.model.split_kv import attention_programs, kv_splits  # noqa: E402

# a prefix-cache hit: a few new tokens after a long cached prefix; and two contexts shorter than the parts
CASES = {**CASES, "cached_suffix": [(300, 18)], "short": [(3, 2), (0, 1)]}


def relative_error(out, q, kc, vc, tables, pos, qs, scale, window=0) -> float:
    ref = reference(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), pos.cpu(), qs.cpu(), scale, window)
    assert torch.isfinite(out).all()
    return float((out.cpu().double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("splits", [2, 8])
def test_split_kernel_matches_reference_fp32(kind, heads, kv_heads, splits):
    gen = torch.Generator().manual_seed(hash((kind, heads, splits)) % 1000)
    q, kc, vc, tables, pos, qs, max_q = make_case(
        CASES[kind], heads=heads, kv_heads=kv_heads, head_dim=32, block_size=16, dtype=torch.float32, gen=gen
    )
    out = torch.full_like(q, float("nan"))  # poisoned: every row must be written by the combine
    paged_attention(q, kc, vc, tables, pos, qs, max_q, 32**-0.5, out=out, splits=splits)
    assert relative_error(out, q, kc, vc, tables, pos, qs, 32**-0.5) < 1e-5


def test_split_with_a_window_and_a_padded_grid():
    gen = torch.Generator().manual_seed(11)
    q, kc, vc, tables, pos, qs, _ = make_case(
        [(200, 6), (0, 0), (40, 1)], heads=4, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, gen=gen
    )
    out = paged_attention(q, kc, vc, tables, pos, qs, 16, 32**-0.5, window=70, splits=4)
    assert relative_error(out, q, kc, vc, tables, pos, qs, 32**-0.5, window=70) < 1e-5


def test_split_count():
    assert kv_splits(32, 132) == 16  # Llama-2-7B at batch 1: 32 heads, one tile
    assert kv_splits(6, 132) == 16  # capped
    assert kv_splits(100, 132) == 4
    assert kv_splits(1024, 132) == 1
    assert attention_programs(1, 32, 1, 32) == 32 and attention_programs(1, 3, 3, 32) == 6
    with pytest.raises(ValueError, match="splits"):
        q, kc, vc, tables, pos, qs, max_q = make_case(
            [(4, 1)], heads=2, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, gen=torch.Generator()
        )
        paged_attention(q, kc, vc, tables, pos, qs, max_q, 1.0, splits=3)

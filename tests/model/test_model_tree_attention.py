"""Tree attention (draft trees): the Triton kernel's tree mode and the reference path's mask against a
float64 reference where each query sees the committed prefix plus its ancestors' slots; garbage (NaN)
in every other slot, the tree's unseen siblings included."""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import DEVICE

from verifypd.model.llama import BatchLayout
from verifypd.model.reference_attention import tree_allowed
from verifypd.spec_decode.tree import ancestor_bits

triton = pytest.importorskip("triton")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1", allow_module_level=True)

from verifypd.model.kernels.paged_attention import paged_attention  # noqa: E402


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """parents [n] of a random tree in topological order (node 0 the root)."""
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]
    return torch.tensor(parents)


def make_case(seqs, *, heads, kv_heads, head_dim, block_size, gen, queries="all"):
    """seqs: (prefix length, tree nodes). Tree node j's K/V sit at slot prefix + j; every slot past the
    tree is NaN. queries "all": every node (a verify call); "last": the last third (a draft step whose
    earlier nodes were written by earlier steps)."""
    dtype = torch.float32
    blocks_per_seq = [-(-(c + n) // block_size) + 1 for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    q_rows, bits, base, lens, qstart, visible, used = [], [], [], [], [0], [], 0
    for b, ((ctx, n), nb) in enumerate(zip(seqs, blocks_per_seq)):
        ids = perm[used : used + nb]
        used += nb
        tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        for p in range(ctx + n):
            k_cache[ids[p // block_size], p % block_size] = torch.randn(kv_heads, head_dim, generator=gen)
            v_cache[ids[p // block_size], p % block_size] = torch.randn(kv_heads, head_dim, generator=gen)
        parents = random_tree(n, gen)
        anc = ancestor_bits(parents[None], n)[0]
        nodes = range(n) if queries == "all" else range(n - max(1, n // 3), n)
        for j in nodes:
            q_rows.append(torch.randn(heads, head_dim, generator=gen))
            bits.append(int(anc[j]))
            visible.append(list(range(ctx)) + [ctx + i for i in range(n) if (int(anc[j]) >> i) & 1])
        base.append(ctx)
        lens.append(n)
        qstart.append(qstart[-1] + len(nodes))
    max_query = max(qstart[i + 1] - qstart[i] for i in range(len(seqs)))
    return dict(
        q=torch.stack(q_rows),
        k_cache=k_cache,
        v_cache=v_cache,
        tables=tables,
        query_start=torch.tensor(qstart, dtype=torch.int32),
        tree=(torch.tensor(base), torch.tensor(lens, dtype=torch.int32), torch.tensor(bits, dtype=torch.long)),
        visible=visible,
        max_query=max_query,
    )


def reference(case, scale):
    q, k_cache, v_cache, tables = case["q"], case["k_cache"], case["v_cache"], case["tables"]
    heads, kv_heads, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q, dtype=torch.float64)
    qs = case["query_start"].tolist()
    for b in range(len(qs) - 1):
        for t in range(qs[b], qs[b + 1]):
            slots = [int(tables[b, p // bs]) * bs + p % bs for p in case["visible"][t]]
            keys = k_cache.reshape(-1, kv_heads, k_cache.shape[-1])[slots].double()
            vals = v_cache.reshape(-1, kv_heads, v_cache.shape[-1])[slots].double()
            keys = keys.repeat_interleave(heads // kv_heads, 1)
            vals = vals.repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("hd,chd->hc", q[t].double(), keys) * scale
            out[t] = torch.einsum("hc,chd->hd", scores.softmax(-1), vals)
    return out


CASES = [
    dict(seqs=[(5, 9)], heads=4, kv_heads=2, head_dim=16, block_size=4),
    dict(seqs=[(0, 3), (21, 17), (16, 1)], heads=4, kv_heads=1, head_dim=32, block_size=16),
    dict(seqs=[(40, 64), (3, 33)], heads=2, kv_heads=2, head_dim=16, block_size=8),
]


@pytest.mark.parametrize("queries", ["all", "last"])
@pytest.mark.parametrize("spec", CASES)
def test_tree_kernel_matches_reference(spec, queries):
    gen = torch.Generator().manual_seed(len(spec["seqs"]) * 7 + spec["block_size"])
    case = make_case(gen=gen, queries=queries, **spec)
    scale = spec["head_dim"] ** -0.5
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    # positions only place RoPE in tree mode: pass garbage-free but meaningless ones
    positions = torch.zeros(case["q"].shape[0], dtype=torch.long)
    out = paged_attention(
        dev(case["q"]),
        dev(case["k_cache"]),
        dev(case["v_cache"]),
        dev(case["tables"]),
        dev(positions),
        dev(case["query_start"]),
        case["max_query"],
        scale,
        tree=tuple(dev(t) for t in case["tree"]),
    )
    expected = reference(case, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("queries", ["all", "last"])
@pytest.mark.parametrize("spec", CASES)
def test_reference_tree_mask_sees_prefix_and_ancestors(spec, queries):
    gen = torch.Generator().manual_seed(3)
    case = make_case(gen=gen, queries=queries, **spec)
    tables, bs = case["tables"], spec["block_size"]
    batch = BatchLayout(
        input_ids=torch.zeros(case["q"].shape[0], dtype=torch.long),
        positions=torch.zeros(case["q"].shape[0], dtype=torch.long),
        slots=torch.zeros(case["q"].shape[0], dtype=torch.long),
        block_tables=tables,
        query_start=case["query_start"],
        max_query=case["max_query"],
        tree_base=case["tree"][0],
        tree_len=case["tree"][1],
        tree_bits=case["tree"][2],
    )
    starts = case["query_start"].long()
    seq_of = torch.repeat_interleave(torch.arange(len(spec["seqs"])), starts[1:] - starts[:-1])
    idx = torch.arange(seq_of.numel()) - starts[seq_of]
    allowed = tree_allowed(batch, torch.arange(tables.shape[1] * bs), seq_of, idx)
    for t in range(seq_of.numel()):
        assert torch.nonzero(allowed[seq_of[t], idx[t]]).flatten().tolist() == case["visible"][t]

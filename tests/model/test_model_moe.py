"""The MoE layer (model.moe): routing and the reference expert loop against transformers'
MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock, the block schedule's invariants, and the grouped
Triton kernel (interpreter on CPU) against the reference."""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import DEVICE

from verifypd.model.moe import MoeWeights, align_to_blocks, max_blocks, moe_forward, route

needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_moe(experts: int, hidden: int, inter: int, seed: int, dtype=torch.float32) -> MoeWeights:
    gen = torch.Generator().manual_seed(seed)

    def rand(*size):
        return (torch.randn(*size, generator=gen) * size[-1] ** -0.5).to(DEVICE, dtype)

    return MoeWeights(
        router=rand(experts, hidden), gate_up=rand(experts, 2 * inter, hidden), down=rand(experts, hidden, inter)
    )


def hf_block(family: str, experts: int, top_k: int, hidden: int, inter: int, norm_topk: bool = True):
    """transformers' sparse MoE block of `family` with random weights, and the same weights as MoeWeights."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(11)
    if family == "mixtral":
        config = MixtralConfig(
            hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=top_k
        )
        block = MixtralSparseMoeBlock(config)
    else:
        config = Qwen3MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=norm_topk,
        )
        block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    block.eval()
    w = MoeWeights(block.gate.weight.data, block.experts.gate_up_proj.data, block.experts.down_proj.data)
    return block, w


@pytest.mark.parametrize(
    "family,norm_topk,float32_weights",
    [("mixtral", True, True), ("qwen3_moe", False, False), ("qwen3_moe", True, False)],
)
def test_reference_matches_transformers_block(family, norm_topk, float32_weights):
    block, w = hf_block(family, experts=8, top_k=2, hidden=32, inter=24, norm_topk=norm_topk)
    x = torch.randn(1, 37, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = block(x)[0]
    got = moe_forward(x[0], w, 2, norm_topk, float32_weights=float32_weights, path="reference")
    assert rel(got, expected) < 1e-6


def test_routing_order_and_dtypes():
    """Softmax over all experts, then top-k, then renormalise: the renormalised weights sum to 1, the
    plain ones are the raw softmax probabilities (smaller); Qwen3-MoE's come back in the hidden dtype."""
    gen = torch.Generator().manual_seed(5)
    x, router = torch.randn(6, 16, generator=gen).half(), torch.randn(8, 16, generator=gen).half()
    plain, ids = route(x, router, 3, False, True)
    renorm, ids2 = route(x, router, 3, True, True)
    probs = torch.softmax((x @ router.t()).float(), -1)
    assert torch.equal(ids, ids2) and torch.equal(ids, probs.topk(3).indices)
    assert plain.dtype == torch.float32 and torch.allclose(plain, probs.gather(1, ids))
    assert torch.allclose(renorm.sum(-1), torch.ones(6)) and (plain.sum(-1) < 1).all()
    assert route(x, router, 3, True, False)[0].dtype == torch.float16


@pytest.mark.parametrize(
    "pairs_shape,experts,block_m", [((5, 2), 4, 16), ((1, 8), 128, 16), ((40, 2), 3, 16), ((64, 8), 16, 32)]
)
def test_block_schedule_invariants(pairs_shape, experts, block_m):
    """Every pair lands once, in a block of its own expert; no block mixes experts; shapes depend only
    on the sizes (CUDA-graph replays), and the bound holds when every expert is hit."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(experts, generator=gen)[: pairs_shape[1]] for _ in range(pairs_shape[0])])
    s = align_to_blocks(ids.to(DEVICE), experts, block_m)
    pairs, n = s.sorted_pairs.cpu(), ids.numel()
    assert pairs.numel() == max_blocks(n, experts, block_m) * block_m
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))
    slot_expert = s.block_expert.cpu().repeat_interleave(block_m)
    flat = ids.flatten()
    assert torch.equal(slot_expert[pairs < n], flat[real])  # each pair sits in its expert's block
    idle = s.block_expert.cpu() < 0
    assert (pairs.view(-1, block_m)[idle] == n).all()  # idle blocks hold only padding


@needs_triton
@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter,activation,normalize",
    [
        (13, 8, 2, 32, 48, "silu", True),  # Mixtral-like, intermediate not a tile multiple
        (1, 64, 8, 64, 24, "silu", True),  # one decode token, many experts: most blocks idle
        (70, 4, 2, 80, 40, "silu", False),  # several blocks per expert, hidden > one 64 tile
        (9, 6, 3, 32, 32, "gelu_tanh", True),
    ],
)
def test_grouped_kernel_matches_reference(tokens, experts, top_k, hidden, inter, activation, normalize):
    w = random_moe(experts, hidden, inter, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    args = (x, w, top_k, normalize, activation)
    ref = moe_forward(*args, path="reference")
    got = moe_forward(*args, path="grouped")
    assert rel(got, ref) < 1e-5


@needs_triton
def test_grouped_kernel_half_precision_and_empty_batch():
    w = random_moe(8, 32, 48, seed=2, dtype=torch.float16)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    for float32_weights in (True, False):
        ref = moe_forward(x, w, 2, True, float32_weights=float32_weights, path="reference")
        got = moe_forward(x, w, 2, True, float32_weights=float32_weights, path="grouped")
        assert got.dtype == torch.float16 and rel(got, ref) < 2e-3
    empty = moe_forward(x[:0], w, 2, True, path="grouped")
    assert empty.shape == (0, 32)


def test_bad_activation_is_refused():
    w = random_moe(4, 16, 8, seed=1)
    with pytest.raises(ValueError, match="activation"):
        moe_forward(torch.zeros(2, 16, device=DEVICE), w, 2, True, "relu")

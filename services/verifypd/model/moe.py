"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks `top_k` of `E` SwiGLU experts per token.

    x [T, H] -> router logits [T, E] -> softmax (float32) -> top-k [T, k] -> (renormalised) weights
             -> sum over the k chosen experts of weight * down_e(act(gate_e(x)) * up_e(x))

The order and dtypes follow transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: logits in
the hidden dtype, softmax in float32, top-k of the probabilities, renormalised over the k (Mixtral
always, Qwen3-MoE when `norm_topk_prob`), and the weights kept in float32 (Mixtral) or cast back to
the hidden dtype (Qwen3-MoE). Each expert's output is rounded to the hidden dtype before it is weighted.

Two expert paths, the same routing:
  * reference (CPU, the oracle in tests): a loop over the experts that received tokens, index_add.
    Its loop bounds come from the routing, so it syncs with the host: never inside a CUDA graph.
  * grouped (CUDA default): the k * T (token, expert) pairs sorted by expert into blocks of BLOCK_M
    rows, each block owned by one expert (`align_to_blocks`, torch ops of fixed shapes, no host
    sync), then two launches of one grouped-GEMM Triton kernel (model.kernels.moe_gemm): gate/up with
    the activation fused, and down scaled by the routing weight. Capturable in a CUDA graph.

Weights are stacked per layer: gate_up [E, 2I, H] (gate rows first, as transformers 5 stores
`experts.gate_up_proj`), down [E, H, I]. Under tensor parallelism every rank holds every expert's
slice of the intermediate dim (gate_up rows [r*I/w, (r+1)*I/w) of gate and of up, down's matching
columns) and the replicated router; the MoE output is then a partial sum, all-reduced like a dense MLP's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EXPERT_PATHS = ("reference", "grouped")
MOE_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert (transformers' moe_intermediate_size; Mixtral's intermediate_size)
    normalize_topk: bool  # renormalise the top-k probabilities to sum to 1 (Mixtral: always)
    float32_weights: bool  # routing weights stay float32 (Mixtral); False: cast to the hidden dtype (Qwen3-MoE)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead (Qwen3-MoE mlp_only_layers, sparse step)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass
class MoeWeights:
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
    down: torch.Tensor  # [E, H, I]


def expert_path(attention: str) -> str:
    """The expert path of a model on attention backend `attention`: grouped with the Triton kernels
    (the CUDA default; capturable), the reference loop with the torch reference. VERIFYPD_MOE=
    reference|grouped overrides (tests, debugging)."""
    name = os.environ.get("VERIFYPD_MOE") or ("grouped" if attention == "triton" else "reference")
    if name not in EXPERT_PATHS:
        raise ValueError(f"VERIFYPD_MOE must be reference or grouped, got {name!r}")
    return name


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, normalize_topk: bool, float32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32 or x.dtype, expert ids [T, k] int64) of each token's top-k experts."""
    logits = F.linear(x, router)  # [T, E] in the hidden dtype
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float32_weights else weights.to(x.dtype)), ids


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def experts_reference(
    x: torch.Tensor, w: MoeWeights, weights: torch.Tensor, ids: torch.Tensor, activation: str
) -> torch.Tensor:
    """[T, H]: the weighted sum of each token's chosen experts, one matmul pair per expert hit."""
    out = torch.zeros_like(x)
    hits = torch.bincount(ids.flatten(), minlength=w.router.shape[0]).nonzero().flatten().tolist()
    for e in hits:
        token, slot = torch.where(ids == e)
        y = F.linear(act_mul(F.linear(x[token], w.gate_up[e]), activation), w.down[e])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


@dataclass
class BlockSchedule:
    """The (token, expert) pairs of a batch sorted by expert into blocks of `block_m` rows.

    Pair p = t * k + j is token t's j-th choice. Expert e's pairs fill ceil(count_e / block_m) whole
    blocks (the tail padded with the sentinel T * k); blocks past the last expert's are idle (-1).
    Shapes depend only on (T * k, E, block_m), so a CUDA graph can replay them:

        sorted_pairs  [num_blocks * block_m] int64: pair id, or T * k (padding)
        block_expert  [num_blocks] int64: the expert of each block, -1 when idle
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on sum_e ceil(count_e / block_m) over any routing: each of the at most
    min(E, pairs) experts hit wastes less than one block."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def align_to_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> BlockSchedule:
    """The block schedule of routing `ids` [T, k], in torch ops of fixed shapes (no host sync)."""
    flat = ids.flatten()
    pairs, dev = flat.numel(), flat.device
    blocks = max_blocks(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # pair ids, grouped by expert, in pair order within one
    expert = flat[order]
    rank = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[expert]  # index within the expert
    sorted_pairs = torch.full((blocks * block_m,), pairs, dtype=torch.int64, device=dev)
    sorted_pairs.scatter_(0, (padded_end - padded)[expert] + rank, order)
    starts = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)  # first expert ending past the start
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return BlockSchedule(sorted_pairs, block_expert, block_m)


def experts_grouped(
    x: torch.Tensor, w: MoeWeights, weights: torch.Tensor, ids: torch.Tensor, activation: str
) -> torch.Tensor:
    """[T, H]: the same sum as experts_reference through the grouped-GEMM kernel (no host sync)."""
    from verifypd.model.kernels.moe_gemm import moe_down, moe_gate_up, pick_block_m

    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    schedule = align_to_blocks(ids, w.router.shape[0], pick_block_m(tokens * top_k, w.router.shape[0]))
    hidden = moe_gate_up(
        x, w.gate_up, schedule.sorted_pairs, schedule.block_expert, top_k, activation, schedule.block_m
    )
    per_pair = moe_down(hidden, w.down, weights, schedule.sorted_pairs, schedule.block_expert, schedule.block_m)
    # [T * k, H] -> [T, H]: the k weighted expert outputs of each token, summed in float32.
    return per_pair.view(tokens, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)


def moe_forward(
    x: torch.Tensor,
    weights: MoeWeights,
    top_k: int,
    normalize_topk: bool,
    activation: str = "silu",
    *,
    float32_weights: bool = True,
    path: str = "reference",
) -> torch.Tensor:
    """[T, H] -> [T, H]: the MoE MLP of one layer (a partial sum under tensor parallelism)."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"MoE activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    routing, ids = route(x, weights.router, top_k, normalize_topk, float32_weights)
    experts = experts_grouped if path == "grouped" else experts_reference
    return experts(x, weights, routing, ids, activation)

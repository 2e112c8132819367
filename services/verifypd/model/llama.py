"""Llama-family forward pass over paged KV (Llama, Mistral, Qwen2, Gemma and friends).

Two attention backends behind one forward:
  * "triton" (CUDA default): `paged_attention` reads K/V in place through the block table and
    `store_kv` writes new K/V in one launch. The forward has no host syncs, so the runner can
    capture it in a CUDA graph.
  * "reference" (CPU default, and the oracle in tests): new K/V are scattered into the pool by
    slot, each context is gathered through its block table and attended with
    `scaled_dot_product_attention` on a padded batch.

Gemma (v1) is the same forward with three shape flags: embeddings scaled by sqrt(hidden)
(`embed_scale`), a GeGLU MLP (`mlp_activation="gelu_tanh"`) and RMSNorm by (1 + w), which the loader
folds into the stored norm weights (`norm_offset`); head_dim may differ from hidden / heads.

Shapes (T = new tokens in the batch, B = sequences, Q = longest query run, C = longest context
padded to whole blocks):

    hidden      [T, H]
    pool        [2, layers, num_blocks, block_size, kv_heads, head_dim]
    reference:  q (padded) [B, heads, Q, head_dim];  k, v (gathered) [B, kv_heads, C, head_dim]

The pool is in the model dtype or in float8_e4m3fn (`--kv-cache-dtype fp8`, model.kv_quant): both
backends quantize the new K/V as they store them and read the context back from the pool, the new
tokens' own K/V included, so a token's logits depend on the same stored values whichever batch
(prefill, decode, verify) computed it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, overload

import torch
import torch.nn.functional as F

from verifypd.model import kv_quant
from verifypd.model.fp8 import Fp8Weight, linear
from verifypd.model.moe import MoeShape, MoeWeights, expert_path, moe_forward
from verifypd.model.reference_attention import attention_mask, reference_attention, store_kv_reference
from verifypd.model.rope import apply_rope, rope_tables

if TYPE_CHECKING:
    from verifypd.model.features import FeaturePool


class TpGroup(Protocol):
    """What the forward needs of a process group (model.tensor_parallel: sharding, the groups)."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` over the ranks, in place."""


@dataclass
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_context: int
    rope_scaling: dict | None = None  # llama3-style frequency scaling, or None
    qkv_bias: bool = False  # Qwen2
    mlp_activation: str = "silu"  # act(gate) * up: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embed_scale: bool = False  # Gemma: embeddings * sqrt(hidden_size), the factor rounded to the dtype
    norm_offset: float = 0.0  # Gemma: norms multiply by (offset + w); folded into the weights at
    # load (families.weights_from_source), never read by the forward
    # The features below are all off for plain Llama: the forward then runs none of their ops.
    qk_norm: bool = False  # Qwen3, Qwen3-MoE, Gemma 3: RMSNorm over head_dim of every q and k head, before RoPE
    sandwich_norms: bool = False  # Gemma 2/3: the attention and MLP outputs are normed too (4 norms a layer)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma 2/3: query_pre_attn_scalar)
    attn_softcap: float | None = None  # Gemma 2: attention scores -> cap * tanh(scores / cap), before the mask
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # the sliding layers' window: a query at p sees keys > p - window
    sliding_layers: tuple[int, ...] = ()  # which layers slide (Mistral, Phi-3: all; Gemma 2/3: some)
    moe: MoeShape | None = None  # Mixtral, Qwen3-MoE: the experts of the MoE layers (model.moe)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base (unscaled)

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window in positions; 0: the whole context."""
        return (self.sliding_window or 0) if layer in self.sliding_layers else 0


MLP_ACTIVATIONS = ("silu", "gelu_tanh")


Linear = torch.Tensor | Fp8Weight  # a projection's weight [N, K]


@dataclass
class LayerWeights:
    # The four projections are plain tensors in the model dtype, or fp8 with scales (model.fp8).
    qkv: Linear  # [(heads + 2 kv_heads) * head_dim, H]
    qkv_bias: torch.Tensor | None
    o: Linear  # [H, heads * head_dim]
    gate_up: Linear | None  # [2 * I, H] (None in an MoE layer)
    down: Linear | None  # [H, I] (None in an MoE layer)
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H] the norm before the MLP
    moe: MoeWeights | None = None  # the router and experts of an MoE layer (model.moe)
    q_norm: torch.Tensor | None = None  # [head_dim] (shape.qk_norm)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [H] on the attention output (shape.sandwich_norms)
    mlp_out_norm: torch.Tensor | None = None  # [H] on the MLP output

    def dense_mlp(self) -> tuple[Linear, Linear]:
        """(gate_up, down) of a dense layer."""
        if self.gate_up is None or self.down is None:
            raise ValueError("an MoE layer has no dense MLP")
        return self.gate_up, self.down


def unit_norms(shape: LlamaShape, device, dtype) -> dict[str, Any]:
    """LayerWeights' optional norms that `shape` uses, as ones (random-weight models for benchmarks)."""
    norms: dict[str, Any] = {}
    if shape.qk_norm:
        norms["q_norm"] = norms["k_norm"] = torch.ones(shape.head_dim, device=device, dtype=dtype)
    if shape.sandwich_norms:
        norms["attn_out_norm"] = norms["mlp_out_norm"] = torch.ones(shape.hidden_size, device=device, dtype=dtype)
    return norms


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (may alias embed)


@dataclass
class BatchLayout:
    """Where each new token goes and what it attends to. Built by the runner (or static buffers of a
    CUDA graph). Tokens of a sequence are consecutive; positions never decrease within a run."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long: block_id * block_size + offset in the pool, -1 = write nowhere
    block_tables: torch.Tensor  # [B, W] int32/int64 (entries past a sequence's blocks are never read)
    query_start: torch.Tensor  # [B + 1] int32: tokens of sequence b are [query_start[b], query_start[b+1])
    max_query: int  # upper bound on tokens of one sequence
    # Tree mode (draft trees; kernels/paged_attention.py's module doc): per sequence its tree's first
    # key slot and node count [B], per token the bitmask of the tree slots it sees [T] int64. None: causal.
    tree_base: torch.Tensor | None = None
    tree_len: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None
    # Split-KV attention (model.split_kv): parts each Triton attention program's keys are cut into
    # (1: none). The reference path ignores it.
    kv_splits: int = 1
    # Sequences with fewer keys than this are not cut (kernels/paged_attention.py `split_min_keys`).
    kv_split_min_keys: int = 0

    @property
    def tree(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if self.tree_bits is None:
            return None
        assert self.tree_base is not None and self.tree_len is not None
        return self.tree_base, self.tree_len, self.tree_bits


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def attention_backend(name: str, device: torch.device) -> str:
    """ "auto" picks the Triton kernels on CUDA and the torch reference elsewhere;
    VERIFYPD_ATTENTION=reference|triton overrides "auto" (tests, debugging)."""
    if name == "auto":
        name = os.environ.get("VERIFYPD_ATTENTION") or ("triton" if device.type == "cuda" else "reference")
    if name not in ("triton", "reference"):
        raise ValueError(f"attention backend must be triton, reference or auto, got {name!r}")
    return name


class PagedLlama:
    """A stateless forward over given weights; `num_layers` < shape.num_layers gives the
    self-speculative draft (first layers + final norm + head, sharing the target's tensors)."""

    def __init__(
        self, shape: LlamaShape, weights: LlamaWeights, num_layers: int | None = None, attention: str = "auto"
    ):
        self.shape = shape
        self.weights = weights
        self.num_layers = num_layers or shape.num_layers
        if not (1 <= self.num_layers <= len(weights.layers)):
            raise ValueError(f"num_layers must be in [1, {len(weights.layers)}], got {self.num_layers}")
        if shape.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got {shape.mlp_activation!r}")
        device = weights.embed.device
        self.attention = attention_backend(attention, device)
        self.moe_path = expert_path(self.attention)
        if self.attention == "triton":  # imported only here: CPU installs need no Triton
            from verifypd.model.kernels.paged_attention import paged_attention
            from verifypd.model.kernels.rms_norm import add_rms_norm
            from verifypd.model.kernels.rope_kv import rope_and_store_kv

            if shape.mlp_activation == "gelu_tanh":
                from verifypd.model.kernels.gelu_mul import gelu_mul as act_mul
            else:
                from verifypd.model.kernels.silu_mul import silu_mul as act_mul
            self._kernels = (add_rms_norm, act_mul, rope_and_store_kv, paged_attention)
        # Gemma (as transformers does): the factor is rounded to the hidden dtype before multiplying.
        # A FeaturePool (model.features) when a feature draft reads this model's states.
        self.features: FeaturePool | None = None
        # A TpGroup (model.tensor_parallel) when this is one rank of a tensor-parallel model: the shape
        # and weights are then the rank's shard, and the attention and MLP outputs are partial sums.
        self.tp_group: TpGroup | None = None
        # Called with i once layer i's new K/V are in the pool (queued on the current stream), before
        # layer i + 1 runs: a disaggregated prefill lane copies that layer to its owner meanwhile
        # (lanes/rpc/peer_copy.py). Not called by a CUDA graph replay (its caller copies afterwards).
        self.after_layer_kv: Callable[[int], None] | None = None
        self.embed_scale = (
            torch.tensor(shape.hidden_size**0.5, dtype=weights.embed.dtype, device=device)
            if shape.embed_scale
            else None
        )
        self.scale = shape.attn_scale or shape.head_dim**-0.5
        # cos/sin of every position (rope_tables), and each layer's: the sliding layers of Gemma 3
        # rotate by their own base.
        dtype = weights.embed.dtype
        self.rope_cos, self.rope_sin = rope_tables(shape, dtype, device)
        local = rope_tables(shape, dtype, device, local=True) if shape.local_rope_theta is not None else None
        self.layer_rope = [
            local if local is not None and shape.window(i) else (self.rope_cos, self.rope_sin)
            for i in range(self.num_layers)
        ]
        self.windows = sorted({shape.window(i) for i in range(self.num_layers)})  # 0: full attention

    @overload
    def forward(
        self,
        pool: torch.Tensor,
        batch: BatchLayout,
        logits_index: torch.Tensor,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
    @overload
    def forward(
        self, pool: torch.Tensor, batch: BatchLayout, logits_index: None, logits_out: torch.Tensor | None = None
    ) -> None: ...
    @torch.inference_mode()
    def forward(
        self,
        pool: torch.Tensor,
        batch: BatchLayout,
        logits_index: torch.Tensor | None,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Writes the new tokens' KV into `pool`; returns logits [len(logits_index), V] in the model's
        dtype (into `logits_out` when given: a CUDA graph's static output)."""
        w = self.weights
        norm = self.add_rms_norm
        h, delta = w.embed[batch.input_ids], None
        if self.embed_scale is not None:
            h = h * self.embed_scale
        # The reference path's additive masks, one per distinct window (0: plain causal).
        masks = (
            {win: self.attention_mask(batch, pool.shape[3], win) for win in self.windows}
            if self.attention == "reference"
            else {}
        )
        features, tp, sandwich = self.features, self.tp_group, self.shape.sandwich_norms
        # The feature pool's rows of this batch's slots, resolved once for every captured layer.
        feature_rows = features.rows(batch.slots) if features is not None else None
        for i in range(self.num_layers):
            layer = w.layers[i]
            h, x = norm(h, delta, layer.input_norm)  # h += delta; x = norm(h)
            if features is not None and feature_rows is not None and i in features.at:  # the stream entering layer i
                features.write(i, h, feature_rows)
            mask = masks.get(self.shape.window(i))
            delta = linear(self.attend(x, layer, pool, i, batch, mask), layer.o)
            if self.after_layer_kv is not None:
                self.after_layer_kv(i)
            if tp is not None:  # row-parallel o_proj: sum the ranks' partial outputs
                tp.all_reduce(delta)
            if sandwich:  # Gemma 2/3: the attention output is normed before the residual add
                delta = self.rms_norm(delta, layer.attn_out_norm)
            h, x = norm(h, delta, layer.post_norm)
            delta = self.mlp(layer, x)
            if sandwich:
                delta = self.rms_norm(delta, layer.mlp_out_norm)
        # Every layer assigns delta, and __init__ checks num_layers >= 1.
        assert delta is not None
        if features is not None and feature_rows is not None and self.num_layers in features.at:  # last layer's output
            features.write(self.num_layers, h + delta, feature_rows)
        if logits_index is None:
            return None
        h, delta = h[logits_index], delta[logits_index]
        _, x = norm(h, delta, w.final_norm)
        logits = F.linear(x, w.lm_head) if logits_out is None else torch.mm(x, w.lm_head.t(), out=logits_out)
        cap = self.shape.final_softcap
        if cap:  # in place: logits_out stays the output (a CUDA graph's static buffer)
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """rms_norm(x) without a residual add (Gemma 2/3's output norms)."""
        assert weight is not None, "sandwich_norms needs attn_out_norm and mlp_out_norm"
        if self.attention == "triton":
            return self._kernels[0](x, None, weight, self.shape.rms_norm_eps)
        return rms_norm(x, weight, self.shape.rms_norm_eps)

    def attend(self, x, layer: LayerWeights, pool, layer_idx, batch: BatchLayout, mask) -> torch.Tensor:
        """[T, heads * D]: attention output of the new tokens, after writing their K/V. `mask`: the
        reference path's additive mask for this layer's window (attention_mask)."""
        s = self.shape
        qkv = linear(x, layer.qkv, layer.qkv_bias)
        k_cache, v_cache = pool[0, layer_idx], pool[1, layer_idx]  # [blocks, block_size, kvh, D]
        flat = (-1, s.num_kv_heads, s.head_dim)
        cos_table, sin_table = self.layer_rope[layer_idx]
        if self.attention == "triton":
            _, _, rope_and_store_kv, paged_attention = self._kernels
            q = rope_and_store_kv(
                qkv,
                cos_table,
                sin_table,
                batch.positions,
                batch.slots,
                k_cache.view(flat),
                v_cache.view(flat),
                s.num_heads,
                *((layer.q_norm, layer.k_norm, s.rms_norm_eps) if s.qk_norm else (None, None, 0.0)),
                k_scale=kv_quant.K_SCALE,
                v_scale=kv_quant.V_SCALE,
            )
            out = paged_attention(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.positions,
                batch.query_start,
                batch.max_query,
                self.scale,
                window=s.window(layer_idx),
                softcap=s.attn_softcap or 0.0,
                k_scale=kv_quant.K_SCALE,
                v_scale=kv_quant.V_SCALE,
                tree=batch.tree,
                splits=batch.kv_splits,
                split_min_keys=batch.kv_split_min_keys,
            )
            return out.view(-1, s.num_heads * s.head_dim)
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = qkv[:, :q_dim].view(-1, s.num_heads, s.head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].view(-1, s.num_kv_heads, s.head_dim)
        v = qkv[:, q_dim + kv_dim :].view(-1, s.num_kv_heads, s.head_dim)
        if s.qk_norm:  # per head, over head_dim, before RoPE
            assert layer.q_norm is not None and layer.k_norm is not None
            q, k = rms_norm(q, layer.q_norm, s.rms_norm_eps), rms_norm(k, layer.k_norm, s.rms_norm_eps)
        cos, sin = cos_table[batch.positions][:, None, :], sin_table[batch.positions][:, None, :]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        store_kv_reference(k, v, k_cache.view(flat), v_cache.view(flat), batch.slots)
        return reference_attention(q, k_cache, v_cache, batch, mask, self.scale, s.attn_softcap)

    def mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """[T, H]: the layer's MLP for the normed input x [T, H], dense or mixture of experts, summed over
        tensor-parallel ranks (row-parallel down projections). The forward's one MLP step."""
        moe = self.shape.moe
        if layer.moe is not None and moe is not None:
            delta = moe_forward(
                x,
                layer.moe,
                moe.top_k,
                moe.normalize_topk,
                self.shape.mlp_activation,
                float32_weights=moe.float32_weights,
                path=self.moe_path,
            )
        else:
            gate_up, down = layer.dense_mlp()
            delta = linear(self.act_mul(linear(x, gate_up)), down)
        if self.tp_group is not None:
            self.tp_group.all_reduce(delta)
        return delta

    def add_rms_norm(self, h, delta, weight):
        """(h + delta, rms_norm(h + delta)); the Triton kernel updates h in place."""
        if self.attention == "triton":
            return h, self._kernels[0](h, delta, weight, self.shape.rms_norm_eps)
        h = h if delta is None else h + delta
        return h, rms_norm(h, weight, self.shape.rms_norm_eps)

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the fused gate/up projection: SwiGLU, or GeGLU (tanh GELU) for Gemma."""
        if self.attention == "triton":
            return self._kernels[1](gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.shape.mlp_activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up

    def attention_mask(self, batch: BatchLayout, block_size: int, window: int = 0) -> torch.Tensor:
        """The reference path's additive mask [B, 1, Q, C] (model.reference_attention) in the model dtype."""
        return attention_mask(batch, block_size, window, self.weights.embed.dtype)

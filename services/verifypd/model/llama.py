"""Llama-family forward pass over paged KV (Llama, Mistral, Qwen2 and friends).

Reference attention in plain torch (runs on CPU and CUDA): new K/V are scattered into the pool
by slot, then each sequence's context is gathered through its block table and attended with
`scaled_dot_product_attention` on a padded batch. Shapes (T = new tokens in the batch, B =
sequences, Q = longest query run, C = longest context padded to whole blocks):

    hidden      [T, H]
    pool        [2, layers, num_blocks, block_size, kv_heads, head_dim]
    q (padded)  [B, heads, Q, head_dim];  k, v (gathered) [B, kv_heads, C, head_dim]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    qkv_bias: bool = False            # Qwen2


@dataclass
class LayerWeights:
    qkv: torch.Tensor          # [(heads + 2 kv_heads) * head_dim, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor            # [H, heads * head_dim]
    gate_up: torch.Tensor      # [2 * I, H]
    down: torch.Tensor         # [H, I]
    input_norm: torch.Tensor   # [H]
    post_norm: torch.Tensor    # [H]


@dataclass
class LlamaWeights:
    embed: torch.Tensor        # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor   # [H]
    lm_head: torch.Tensor      # [V, H] (may alias embed)


@dataclass
class BatchLayout:
    """Where each new token goes and what it attends to. Built once per forward by the runner."""

    input_ids: torch.Tensor    # [T] long
    positions: torch.Tensor    # [T] long
    slots: torch.Tensor        # [T] long: block_id * block_size + offset in the pool
    block_tables: torch.Tensor  # [B, max_blocks] long (padded with 0)
    context_lens: torch.Tensor  # [B] long: positions attended by the last query of each sequence
    query_seq: torch.Tensor    # [T] long: which sequence each token belongs to
    query_idx: torch.Tensor    # [T] long: index of the token within its sequence's run
    max_query: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_inv_freq(shape: LlamaShape, device: torch.device) -> torch.Tensor:
    inv = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim))
    scaling = shape.rope_scaling
    if scaling and scaling.get("rope_type") == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(is_mid, mid, scaled)
    elif scaling and scaling.get("rope_type") == "linear":
        inv = inv / scaling["factor"]
    return inv.float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D]. HF's rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class PagedLlama:
    """A stateless forward over given weights; `num_layers` < shape.num_layers gives the
    self-speculative draft (first layers + final norm + head, sharing the target's tensors)."""

    def __init__(self, shape: LlamaShape, weights: LlamaWeights, num_layers: int | None = None):
        self.shape = shape
        self.weights = weights
        self.num_layers = num_layers or shape.num_layers
        if not (1 <= self.num_layers <= len(weights.layers)):
            raise ValueError(f"num_layers must be in [1, {len(weights.layers)}], got {self.num_layers}")
        device = weights.embed.device
        self.inv_freq = rope_inv_freq(shape, device)
        self.scale = shape.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, pool: torch.Tensor, batch: BatchLayout, logits_index: torch.Tensor | None) -> torch.Tensor | None:
        """Writes the new tokens' KV into `pool`; returns logits [len(logits_index), V] (float32)."""
        s, w = self.shape, self.weights
        h = w.embed[batch.input_ids]
        freqs = batch.positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        mask = self._attention_mask(batch, pool.shape[3])
        for i in range(self.num_layers):
            layer = w.layers[i]
            x = rms_norm(h, layer.input_norm, s.rms_norm_eps)
            h = h + self._attention(x, layer, pool, i, batch, cos, sin, mask)
            x = rms_norm(h, layer.post_norm, s.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        if logits_index is None:
            return None
        h = rms_norm(h[logits_index], w.final_norm, s.rms_norm_eps)
        return F.linear(h, w.lm_head).float()

    def _attention_mask(self, batch: BatchLayout, block_size: int) -> torch.Tensor:
        """Additive mask [B, 1, Q, C]: query at position p sees keys at positions <= p."""
        num_seqs, max_blocks = batch.block_tables.shape
        ctx = max_blocks * block_size
        qpos = torch.full((num_seqs, batch.max_query), -1, dtype=torch.long, device=batch.positions.device)
        qpos[batch.query_seq, batch.query_idx] = batch.positions
        kpos = torch.arange(ctx, device=qpos.device)
        allowed = kpos[None, None, :] <= qpos[:, :, None]
        allowed[..., 0] |= qpos < 0  # padded query rows attend one key so softmax stays finite
        mask = torch.zeros(allowed.shape, dtype=self.weights.embed.dtype, device=qpos.device)
        return mask.masked_fill_(~allowed, float("-inf"))[:, None]

    def _attention(self, x, layer: LayerWeights, pool, layer_idx, batch: BatchLayout, cos, sin, mask):
        s = self.shape
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = qkv[:, :q_dim].view(-1, s.num_heads, s.head_dim)
        k = qkv[:, q_dim:q_dim + kv_dim].view(-1, s.num_kv_heads, s.head_dim)
        v = qkv[:, q_dim + kv_dim:].view(-1, s.num_kv_heads, s.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = pool[0, layer_idx], pool[1, layer_idx]  # [blocks, block_size, kvh, D]
        k_cache.view(-1, s.num_kv_heads, s.head_dim)[batch.slots] = k
        v_cache.view(-1, s.num_kv_heads, s.head_dim)[batch.slots] = v
        num_seqs = batch.block_tables.shape[0]
        keys = k_cache[batch.block_tables].flatten(1, 2).transpose(1, 2)    # [B, kvh, C, D]
        values = v_cache[batch.block_tables].flatten(1, 2).transpose(1, 2)
        qp = q.new_zeros(num_seqs, batch.max_query, s.num_heads, s.head_dim)
        qp[batch.query_seq, batch.query_idx] = q
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values, attn_mask=mask,
                                             scale=self.scale, enable_gqa=True)   # [B, heads, Q, D]
        out = out.transpose(1, 2)[batch.query_seq, batch.query_idx].reshape(-1, q_dim)
        return F.linear(out, layer.o)

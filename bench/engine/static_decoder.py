"""The peer of the engine's plain decoding: a static-batch decoder in plain PyTorch, compiled.

What a hand-written "gpt-fast"-style decoder does for one fixed batch: every prompt has the same
length, all B prompts are prefilled in ONE forward (eager, SDPA with a causal mask), then every step
decodes all B sequences together, for exactly G steps; no scheduler, no paging, no early finish.
KV lives in a contiguous static cache per layer, [B, kv_heads, S, D] with S = prompt + G; a decode
step attends over the whole cache with a position mask (the static shape torch.compile needs),
as gpt-fast does. Each decoder layer of the decode step is compiled with torch.compile (Inductor:
fused norms/RoPE/SiLU/KV write, cuBLAS GEMMs; one compilation, called for every layer with its
tensors); the step (layers + head + greedy argmax, the token fed back on the device) is replayed
from one CUDA graph.

Same weights and shapes as the engine (the PagedLlama's own tensors, no copy), same RoPE tables;
greedy. `bench/engine/engine_throughput.py --rows compiled` runs it beside the engine's rows: tok/s counts
the prefill and all G steps, as the engine rows do.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from verifypd.model.llama import PagedLlama, rms_norm


class StaticDecoder:
    def __init__(self, model: PagedLlama, batch: int, max_len: int, compile: bool = True):
        s, w = model.shape, model.weights
        self.model, self.batch, self.max_len = model, batch, max_len
        dev, dtype = w.embed.device, w.embed.dtype
        # Per-layer contiguous caches [B, kvh, S, D] (separate tensors: in-place index writes into
        # each stay in place under torch.compile).
        self.k_cache = [
            torch.zeros(batch, s.num_kv_heads, max_len, s.head_dim, device=dev, dtype=dtype)
            for _ in range(model.num_layers)
        ]
        self.v_cache = [torch.zeros_like(c) for c in self.k_cache]
        self.ids = torch.zeros(batch, dtype=torch.long, device=dev)  # the token each step feeds
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # its position (all rows alike)
        self.key_pos = torch.arange(max_len, device=dev)
        # One layer is compiled (fullgraph, static shapes) and called for every layer with that
        # layer's tensors: one compilation instead of 32 unrolled copies; the CUDA graph removes
        # the per-call host cost. The head (norm, lm_head, argmax) runs eagerly inside the graph.
        self._layer_compiled = torch.compile(_layer, fullgraph=True, dynamic=False) if compile else _layer
        self._step = self._decode
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compile_seconds = 0.0

    # -- the forward (x [B, T, H] at positions `positions` [T]; prefill starts at position 0) ------
    def _layers(self, x: torch.Tensor, positions: torch.Tensor, decode: bool) -> torch.Tensor:
        s, w = self.model.shape, self.model.weights
        cos = self.model.rope_cos[positions][None, None]  # [1, 1, T, D]
        sin = self.model.rope_sin[positions][None, None]
        # decode: keys 0..pos are visible, over the whole static cache
        mask = (self.key_pos <= positions[-1])[None, None, None, :] if decode else None
        layer_fn = self._layer_compiled if decode else _layer
        for i in range(self.model.num_layers):
            layer = w.layers[i]
            x = layer_fn(
                x,
                positions,
                cos,
                sin,
                mask,
                layer.qkv,
                layer.qkv_bias,
                layer.o,
                layer.gate_up,
                layer.down,
                layer.input_norm,
                layer.post_norm,
                self.k_cache[i],
                self.v_cache[i],
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                s.rms_norm_eps,
                self.model.scale,
            )
        return x

    def _head(self, x_last: torch.Tensor) -> torch.Tensor:
        w, s = self.model.weights, self.model.shape
        return F.linear(rms_norm(x_last, w.final_norm, s.rms_norm_eps), w.lm_head).argmax(-1)

    def _decode(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.model.weights.embed[ids][:, None]  # [B, 1, H]
        return self._head(self._layers(x, pos, decode=True)[:, 0])

    # -- driving it --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: torch.Tensor) -> None:
        """prompts [B, P]: KV of all of them in one forward; the first token goes to self.ids."""
        P = prompts.shape[1]
        x = self.model.weights.embed[prompts]
        positions = torch.arange(P, device=prompts.device)
        self.ids.copy_(self._head(self._layers(x, positions, decode=False)[:, -1]))
        self.pos.fill_(P)

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """One decode step of all B sequences (eager or compiled, no graph): the next tokens [B]."""
        out = self._step(self.ids, self.pos)
        self.ids.copy_(out)
        self.pos.add_(1)
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        """Compiles (two warm-up calls) and captures one decode step, feeding its token back on the
        device, into a CUDA graph. Leaves the caches and position as they were."""
        t0 = time.perf_counter()
        ids0, pos0 = self.ids.clone(), self.pos.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(self.ids, self.pos)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = self._step(self.ids, self.pos)
            self.ids.copy_(out)
            self.pos.add_(1)
        torch.cuda.synchronize()
        self.ids.copy_(ids0)
        self.pos.copy_(pos0)
        self.compile_seconds = time.perf_counter() - t0

    def generate(self, prompts: torch.Tensor, steps: int) -> torch.Tensor:
        """Prefill + `steps` tokens per sequence ([B, steps]: the prefill's token, then steps - 1
        decode steps' tokens). With a captured graph each decode step is one replay."""
        self.prefill(prompts)
        out = [self.ids.clone()]
        for _ in range(steps - 1):
            if self.graph is not None:
                self.graph.replay()
                out.append(self.ids.clone())
            else:
                out.append(self.step().clone())
        return torch.stack(out, dim=1)


def _layer(
    x,
    positions,
    cos,
    sin,
    mask,
    qkv_w,
    qkv_b,
    o_w,
    gate_up_w,
    down_w,
    in_norm,
    post_norm,
    k_cache,
    v_cache,
    heads: int,
    kv_heads: int,
    hd: int,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """One decoder layer over x [B, T, H]; writes the new K/V into the static caches at `positions`.
    mask None: prefill from position 0 (causal over its own keys); else decode over the cache."""
    B, T, _ = x.shape
    q_dim, kv_dim = heads * hd, kv_heads * hd
    qkv = F.linear(rms_norm(x, in_norm, eps), qkv_w, qkv_b)
    q = qkv[..., :q_dim].view(B, T, heads, hd).transpose(1, 2)
    k = qkv[..., q_dim : q_dim + kv_dim].view(B, T, kv_heads, hd).transpose(1, 2)
    v = qkv[..., q_dim + kv_dim :].view(B, T, kv_heads, hd).transpose(1, 2)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    k_cache[:, :, positions] = k
    v_cache[:, :, positions] = v
    if mask is None:
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale, enable_gqa=True)
    x = x + F.linear(a.transpose(1, 2).reshape(B, T, q_dim), o_w)
    gate, up = F.linear(rms_norm(x, post_norm, eps), gate_up_w).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE; x [B, heads, T, D], cos/sin [1, 1, T, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

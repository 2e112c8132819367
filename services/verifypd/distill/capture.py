"""Features and labels for training, captured on the fly by the frozen target's serving forward
(PagedLlama over a scratch KV pool with a FeaturePool attached: exactly the states the verify lane
exports when serving)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verifypd.model.features import FeaturePool
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.llama import PagedLlama
from verifypd.model.runner import ModelRunner, TokenRun

BLOCK = 16


@dataclass
class Batch:
    """Rows of the head (row t: features of position t, token t + 1), B sequences padded to T rows."""

    tokens: torch.Tensor  # [B, T] long: token t + 1
    features: torch.Tensor  # [B, T, F]
    labels: torch.Tensor  # [B, T, V]: the target's logits at position t + 1 (predicting token t + 2)
    valid: torch.Tensor  # [B, T] bool: real rows (not padding)
    greedy: torch.Tensor  # [B, T] bool: rows whose token t + 1 the target generated (acceptance estimate)


class TargetCapture:
    def __init__(self, target, aux_layers: tuple[int, ...], device: torch.device, max_tokens: int):
        """target: a LoadedModel; max_tokens: the most tokens of one batch (sizes the scratch pool)."""
        s = target.shape
        self.model = PagedLlama(s, target.weights)
        blocks = max_tokens // BLOCK + 64
        pool = KvPool(
            "target",
            PoolGeometry(s.num_layers, blocks, BLOCK, s.num_kv_heads, s.head_dim),
            target.weights.embed.dtype,
            device,
        )
        self.features = FeaturePool(blocks * BLOCK, aux_layers, s.hidden_size, target.weights.embed.dtype, device)
        self.model.features = self.features
        self.runner = ModelRunner(self.model, pool, graphs=False)
        self.device = device

    def __call__(self, sequences: list[list[int]], prompt_lens: list[int]) -> Batch:
        runs, next_block = [], 0
        for seq in sequences:
            blocks = -(-len(seq) // BLOCK)
            runs.append(TokenRun(list(seq), 0, tuple(range(next_block, next_block + blocks))))
            next_block += blocks
        logits = self.runner.forward(runs, "all")  # [sum T, V]
        slots = np.concatenate([np.arange(len(r.token_ids)) + r.block_ids[0] * BLOCK for r in runs])
        feats = self.features.read(torch.as_tensor(slots, device=self.device))
        with torch.inference_mode(False):  # plain tensors: training saves them for backward
            logits, feats = logits.clone(), feats.clone()
            rows = max(len(s) for s in sequences) - 1
            B = len(sequences)
            out = Batch(
                torch.zeros(B, rows, dtype=torch.long, device=self.device),
                feats.new_zeros(B, rows, feats.shape[1]),
                logits.new_zeros(B, rows, logits.shape[1]),
                torch.zeros(B, rows, dtype=torch.bool, device=self.device),
                torch.zeros(B, rows, dtype=torch.bool, device=self.device),
            )
            start = 0
            for b, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
                n = len(seq) - 1  # rows of this sequence
                out.tokens[b, :n] = torch.as_tensor(seq[1:], device=self.device)
                out.features[b, :n] = feats[start : start + n]
                out.labels[b, :n] = logits[start + 1 : start + n + 1]
                out.valid[b, :n] = True
                out.greedy[b, max(plen - 1, 0) : n] = True
                start += len(seq)
            out.labels[~out.valid] = 0
        return out

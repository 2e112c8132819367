"""ModelRunner: one model + its KV pool; turns ragged token runs into one paged forward."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verifypd.model.kv_pool import KvPool
from verifypd.model.llama import BatchLayout, PagedLlama


@dataclass
class TokenRun:
    """Consecutive tokens of one sequence: token_ids[i] sits at position start_pos + i."""

    token_ids: list[int]
    start_pos: int
    block_ids: tuple[int, ...]


class ModelRunner:
    def __init__(self, model: PagedLlama, pool: KvPool):
        if model.num_layers != pool.geometry.num_layers:
            raise ValueError(f"pool has {pool.geometry.num_layers} layers, model uses {model.num_layers}")
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.block_size = pool.geometry.block_size

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    def layout(self, runs: list[TokenRun]) -> BatchLayout:
        """Host-side bookkeeping, one host-to-device copy per tensor."""
        bs = self.block_size
        ids, pos, slots, qseq, qidx, ctx = [], [], [], [], [], []
        max_blocks = max(len(r.block_ids) for r in runs)
        tables = []
        for s, run in enumerate(runs):
            end = run.start_pos + len(run.token_ids)
            if end > len(run.block_ids) * bs:
                raise ValueError(f"run needs {end} positions but holds {len(run.block_ids)} blocks")
            for i, tok in enumerate(run.token_ids):
                p = run.start_pos + i
                ids.append(tok)
                pos.append(p)
                slots.append(run.block_ids[p // bs] * bs + p % bs)
                qseq.append(s)
                qidx.append(i)
            ctx.append(end)
            tables.append(list(run.block_ids) + [0] * (max_blocks - len(run.block_ids)))
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return BatchLayout(
            input_ids=as_tensor(ids), positions=as_tensor(pos), slots=as_tensor(slots),
            block_tables=as_tensor(tables), context_lens=as_tensor(ctx), query_seq=as_tensor(qseq),
            query_idx=as_tensor(qidx), max_query=max(len(r.token_ids) for r in runs))

    def forward(self, runs: list[TokenRun], logits_for: str | None) -> torch.Tensor | None:
        """logits_for: None (KV only), "last" ([B, V]) or "all" ([T, V], in run order)."""
        batch = self.layout(runs)
        index = None
        if logits_for == "last":
            lens = torch.tensor([len(r.token_ids) for r in runs], device=self.device)
            index = lens.cumsum(0) - 1
        elif logits_for == "all":
            index = torch.arange(batch.input_ids.numel(), device=self.device)
        return self.model.forward(self.pool.tensor, batch, index)

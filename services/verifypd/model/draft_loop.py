"""The k-step draft loop with tokens fed forward on the device: no host sync between steps.

After the first draft token (chosen from the first forward's logits), each `draft_step` feeds the
previous step's tokens, writes their KV, and chooses the next tokens, all from device state, so
the same function runs eagerly (CPU, odd sizes) or as a captured CUDA graph replayed k - 1 times.

State per row (R rows, S >= k steps, V vocab):
    tok [R]      token fed this step            pos [R]   its position
    base [R]     position of the first draft    k [R]     drafts wanted (0 = padding row)
    step [1]     index of the token this step produces (1 .. k-1)
    out_tokens [R, S]
No draft probabilities are kept: coupled acceptance (`sampler.accept_raced`) needs none; a sampled
draft token is the race winner of the draft's distribution for its position (`sampler.choose`).
A row is active while step < k. Inactive rows (finished or padding) still compute, but write no
KV (slot -1) and read only KV that exists (their position falls back to base - 1, the pending
token's, which is in the pool).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from verifypd.model import sampler
from verifypd.model.layout import pack
from verifypd.model.llama import BatchLayout, PagedLlama


@dataclass
class DraftState:
    tok: torch.Tensor
    pos: torch.Tensor
    base: torch.Tensor
    k: torch.Tensor
    step: torch.Tensor
    temp: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    tables: torch.Tensor  # [R, W] block tables (shared with the first step's layout)
    out_tokens: torch.Tensor
    logits: torch.Tensor  # [R, V] static output of the forward
    rows: torch.Tensor  # arange(R): logits index
    query_start: torch.Tensor  # arange(R + 1): one token per row

    @classmethod
    def allocate(cls, rows: int, steps: int, vocab: int, tables: torch.Tensor, dtype: torch.dtype) -> DraftState:
        dev = tables.device
        zeros = lambda *shape, d=torch.long: torch.zeros(*shape, dtype=d, device=dev)  # noqa: E731
        return cls(
            tok=zeros(rows),
            pos=zeros(rows),
            base=torch.ones(rows, dtype=torch.long, device=dev),
            k=zeros(rows),
            step=zeros(1),
            temp=zeros(rows, d=torch.float32),
            top_k=zeros(rows),
            top_p=torch.ones(rows, device=dev),
            seeds=zeros(rows),
            tables=tables,
            out_tokens=zeros(rows, steps),
            logits=torch.empty(rows, vocab, dtype=dtype, device=dev),
            rows=torch.arange(rows, device=dev),
            query_start=torch.arange(rows + 1, device=dev),
        )

    def head(self, rows: int) -> DraftState:
        """The first `rows` rows (views: same memory, so graphs captured on them see updates)."""
        sliced = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in sliced.items():
            if name == "query_start":
                sliced[name] = value[: rows + 1]
            elif name != "step" and value is not None:
                sliced[name] = value[:rows]
        return DraftState(**sliced)

    def start(self, samplings, first_tokens, next_pos: list[int], ks: list[int], staging) -> None:
        """Loads a call's rows (the first len(ks)); later rows become inactive padding."""
        n = len(ks)
        greedy = all(s.greedy for s in samplings)
        arrays = [np.asarray(next_pos, dtype=np.int64), np.asarray(ks, dtype=np.int64)]
        if not greedy:
            arrays += [
                np.asarray([s.top_k for s in samplings], dtype=np.int64),
                sampler.seed_tensor([s.seed for s in samplings], "cpu").numpy(),
            ]
        device_arrays = pack(arrays, self.tok.device, staging)
        self.k.zero_()
        self.base.fill_(1)
        self.pos[:n] = device_arrays[0]
        self.base[:n] = device_arrays[0]
        self.k[:n] = device_arrays[1]
        if not greedy:
            self.top_k[:n], self.seeds[:n] = device_arrays[2], device_arrays[3]
            floats = sampler.small_tensor(
                [[s.temperature for s in samplings], [s.top_p for s in samplings]], self.tok.device, torch.float32
            )
            self.temp[:n], self.top_p[:n] = floats
        self.tok[:n] = first_tokens
        self.out_tokens[:n, 0] = first_tokens
        self.step.fill_(1)


def draft_step(model: PagedLlama, pool: torch.Tensor, st: DraftState, block_size: int, mode: str) -> None:
    """One draft forward over all rows of `st`; advances the state in place (graph-capturable)."""
    batch = step_batch(st, block_size)
    logits = model.forward(pool, batch, st.rows, logits_out=st.logits)
    advance(st, logits, mode, batch.positions + 1)


def step_batch(st: DraftState, block_size: int) -> BatchLayout:
    """One token per row: the fed tokens at their positions; inactive rows write nowhere and sit at
    base - 1 (a position whose KV exists)."""
    active = st.step < st.k
    pos = torch.where(active, st.pos, st.base - 1)
    block = st.tables.gather(1, (pos // block_size)[:, None]).squeeze(1)
    slots = torch.where(active, block * block_size + pos % block_size, -1)
    return BatchLayout(
        input_ids=st.tok, positions=pos, slots=slots, block_tables=st.tables, query_start=st.query_start, max_query=1
    )


def advance(st: DraftState, logits: torch.Tensor, mode: str, token_pos: torch.Tensor) -> None:
    """Chooses each row's next token from `logits`, records it and feeds it to the next step.
    token_pos: the position the chosen token will have; with the seed it keys the race, so a
    sampled draft proposes the race winner of its own distribution (no q is kept)."""
    new = sampler.choose(logits, mode, st.temp, st.top_k, st.top_p, st.seeds, token_pos)
    st.out_tokens.index_copy_(1, st.step, new[:, None])
    st.tok.copy_(new)
    st.pos.add_(1)
    st.step.add_(1)

"""A feature draft's chain step (model.eagle_draft), and its CUDA graphs: one per (padded rows,
sampling mode), replayed k - 1 times per draft call. The catch-up forward before it stays eager
(its row count varies with the accepted lengths).

Static state: a DraftState, the chain's hidden states [R, H] and block tables [R, W], each loaded
before the replays by device-to-device copies from the call's catch-up (no host sync). Rows past
the call's are inactive (k = 0): they write nowhere and read some existing block.
"""
from __future__ import annotations

import time

import torch

from verifypd.model.draft_loop import DraftState, advance, step_batch
from verifypd.model.graph_runner import BUCKETS, capture_graph
from verifypd.model.layout import PinnedStaging


def eagle_step(model, pool: torch.Tensor, st: DraftState, hidden: torch.Tensor, block_size: int,
               mode: str) -> None:
    """One chain step of an EagleModel over all rows: feeds st.tok at row st.pos with `hidden` [R, H]
    (updated in place)."""
    batch = step_batch(st, block_size)
    out, logits = model.forward(pool, batch, st.rows, hidden=hidden, logits_out=st.logits)
    hidden.copy_(out)
    advance(st, logits, mode, batch.positions + 2)


class EagleGraphs:
    def __init__(self, model, pool: torch.Tensor, block_size: int, staging: PinnedStaging, *,
                 buckets=BUCKETS, max_steps: int = 8):
        self.model, self.pool, self.block_size, self.staging = model, pool, block_size, staging
        self.buckets, self.max_steps = tuple(sorted(buckets)), max_steps
        rows, dev = self.buckets[-1], pool.device
        self.width = -(-(model.shape.max_context + 64) // block_size)
        self.tables = torch.zeros(rows, self.width, dtype=torch.long, device=dev)
        self.state = DraftState.allocate(rows, max_steps, model.vocab_size, self.tables, model.embed.dtype)
        self.hidden = torch.zeros(rows, model.shape.hidden_size, dtype=model.embed.dtype, device=dev)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._mempool = torch.cuda.graph_pool_handle()
        self._capture_stream = torch.cuda.Stream(device=dev)  # own stream: see GraphRunner

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def fits(self, batch: int, steps: int, width: int) -> bool:
        return self.bucket(batch) is not None and steps <= self.max_steps and width <= self.width

    def chain(self, samplings, first, last_rows: list[int], ks: list[int], tables: torch.Tensor,
              hidden: torch.Tensor, mode: str) -> torch.Tensor:
        """Steps 1 .. max(ks) - 1 from the catch-up's first drafts; tokens [B, K], a view of a static
        buffer (valid until the next call)."""
        n, rows, steps = len(ks), self.bucket(len(ks)), max(ks)
        graph = self._graphs.get((rows, mode)) or self._capture(rows, mode)
        self.tables[:n, :tables.shape[1]].copy_(tables)
        self.hidden[:n].copy_(hidden)
        self.state.start(samplings, first, last_rows, ks, self.staging)
        for _ in range(steps - 1):
            graph.replay()
        return self.state.out_tokens[:n, :steps]

    def _capture(self, rows: int, mode: str) -> torch.cuda.CUDAGraph:
        state, hidden = self.state.head(rows), self.hidden[:rows]
        fn = lambda: eagle_step(self.model, self.pool, state, hidden, self.block_size, mode)  # noqa: E731
        self.state.k.zero_()       # warm-up and capture write no KV
        self.state.step.fill_(1)
        graph = capture_graph(fn, self._mempool, self._capture_stream)
        self._graphs[(rows, mode)] = graph
        return graph

    def warm_up(self, kinds=("draft",), max_query: int | None = None) -> float:
        """Captures the greedy chain graphs at start-up (GraphRunner.warm_up's signature); seconds."""
        t0 = time.perf_counter()
        for rows in reversed(self.buckets):  # largest first: later captures reuse its pool memory
            if (rows, "greedy") not in self._graphs:
                self._capture(rows, "greedy")
        return time.perf_counter() - t0

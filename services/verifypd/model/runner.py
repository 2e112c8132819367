"""ModelRunner: one model + its KV pool; turns token runs into paged forwards (layouts: model.layout)."""

from __future__ import annotations

import time
from typing import Literal, overload

import torch

from verifypd.model import sampler
from verifypd.model.draft_loop import DraftState, draft_step
from verifypd.model.graph_runner import BUCKETS, GraphRunner, attention_splits, device_sm_count, write_verdict
from verifypd.model.kv_pool import KvPool
from verifypd.model.layout import PinnedStaging, TokenRun, build_layout, to_device
from verifypd.model.llama import BatchLayout, PagedLlama
from verifypd.model.split_kv import SPLIT_MIN_CONTEXT
from verifypd.model.verify_fit import fit_layout

# One sequence's prefill chunk of up to 256 tokens runs as a CUDA graph padded to the next of these:
# eagerly, a forward's ~12 launches a layer cost ~10 ms of host time on SmolLM2-135M (30 layers,
# H200; its GPU work is ~1 ms), paid by every arriving request before its first token. Padding adds
# at most a third of the chunk's GPU work above 64 tokens; a Llama-2-7B chunk of 256 tokens needs
# ~5 ms of GPU against ~8 ms of eager host time (32 layers), so up to 256 the graph should not lose
# on large models either (longer chunks are compute-bound: eager). Several sequences in one call (a
# burst) stay eager, their host time shared.
PREFILL_GRAPH_QUERIES = (16, 32, 64, 96, 128, 192, 256)


def prefill_query(queries: tuple[int, ...], tokens: int) -> int | None:
    """The smallest of the (sorted) prefill graphs' queries that holds `tokens`; None: none does."""
    return next((q for q in queries if q >= tokens), None)


class ModelRunner:
    def __init__(
        self, model: PagedLlama, pool: KvPool, graphs: bool | str | None = None, buckets: tuple[int, ...] | None = None
    ):
        """graphs: capture CUDA graphs for padded batches (None = on CUDA with the Triton backend;
        "eager": their static buffers with the functions run directly, tests on any device);
        buckets: their padded batch sizes (None = the GraphRunner's default)."""
        if model.num_layers != pool.geometry.num_layers:
            raise ValueError(f"pool has {pool.geometry.num_layers} layers, model uses {model.num_layers}")
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.block_size = pool.geometry.block_size
        self.staging = PinnedStaging(self.device)
        # The eager (prefill) path has its own: a prefill launched while a verify call's transfer is
        # in flight must not wait for it (see LocalPrefillLane.prefill_start).
        self.eager_staging = PinnedStaging(self.device)
        if graphs is None:
            graphs = self.device.type == "cuda" and model.attention == "triton"
        self.graphs = None
        if graphs:
            self.graphs = GraphRunner(
                model,
                pool.tensor,
                self.block_size,
                self.staging,
                replay="eager" if graphs == "eager" else "cuda",
                buckets=buckets or BUCKETS,
            )
        self.prefill_graphs: GraphRunner | None = None  # capture_prefill_graphs
        self.prefill_queries: tuple[int, ...] = ()
        # A one-sequence prefill chunk after at least this many cached positions runs split-KV
        # attention (model.split_kv): `prefill_splits[Q]` parts in the graph of query Q.
        self.split_min_context = SPLIT_MIN_CONTEXT
        self.prefill_splits: dict[int, int] = {}
        self._sm_count: int | None = None  # splits_for's, read once

    def capture_prefill_graphs(self, queries: tuple[int, ...] = PREFILL_GRAPH_QUERIES) -> float:
        """Captures ("last", 1, Q) graphs for one-sequence prefill chunks (`forward`), in a GraphRunner
        of their own: its static inputs, pool and capture stream are not the verify graphs', since
        a prefill call is launched on the prefill lane's stream while a verify graph may still run
        (the eager path has its own staging for the same reason). Returns seconds."""
        if self.graphs is None or not queries:
            return 0.0
        self.prefill_queries = tuple(sorted(queries))
        top = self.prefill_queries[-1]
        self.prefill_graphs = GraphRunner(
            self.model,
            self.pool.tensor,
            self.block_size,
            self.eager_staging,
            buckets=(1,),
            max_query=top,
            max_draft_steps=1,
            max_graph_tokens=top,
            last_only=True,
            replay=self.graphs.replay,
        )
        keys: list[tuple] = []
        for query in reversed(self.prefill_queries):  # largest first: the others reuse its pool memory
            splits = self.splits_for(query)
            if splits > 1:
                self.prefill_splits[query] = splits
            for key in [("last", 1, query)] + ([("last", 1, query, splits)] if splits > 1 else []):
                self.prefill_graphs.graph_for(key)
                keys.append(key)
        if self.prefill_graphs.replay == "cuda":
            # A graph's first launch also uploads it to the device (what cudaGraphUpload would do
            # ahead; torch does not expose it): paid here, not by the first request of each query
            # size. On the H200 the first cache hit of an engine (query 32) took 2.02 ms and its
            # first full repeat (query 16) 2.10 ms, later hits 1.56 ms median: the first launch of
            # their graph is what those two alone had in common (bench/serving/prefix_cache.py's
            # single pair against its median shows whether this removed it). The static inputs are
            # as every capture's warm-up left them (slots -1: no KV written), so each replay is that
            # warm-up again.
            t0 = time.perf_counter()
            for key in keys:
                self.prefill_graphs.graph_for(key).replay()
            torch.cuda.synchronize(self.device)
            self.prefill_graphs.capture_seconds += time.perf_counter() - t0
        return self.prefill_graphs.capture_seconds

    def splits_for(self, query: int) -> int:
        """Split-KV parts for one sequence of `query` new tokens (1: the Triton attention is not used)."""
        if self._sm_count is None:
            self._sm_count = device_sm_count(self.device)
        return attention_splits(self.model, 1, query, self._sm_count)

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    def layout(self, runs: list[TokenRun]) -> BatchLayout:
        return to_device(build_layout(runs, self.block_size), self.device, self.staging)

    @overload
    def forward(self, runs: list[TokenRun], logits_for: Literal["last", "all"]) -> torch.Tensor: ...
    @overload
    def forward(self, runs: list[TokenRun], logits_for: str | None) -> torch.Tensor | None: ...
    def forward(self, runs: list[TokenRun], logits_for: str | None) -> torch.Tensor | None:
        """Prefill. logits_for: None (KV only), "last" ([B, V]) or "all" ([T, V]). One sequence of up
        to max(prefill_queries) tokens replays a prefill graph (right-aligned, padded: see
        PREFILL_GRAPH_QUERIES; "last" logits, a view valid until the next prefill call), anything
        else runs eagerly, ragged."""
        # one sequence after a long cached prefix (a prefix-cache hit, a late chunk): split-KV attention
        long_context = len(runs) == 1 and runs[0].start_pos >= self.split_min_context
        if self.prefill_graphs is not None and len(runs) == 1 and logits_for != "all":
            query = prefill_query(self.prefill_queries, len(runs[0].token_ids))
            if query is not None:
                splits = self.prefill_splits.get(query, 1) if long_context else 1
                return self.prefill_graphs.last_logits(runs, query, splits)
        host = build_layout(runs, self.block_size)
        batch = to_device(host, self.device, self.eager_staging)
        if long_context:
            batch.kv_splits = self.splits_for(len(runs[0].token_ids))
        index = None
        if logits_for == "last":
            index = batch.query_start[1:] - 1
        elif logits_for == "all":
            index = torch.arange(host.ids.size, device=self.device)
        return self.model.forward(self.pool.tensor, batch, index)

    # score() takes `first_ids` (overlapped plain decoding feeds pending tokens on the device); a
    # runner whose score() forwards elsewhere (tensor parallel) says False until it passes them on.
    feeds_first_ids = True

    def score(
        self,
        runs: list[TokenRun],
        device_ids: torch.Tensor | None = None,
        first_ids: torch.Tensor | None = None,
        fit: tuple | None = None,
    ) -> torch.Tensor:
        """Logits of every token of every run, padded: [B, Q, V] with Q = the longest run; rows past
        a run's end repeat its last position (their logits are not meaningful). `device_ids` [B, K]
        replace token ids 1..K of each run on the device (drafts that never visited the host; the
        runs hold placeholders there; K = Q - 1, entries past a run's end land on padding).
        `first_ids` [B] replace token 0 of each run on the device (a pending token still on the
        device: the previous step's output, engine.overlap). `fit`: the runs are laid out for the
        longest outcome of a verify call still in flight; fitted to its verdict on the device
        (model.verify_fit: (verdict, verdict rows, their ks))."""
        query = max(len(r.token_ids) for r in runs)
        if self.graphs is not None and self.graphs.fits(len(runs), query):
            return self.graphs.score(runs, query, device_ids, first_ids, fit)
        host = build_layout(runs, self.block_size, query=query, align="left")
        batch = to_device(host, self.device, self.staging)
        if device_ids is not None and query > 1:
            batch.input_ids.view(len(runs), query)[:, 1:] = device_ids
        if first_ids is not None:
            batch.input_ids.view(len(runs), query)[:, 0] = first_ids
        if fit is not None:
            fit_layout(
                fit,
                batch.input_ids,
                batch.positions,
                batch.slots,
                batch.block_tables,
                len(runs),
                query,
                self.block_size,
            )
        logits = self.model.forward(self.pool.tensor, batch, torch.arange(host.ids.size, device=self.device))
        return logits.view(len(runs), query, -1)

    # verify_greedy(): score + greedy acceptance in one call (one graph replay on CUDA).
    verifies_greedy = True
    # score() / verify_greedy() take `fit` (engine.spec_ahead: a verify call laid out for the longest
    # outcome of the one before it, fitted to its verdict on the device, model.verify_fit).
    fits_verdict = True

    def verify_greedy(
        self,
        runs: list[TokenRun],
        ks: list[int],
        device_ids: torch.Tensor | None = None,
        first_ids: torch.Tensor | None = None,
        fit: tuple | None = None,
    ) -> torch.Tensor:
        """Greedy verify of runs [pending token, drafts ...] (drafts in the runs, or `device_ids` [B, K]
        as in score()): [B, K + 2] = accepted, final token, the K drafts (sampler.accept_greedy)."""
        query = max(len(r.token_ids) for r in runs)
        if self.graphs is not None and self.graphs.fits(len(runs), query):
            return self.graphs.verify_greedy(runs, query, ks, device_ids, first_ids, fit)
        logits = self.score(runs, device_ids, first_ids, fit)
        if device_ids is None:
            device_ids = sampler.small_tensor(
                [r.token_ids[1:] + [0] * (query - len(r.token_ids)) for r in runs], self.device
            ).view(len(runs), query - 1)
        out = torch.empty(len(runs), query + 1, dtype=torch.long, device=self.device)
        write_verdict(logits.argmax(-1), device_ids, sampler.small_tensor(ks, self.device), out)
        return out

    def last_logits(self, runs: list[TokenRun]) -> torch.Tensor:
        """Logits of each run's last token [B, V] through the padded (graph-able) layout."""
        query = max(len(r.token_ids) for r in runs)
        if self.graphs is not None and self.graphs.fits(len(runs), query):
            return self.graphs.last_logits(runs, query)
        host = build_layout(runs, self.block_size, query=query, align="right")
        batch = to_device(host, self.device, self.staging)
        index = torch.arange(1, len(runs) + 1, device=self.device) * query - 1
        return self.model.forward(self.pool.tensor, batch, index)

    def draft(self, runs: list[TokenRun], ks: list[int], samplings) -> torch.Tensor:
        """The draft loop: run r feeds its tokens, then k_r tokens are proposed, each fed to the next
        step on the device. Returns tokens [B, K], K = max(ks); entries past a row's k are meaningless.
        A sampled row's token at position t is the seeded race winner of the draft's distribution
        there (`sampler.choose`), coupled with the target's choice for t."""
        mode = sampler.choice_mode(samplings)
        next_pos = [r.start_pos + len(r.token_ids) for r in runs]
        # The graphed loop reads the block tables the graphed first step loaded: both or neither.
        graphs = self.graphs
        if graphs is not None and not (
            graphs.fits(len(runs), max(len(r.token_ids) for r in runs)) and graphs.draft_fits(len(runs), max(ks))
        ):
            graphs = None
        logits = self.last_logits(runs)[: len(runs)]
        params: sampler.ChoiceParams = (
            sampler.params_tensor(samplings, self.device) if mode != sampler.GREEDY else sampler.NO_PARAMS
        )
        first = sampler.choose(logits, mode, *params, sampler.small_tensor(next_pos, self.device))
        steps = max(ks)
        if steps == 1:
            return first[:, None]
        if graphs is not None:
            return graphs.draft_steps(samplings, first, next_pos, ks, mode)
        tables = self.layout(runs).block_tables
        state = DraftState.allocate(len(runs), steps, self.vocab_size, tables, self.model.weights.embed.dtype)
        state.start(samplings, first, next_pos, ks, self.staging)
        for _ in range(steps - 1):
            draft_step(self.model, self.pool.tensor, state, self.block_size, mode)
        return state.out_tokens

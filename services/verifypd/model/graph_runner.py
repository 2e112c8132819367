"""CUDA graphs of one model over its KV pool: the only place graphs are captured and replayed.

Graphs (all sharing one memory pool and one set of static input buffers):
  * ("all", B, Q): forward of B sequences x Q tokens, logits of every token (verify, plain decode);
  * ("accept", B, Q): the same forward, then greedy acceptance of the Q - 1 drafts that follow
    each pending token (`verdict`: accepted, final token, drafts), so a greedy verify call with
    k > 0 is one replay instead of a replay and ~15 eager launches;
  * ("last", B, Q): the same, logits of each sequence's last token (the draft's first step);
  * ("draft", B, mode): one draft-loop step (`draft_loop.draft_step`), replayed k - 1 times;
  * (kind, B, Q, S): any of the three with split-KV attention in S parts (model.split_kv), replayed
    for a call whose longest sequence has at least `split_min_context` positions, where B x Q rows
    of attention programs alone would leave SMs idle (few sequences over long contexts);
  * in a runner of its own (ModelRunner.capture_prefill_graphs), ("last", 1, Q) for prefill chunks of
    one sequence padded to Q = 16 .. 256 tokens (model.runner.PREFILL_GRAPH_QUERIES), and ("last", 1,
    Q, S) for chunks after a long cached prefix.
B is a padded batch bucket (1, 2, 4, ..., 256), Q a tokens-per-sequence count. Static inputs are
filled before each replay with one host-to-device copy; outputs are views of static buffers,
valid until the next replay of this runner (callers consume them within the lane call).
Sizes outside the buckets run eagerly through the same code.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Protocol

import torch

from verifypd.model import sampler
from verifypd.model.draft_loop import DraftState, draft_step
from verifypd.model.layout import PinnedStaging, TokenRun, build_layout
from verifypd.model.llama import BatchLayout, PagedLlama
from verifypd.model.split_kv import DECODE_SPLIT_MIN_CONTEXT, attention_programs, kv_splits
from verifypd.model.verify_fit import fit_layout, variant_queries

BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# VERIFYPD_SYNC_DEBUG=1: synchronize after every replay, so a device fault names its graph.
SYNC_DEBUG = os.environ.get("VERIFYPD_SYNC_DEBUG") == "1"
# Diagnostics only (bench/pipeline_race.py): VERIFYPD_SHARED_CAPTURE_STREAM=1 captures on torch's one
# default capture stream, as before the fix below, to show the race it caused.
SHARED_CAPTURE_STREAM = os.environ.get("VERIFYPD_SHARED_CAPTURE_STREAM") == "1"
# SMs assumed where there are none (graphs="eager" on the CPU: tests of the split-KV plumbing).
CPU_SM_STANDIN = 8


def device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SM_STANDIN
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_splits(model: PagedLlama, rows: int, query: int, sm_count: int) -> int:
    """Split-KV parts for the attention of `rows` sequences x `query` tokens (model.split_kv); 1 when
    its programs fill the SMs or the attention is not the Triton kernel."""
    if model.attention != "triton":
        return 1
    s = model.shape
    return kv_splits(attention_programs(rows, s.num_kv_heads, s.num_heads // s.num_kv_heads, query), sm_count)


class GraphRunner:
    def __init__(
        self,
        model: PagedLlama,
        pool: torch.Tensor,
        block_size: int,
        staging: PinnedStaging,
        *,
        buckets: tuple[int, ...] = BUCKETS,
        max_query: int = 9,
        max_draft_steps: int = 8,
        max_graph_tokens: int = 2048,
        last_only: bool = False,
        replay: str = "cuda",
    ):
        """last_only: only "last" graphs (one-sequence prefill, ModelRunner.capture_prefill_graphs):
        logits for one row per sequence, not per token. replay="eager": the captured functions run
        directly over the same static buffers (tests of the buffers' plumbing on the CPU)."""
        self.replay = replay
        self.model, self.pool, self.block_size = model, pool, block_size
        self.buckets = tuple(sorted(buckets))
        self.max_query, self.max_draft_steps, self.max_graph_tokens = max_query, max_draft_steps, max_graph_tokens
        dev, rows = pool.device, self.buckets[-1]
        self.width = -(-(model.shape.max_context + 64) // block_size)  # block-table columns
        tokens = rows * max_query
        # Static inputs are views of one buffer, so a call's inputs arrive in one copy:
        # [ids | positions | slots | ks | tables], each region at a fixed offset (prefixes are used).
        self.staging = staging
        self._tables_at = 3 * tokens + rows
        self._meta = torch.zeros(self._tables_at + rows * self.width, dtype=torch.long, device=dev)
        self.ids, self.positions, self.slots = (self._meta[i * tokens : (i + 1) * tokens] for i in range(3))
        self.ks = self._meta[3 * tokens : self._tables_at]  # [rows] drafts per row ("accept")
        self.tables = self._meta[self._tables_at :].view(rows, self.width)
        # ("accept") row r: [accepted, final token, its Q - 1 drafts]; sampler.accept_greedy's rule
        self.verdict = torch.zeros(rows, max_query + 1, dtype=torch.long, device=dev)
        self.slots.fill_(-1)
        self.logits = torch.empty(
            rows if last_only else tokens, model.shape.vocab_size, dtype=model.weights.embed.dtype, device=dev
        )
        self.arange = torch.arange(tokens + 1, device=dev)
        self.draft = DraftState.allocate(
            rows, max_draft_steps, model.shape.vocab_size, self.tables, model.weights.embed.dtype
        )
        self._graphs: dict[tuple, Replayable] = {}
        self._mempool = torch.cuda.graph_pool_handle() if replay == "cuda" else None
        # Each runner captures on its own stream. PyTorch keys the cuBLAS workspace by (handle,
        # stream) and a captured GEMM keeps the workspace address of its capture stream: graphs of
        # two models captured on torch's shared default capture stream would use one workspace, and
        # replayed at the same time (pdv: the draft lane's graph beside the verify lane's) corrupt
        # each other's split-K GEMMs. One runner's graphs replay one at a time, so they may share.
        self._capture_stream = None if SHARED_CAPTURE_STREAM or replay != "cuda" else torch.cuda.Stream(device=dev)
        self.capture_seconds = 0.0
        self.sm_count = device_sm_count(dev)
        # Calls whose longest sequence has this many positions replay the split-KV variant (module doc);
        # None: no split variants (none captured at warm-up either).
        self.split_min_context: int | None = DECODE_SPLIT_MIN_CONTEXT
        self._splits: dict[tuple[int, int], int] = {}  # (rows, query) -> attention_splits

    # -- sizes -------------------------------------------------------------------------------
    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def rows_for(self, batch: int) -> int:
        """The captured bucket a call of `batch` runs in (callers check fits / draft_fits first)."""
        return bucket_rows(self.buckets, batch)

    def fits(self, batch: int, query: int) -> bool:
        rows = self.bucket(batch)
        return rows is not None and query <= self.max_query and rows * query <= self.max_graph_tokens

    # -- forwards ----------------------------------------------------------------------------
    def score(
        self,
        runs: list[TokenRun],
        query: int,
        device_ids: torch.Tensor | None = None,
        first_ids: torch.Tensor | None = None,
        fit: tuple | None = None,
    ) -> torch.Tensor:
        rows = self._replay_left("all", runs, query, device_ids, first_ids, fit=fit)
        return self.logits[: rows * query].view(rows, query, -1)[: len(runs)]

    def verify_greedy(
        self,
        runs: list[TokenRun],
        query: int,
        ks: list[int],
        device_ids: torch.Tensor | None = None,
        first_ids: torch.Tensor | None = None,
        fit: tuple | None = None,
    ) -> torch.Tensor:
        """score() + greedy acceptance in one replay: [B, Q + 1] (accepted, final, drafts), a view of
        a static buffer (copy it before the next replay). Drafts are token ids 1 .. Q - 1 of each
        run (or `device_ids`); row r accepts at most ks[r] of them."""
        self._replay_left("accept", runs, query, device_ids, first_ids, ks, fit)
        return self.verdict[: len(runs), : query + 1]

    def _replay_left(
        self,
        kind: str,
        runs: list[TokenRun],
        query: int,
        device_ids: torch.Tensor | None,
        first_ids: torch.Tensor | None,
        ks: list[int] | None = None,
        fit: tuple | None = None,
    ) -> int:
        """Loads left-aligned runs, writes the device-side ids, fits the rows to the verdict of the
        call before (`fit`, model.verify_fit), replays (kind, rows, query); -> rows."""
        rows = self.rows_for(len(runs))
        graph = self.graph_for(self.key(kind, runs, rows, query))
        self._load(runs, query, "left", rows, ks)
        if device_ids is not None and query > 1:  # see ModelRunner.score
            self.ids[: rows * query].view(rows, query)[: len(runs), 1:] = device_ids
        if first_ids is not None:  # stream-ordered after the load's copy and the producing step
            self.ids[: rows * query].view(rows, query)[: len(runs), 0] = first_ids
        if fit is not None:  # stream-ordered after the load's copy and the call whose verdict it reads
            n = rows * query
            fit_layout(
                fit, self.ids[:n], self.positions[:n], self.slots[:n], self.tables[:rows], rows, query, self.block_size
            )
        graph.replay()
        return rows

    def last_logits(self, runs: list[TokenRun], query: int, splits: int | None = None) -> torch.Tensor:
        """`splits` > 1: the graph whose attention cuts each program's keys into that many parts
        (model.split_kv), captured beside the plain one; None: as `key` decides."""
        rows = self.rows_for(len(runs))
        if splits is None:
            key = self.key("last", runs, rows, query)
        else:
            key = ("last", rows, query) if splits == 1 else ("last", rows, query, splits)
        graph = self.graph_for(key)
        self._load(runs, query, "right", rows)
        graph.replay()
        return self.logits[: len(runs)]

    def _load(self, runs: list[TokenRun], query: int, align: str, rows: int, ks: list[int] | None = None) -> None:
        host = build_layout(runs, self.block_size, query=query, align=align, rows=rows, width=self.width)
        n, tokens = rows * query, self.ids.numel()
        span = self._tables_at + rows * self.width
        host_buf = self.staging.take(span)
        view = host_buf.numpy()
        for i, part in enumerate((host.ids, host.positions, host.slots)):
            view[i * tokens : i * tokens + n] = part
        if ks is not None:  # padding rows accept nothing
            view[3 * tokens : 3 * tokens + rows] = ks + [0] * (rows - len(ks))
        view[self._tables_at : span] = host.tables.ravel()
        self._meta[:span].copy_(host_buf, non_blocking=True)
        self.staging.sent()

    def _forward(self, mode: str, rows: int, query: int, splits: int = 1) -> None:
        n = rows * query
        batch = BatchLayout(
            self.ids[:n],
            self.positions[:n],
            self.slots[:n],
            self.tables[:rows],
            self.arange[: rows + 1] * query,
            query,
            kv_splits=splits,
            kv_split_min_keys=self.split_min_context or 0,
        )
        if mode in ("all", "accept"):
            self.model.forward(self.pool, batch, self.arange[:n], logits_out=self.logits[:n])
            if mode == "accept":
                drafts = self.ids[:n].view(rows, query)[:, 1:]
                write_verdict(
                    self.logits[:n].view(rows, query, -1).argmax(-1),
                    drafts,
                    self.ks[:rows],
                    self.verdict[:rows, : query + 1],
                )
        else:
            index = self.arange[1 : rows + 1] * query - 1
            self.model.forward(self.pool, batch, index, logits_out=self.logits[:rows])

    # -- the draft loop ----------------------------------------------------------------------
    def draft_steps(self, samplings, first_tokens, next_pos: list[int], ks: list[int], mode: str) -> torch.Tensor:
        """Runs steps 1 .. max(ks)-1 of the draft loop; returns tokens [B, K], a view of a static
        buffer. The caller ran step 0 (`last_logits` + choose) just before."""
        rows, steps = self.rows_for(len(ks)), max(ks)
        graph = self.graph_for(("draft", rows, mode))
        self.draft.start(samplings, first_tokens[: len(ks)], next_pos, ks, self.staging)
        for _ in range(steps - 1):
            graph.replay()
        return self.draft.out_tokens[: len(ks), :steps]

    def draft_fits(self, batch: int, steps: int) -> bool:
        return self.bucket(batch) is not None and steps <= self.max_draft_steps

    # -- capture -----------------------------------------------------------------------------
    def key(self, kind: str, runs: list[TokenRun], rows: int, query: int) -> tuple:
        """The graph of a call: its split-KV variant when its longest sequence may have reached
        `split_min_context` positions and the attention's grid leaves SMs idle. Inside that variant a
        sequence shorter than `split_min_context` is not cut (`kv_split_min_keys`), so its output is
        the plain graph's exactly: taking the variant early changes nothing but speed, and the margin
        of two calls' tokens covers runs laid out before the verdict they follow (model.verify_fit)."""
        if self.split_min_context is None:
            return (kind, rows, query)
        splits = self._splits.get((rows, query))
        if splits is None:  # a function of the bucket alone: worked out once
            splits = self._splits[(rows, query)] = attention_splits(self.model, rows, query, self.sm_count)
        if (
            splits > 1
            and max(r.start_pos + len(r.token_ids) for r in runs) + 2 * self.max_query >= self.split_min_context
        ):
            return (kind, rows, query, splits)
        return (kind, rows, query)

    @property
    def captured(self) -> list[tuple]:
        """The keys of the graphs captured so far."""
        return list(self._graphs)

    def graph_for(self, key: tuple) -> Replayable:
        """The graph for `key`, captured on first use. Call before loading a call's inputs: capture
        runs the forward once and must find the static inputs inert."""
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(key)
        if SYNC_DEBUG:
            return _CheckedGraph(graph, key)
        return graph

    def _capture(self, key: tuple) -> Replayable:
        kind, rows = key[0], key[1]
        if kind == "draft":
            state = self.draft.head(rows)
            fn = lambda: draft_step(self.model, self.pool, state, self.block_size, key[2])  # noqa: E731
        else:
            splits = key[3] if len(key) > 3 else 1  # (kind, B, Q, splits): split-KV attention
            fn = lambda: self._forward(kind, rows, key[2], splits)  # noqa: E731
        t0 = time.perf_counter()
        # Warm up on a side stream (lazy cuBLAS/Triton init stays out of the graph). Slots -1 and
        # draft rows inactive (k = 0): the warm-up run writes no KV. Token ids and positions past
        # the last call's prefix hold whatever the staging buffer held: make them valid (0).
        # Block tables only ever hold block ids, and the draft loop reads the ones just loaded.
        self.ids.zero_()
        self.positions.zero_()
        self.slots.fill_(-1)
        self.draft.k.zero_()
        self.draft.step.fill_(1)  # in range of out_tokens for the warm-up step
        if self.replay != "cuda":
            return EagerReplay(fn)
        graph = capture_graph(fn, self._mempool, self._capture_stream)
        self.capture_seconds += time.perf_counter() - t0
        return graph

    def warm_up(self, kinds: tuple[str, ...], max_query: int | None = None) -> float:
        """Captures the graphs a lane will use, at start-up; returns the seconds spent."""
        t0 = time.perf_counter()
        for rows in reversed(self.buckets):  # largest first: later captures reuse its pool memory
            for kind in kinds:
                if kind == "draft":
                    self.graph_for(("draft", rows, "greedy"))
                    continue
                for query in range(1 if kind != "accept" else 2, (max_query or self.max_query) + 1):
                    if self.fits(rows, query):
                        self.graph_for((kind, rows, query))
                        splits = attention_splits(self.model, rows, query, self.sm_count)
                        if splits > 1 and self.split_min_context is not None:
                            self.graph_for((kind, rows, query, splits))
        if "accept" in kinds and self.replay == "cuda":
            self.compile_fit_variants(max_query or self.max_query)
        return time.perf_counter() - t0

    def compile_fit_variants(self, max_query: int) -> list[tuple[int, int]]:
        """Launches the fit kernel (model.verify_fit) once per Triton variant a fitted verify call can
        take, every row padding (nothing is written). Triton compiles a variant the first time a launch
        meets it: inside a timed batch-16 run that was one ~0.16 s launch (H200), and in a
        server a stall of every request once per variant. Variants: the query's (verify_fit.kernel_variant),
        and the row count's parity (fit_layout's ks view starts rows * 8 bytes into its tensor: 16-byte
        aligned or not). Returns the (rows, query) launched."""
        launched = []
        for rows in sorted({self.rows_for(b) for b in (1, 2) if self.bucket(b) is not None}):  # buckets (1,): one
            for query in variant_queries(max_query):
                if rows * query <= self.ids.numel():
                    n = rows * query
                    fit_layout(
                        (self.verdict, [], []),
                        self.ids[:n],
                        self.positions[:n],
                        self.slots[:n],
                        self.tables[:rows],
                        rows,
                        query,
                        self.block_size,
                    )
                    launched.append((rows, query))
        return launched


def write_verdict(target_argmax: torch.Tensor, drafts: torch.Tensor, ks: torch.Tensor, out: torch.Tensor) -> None:
    """Greedy acceptance into out [R, K + 2]: accepted, final token, the K drafts (what the verify
    lane sends to the host). target_argmax [R, K + 1], drafts [R, K], ks [R]."""
    accepted, final = sampler.accept_greedy(target_argmax, drafts, ks)
    out[:, 0] = accepted
    out[:, 1] = final
    out[:, 2:] = drafts


def capture_graph(fn, mempool, stream) -> torch.cuda.CUDAGraph:
    """Runs `fn` once on a side stream (lazy cuBLAS/Triton init stays out of the graph), then
    captures it into a graph sharing `mempool`, on `stream` (None: torch's default capture stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a graph captured on first use in one lane thread (in-process pipelined pdv runs
    # the draft and verify calls in two threads) must not fail the other thread's pinned-memory
    # allocation or event query ("operation not permitted when stream is capturing", seen on the
    # H200 in test_seeded_output_with_head_in_every_schedule_and_after_preemption[pdv-True-128]).
    # The other thread's work goes to its own streams, never to the capture stream.
    # No garbage collection during the capture (gc.disable is process-wide): a collection triggered by
    # the capture's own allocations could destroy a dead engine's CUDA graph or free its pinned
    # buffers, calls not permitted in the capturing thread, and the capture fails ("operation failed
    # due to a previous error during capture" after "operation not permitted when stream is capturing
    # (function reset)": seen on the H200 in test_greedy_with_head_in_every_schedule, which builds
    # engines one after another). Dead objects are collected after it, outside any capture.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=mempool, stream=stream, capture_error_mode="thread_local"):
            fn()
    finally:
        if collecting:
            gc.enable()
    torch.cuda.synchronize()
    return graph


def bucket_rows(buckets: tuple[int, ...], batch: int) -> int:
    """The smallest of the sorted `buckets` that holds `batch` rows (a clear error past the largest)."""
    rows = next((b for b in buckets if b >= batch), None)
    if rows is None:
        raise ValueError(f"batch {batch} is over the largest captured bucket ({buckets[-1]})")
    return rows


class Replayable(Protocol):
    """A captured CUDA graph, or what stands in for one (EagerReplay, _CheckedGraph)."""

    def replay(self) -> None: ...


class EagerReplay:
    """Stands in for a graph where nothing is captured: replay() runs the function."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class _CheckedGraph:
    """VERIFYPD_SYNC_DEBUG: a graph whose replay synchronizes and names itself on a device fault."""

    def __init__(self, graph, key):
        self.graph, self.key = graph, key

    def replay(self) -> None:
        torch.cuda.synchronize()
        self.graph.replay()
        try:
            torch.cuda.synchronize()
        except Exception as exc:
            raise RuntimeError(f"device fault in graph {self.key}") from exc

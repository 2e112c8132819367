"""A feature draft's call (model.eagle_draft) as device work with no host sync: the catch-up forward
with the first draft, then the chain; on CUDA both are CUDA graphs (`EagleGraphs`), so a whole draft
call is one host-to-device copy and two graph replays.

Inputs of a call (`CallInputs`): R rows (requests; a graph's bucket, rows past the call's are
padding) x Q catch-up tokens, right-aligned (a row's last token is its pending token; left padding
repeats a real position and writes nowhere). Padding rows have k = 0, base 1 and slot -1
everywhere: they write no KV, read block 0 at position 0, and their outputs are never read; rows are
independent in every kernel, so padding changes no real row's result.

    catch-up  tokens [R * Q]: features (FeaturePool rows) -> fc -> the head's layer -> the last
              row's logits -> draft 1 into out_steps[0]; its pre-norm output into `hidden` [R, H]
    chain     step j = 1 .. steps - 1 (a Python int: one graph per (R, steps, mode) unrolls them):
              feeds out_steps[j - 1] at position base + j - 1 with `hidden`, updates `hidden` in
              place, writes draft j + 1 into out_steps[j]. About 13 kernels a greedy step (fused
              head input, five GEMMs, rope+KV store, attention, two add+norms, SiLU*mul, argmax).
    out_steps [S, R] long (step-major, so a step's argmax writes its row in place)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from verifypd.model import sampler
from verifypd.model.graph_runner import BUCKETS, EagerReplay, bucket_rows, capture_graph
from verifypd.model.layout import PinnedStaging, TokenRun, build_layout, pack
from verifypd.model.llama import BatchLayout
from verifypd.model.verdict_shift import shift_to_verdict
from verifypd.model.verify_fit import variant_queries


@dataclass
class CallInputs:
    """One call's device inputs (static buffers in a graph, per call otherwise). T = R * Q."""

    ids: torch.Tensor  # [T] tokens fed
    positions: torch.Tensor  # [T] their head rows (token position - 1)
    slots: torch.Tensor  # [T] draft pool slots, -1 = write nowhere
    feature_rows: torch.Tensor  # [T] FeaturePool rows of the same positions (padding: the scratch row)
    tables: torch.Tensor  # [R, W] draft block tables
    last: torch.Tensor  # [R] the pending token's position n (padding: 1)
    ks: torch.Tensor  # [R] drafts wanted (padding: 0)
    top_k: torch.Tensor  # [R] sampling parameters (read only in sampled modes)
    seeds: torch.Tensor  # [R]
    temp_bits: torch.Tensor  # [R] float64 bit patterns (so that one int64 copy carries them)
    top_p_bits: torch.Tensor  # [R]
    temp: torch.Tensor  # [R] float32, filled from the bits by the catch-up
    top_p: torch.Tensor  # [R]
    query: int
    vrows: torch.Tensor  # [R] a call fitted to a verdict (model.verdict_shift): its verify rows
    vks: torch.Tensor  # [R] and their k (-1 / 0: not fitted)

    def params(self) -> sampler.SamplingTensors:
        return self.temp, self.top_k, self.top_p, self.seeds


ROW_FIELDS = ("last", "ks", "top_k", "seeds", "temp_bits", "top_p_bits", "vrows", "vks")
TOKEN_FIELDS = ("ids", "positions", "slots", "feature_rows")


def host_inputs(
    draft_runs: list[TokenRun],
    target_runs: list[TokenRun],
    ks: list[int],
    samplings,
    *,
    block_size: int,
    scratch_row: int,
    query: int,
    rows: int,
    width: int | None = None,
    after: tuple[list[int], list[int]] | None = None,
) -> dict:
    """The call's arrays (int64 numpy) by CallInputs field: head rows as head_rows gives them.
    `after` (verify rows, their k): the rows are laid out for the longest outcome of that verify call
    and fitted to its verdict on the device (model.verdict_shift)."""
    layout = build_layout(draft_runs, block_size, query=query, align="right", rows=rows, width=width)
    feature_slots = build_layout(target_runs, block_size, query=query, align="right", rows=rows).slots
    pad = rows - len(ks)
    assert pad >= 0
    last = [r.start_pos + len(r.token_ids) for r in draft_runs]  # one past the last head row (n - 1): x_n's position
    out = {
        "ids": layout.ids,
        "positions": layout.positions,
        "slots": layout.slots,
        "feature_rows": np.where(feature_slots >= 0, feature_slots, scratch_row),
        "tables": layout.tables,
        "last": np.asarray(last + [1] * pad, dtype=np.int64),
        "ks": np.asarray(ks + [0] * pad, dtype=np.int64),
    }
    vrows, vks = after if after is not None else ([-1] * len(ks), [0] * len(ks))
    out.update(
        vrows=np.asarray(list(vrows) + [-1] * pad, dtype=np.int64),
        vks=np.asarray(list(vks) + [0] * pad, dtype=np.int64),
    )
    if all(s.greedy for s in samplings):
        zeros = np.zeros(rows, dtype=np.int64)
        out.update(top_k=zeros, seeds=zeros, temp_bits=zeros, top_p_bits=zeros)
        return out
    seeds = sampler.seed_tensor([s.seed for s in samplings], "cpu").numpy()
    out.update(
        top_k=np.asarray([s.top_k for s in samplings] + [0] * pad, dtype=np.int64),
        seeds=np.concatenate((seeds, np.zeros(pad, dtype=np.int64))),
        temp_bits=np.asarray([s.temperature for s in samplings] + [0.0] * pad, dtype=np.float64).view(np.int64),
        top_p_bits=np.asarray([s.top_p for s in samplings] + [1.0] * pad, dtype=np.float64).view(np.int64),
    )
    return out


@torch.inference_mode()
def catch_up(
    model,
    pool: torch.Tensor,
    features,
    inp: CallInputs,
    mode: str,
    out_steps: torch.Tensor,
    hidden: torch.Tensor,
    arange: torch.Tensor,
) -> None:
    """Writes the catch-up rows' KV, draft 1 into out_steps[0] and the last rows' pre-norm outputs
    into hidden [R, H]. arange: a long arange of at least R + 1 entries on the device."""
    rows, query = inp.tables.shape[0], inp.query
    if mode != sampler.GREEDY:
        inp.temp.copy_(inp.temp_bits.view(torch.float64))
        inp.top_p.copy_(inp.top_p_bits.view(torch.float64))
    batch = BatchLayout(inp.ids, inp.positions, inp.slots, inp.tables, arange[: rows + 1] * query, query)
    h, x = model.rows(pool, batch, features.tensor[inp.feature_rows].flatten(1))
    last = arange[1 : rows + 1] * query - 1
    torch.index_select(h, 0, last, out=hidden)
    model.choose(x[last], mode, inp.params(), inp.last + 1, out_steps[0])


@torch.inference_mode()
def chain(
    model,
    pool: torch.Tensor,
    inp: CallInputs,
    mode: str,
    out_steps: torch.Tensor,
    hidden: torch.Tensor,
    step_positions: torch.Tensor,
    step_slots: torch.Tensor,
    query_start: torch.Tensor,
    block_size: int,
    steps: int,
) -> None:
    """Steps 1 .. steps - 1 from the catch-up's state. step_positions/slots [R]: scratch written by
    each step's input; query_start: arange(R + 1) (one token per row)."""
    for j in range(1, steps):
        fed = out_steps[j - 1]
        x_in = model.head_input(fed, hidden, (j, inp.last, inp.ks, inp.tables, block_size, step_positions, step_slots))
        batch = BatchLayout(fed, step_positions, step_slots, inp.tables, query_start, 1)
        h, x = model.layer(pool, batch, hidden, x_in)
        if h.data_ptr() != hidden.data_ptr():  # the torch norms return new tensors; Triton's update in place
            hidden.copy_(h)
        positions = step_positions + 2 if mode != sampler.GREEDY else None  # where the chosen token sits
        model.choose(x, mode, inp.params(), positions, out_steps[j])


class EagleGraphs:
    """Static inputs and CUDA graphs of feature-draft calls: ("catch_up", R, Q, mode) and
    ("chain", R, steps, mode), sharing one memory pool and one capture stream (see GraphRunner).
    `replay="eager"` runs the captured functions directly over the same static buffers instead of
    capturing them (tests of the buffers' plumbing on the CPU)."""

    def __init__(
        self,
        model,
        pool: torch.Tensor,
        features,
        block_size: int,
        staging: PinnedStaging,
        *,
        buckets: tuple[int, ...] = BUCKETS,
        max_query: int = 9,
        max_steps: int = 8,
        max_graph_tokens: int = 2048,
        replay: str = "cuda",
    ):
        self.model, self.pool, self.features, self.block_size = model, pool, features, block_size
        self.staging, self.replay = staging, replay
        self.buckets, self.max_query, self.max_steps = tuple(sorted(buckets)), max_query, max_steps
        self.max_graph_tokens = max_graph_tokens
        rows, dev = self.buckets[-1], pool.device
        self.width = -(-(model.shape.max_context + 64) // block_size)
        tokens = rows * max_query
        # One int64 buffer, regions at fixed offsets: [row fields | token fields | tables]; a call
        # fills prefixes and crosses in one copy of the span it uses.
        self._offsets, offset = {}, 0
        for name in ROW_FIELDS:
            self._offsets[name], offset = offset, offset + rows
        for name in TOKEN_FIELDS:
            self._offsets[name], offset = offset, offset + tokens
        self._offsets["tables"] = offset
        self._meta = torch.zeros(offset + rows * self.width, dtype=torch.long, device=dev)
        self._floats = torch.zeros(2, rows, dtype=torch.float32, device=dev)
        self.hidden = torch.zeros(rows, model.shape.hidden_size, dtype=model.embed.dtype, device=dev)
        self.out_steps = torch.zeros(max_steps, rows, dtype=torch.long, device=dev)
        self.out_tokens = torch.zeros(rows, max_steps, dtype=torch.long, device=dev)
        self.step_positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.step_slots = torch.zeros(rows, dtype=torch.long, device=dev)
        self.arange = torch.arange(rows + 1, device=dev)
        self._graphs: dict[tuple, object] = {}
        if replay == "cuda":
            self._mempool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream(device=dev)
        self.capture_seconds = 0.0
        self.calls = 0  # draft calls served through the graphs (tests and benches read it)

    # -- sizes -----------------------------------------------------------------------------
    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def rows_for(self, batch: int) -> int:
        """The captured bucket a call of `batch` runs in (callers check `fits` first)."""
        return bucket_rows(self.buckets, batch)

    def fits(self, batch: int, query: int, steps: int, width: int) -> bool:
        rows = self.bucket(batch)
        return (
            rows is not None
            and query <= self.max_query
            and rows * query <= self.max_graph_tokens
            and steps <= self.max_steps
            and width <= self.width
        )

    def inputs(self, rows: int, query: int) -> CallInputs:
        """Views of the static buffer for a (rows, query) call."""
        meta, off = self._meta, self._offsets
        views = {name: meta[off[name] : off[name] + rows] for name in ROW_FIELDS}
        views.update({name: meta[off[name] : off[name] + rows * query] for name in TOKEN_FIELDS})
        tables = meta[off["tables"] : off["tables"] + rows * self.width].view(rows, self.width)
        return CallInputs(
            tables=tables, temp=self._floats[0, :rows], top_p=self._floats[1, :rows], query=query, **views
        )

    # -- a call ----------------------------------------------------------------------------
    def draft(
        self, draft_runs, target_runs, ks: list[int], samplings, mode: str, query: int, after: tuple | None = None
    ) -> torch.Tensor:
        """Tokens [B, K] (K = max(ks)), a view of a static buffer valid until the next call. `after`
        (verdict, verify rows, their k): fitted to that verdict before the replays (model.verdict_shift)."""
        n, steps = len(ks), max(ks)
        rows = self.rows_for(n)
        # Every graph this call needs exists before its inputs are loaded (a capture runs its
        # function once over inert inputs and would overwrite them).
        first = self.graph_for(("catch_up", rows, query, mode))
        rest = self.graph_for(("chain", rows, steps, mode)) if steps > 1 else None
        arrays = host_inputs(
            draft_runs,
            target_runs,
            ks,
            samplings,
            block_size=self.block_size,
            scratch_row=self.features.num_slots,
            query=query,
            rows=rows,
            width=self.width,
            after=after[1:] if after is not None else None,
        )
        self._load(arrays, rows)
        if after is not None:
            shift_to_verdict(self.inputs(rows, query), after[0], self.features.num_slots, self.replay == "cuda")
        self.calls += 1
        first.replay()
        if rest is None:
            return self.out_steps[0, :n, None]
        rest.replay()
        return self.out_tokens[:n, :steps]

    def _load(self, arrays: dict, rows: int) -> None:
        span = self._offsets["tables"] + rows * self.width
        host = self.staging.take(span)
        view = host.numpy()
        for name, values in arrays.items():
            start = self._offsets[name]
            view[start : start + values.size] = values.ravel()
        if self.replay == "cuda":
            self._meta[:span].copy_(host, non_blocking=True)
        else:
            self._meta[:span].copy_(host)
        self.staging.sent()

    # -- capture ---------------------------------------------------------------------------
    def _function(self, key: tuple):
        kind, rows, size, mode = key
        if kind == "catch_up":
            inp = self.inputs(rows, size)
            return lambda: catch_up(
                self.model,
                self.pool,
                self.features,
                inp,
                mode,
                self.out_steps[:, :rows],
                self.hidden[:rows],
                self.arange,
            )
        inp = self.inputs(rows, 1)

        def run_chain():
            chain(
                self.model,
                self.pool,
                inp,
                mode,
                self.out_steps[:, :rows],
                self.hidden[:rows],
                self.step_positions[:rows],
                self.step_slots[:rows],
                self.arange[: rows + 1],
                self.block_size,
                size,
            )
            self.out_tokens[:rows, :size].copy_(self.out_steps[:size, :rows].t())

        return run_chain

    def graph_for(self, key: tuple):
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(key)
        return graph

    def _capture(self, key: tuple):
        fn = self._function(key)
        if self.replay != "cuda":
            return EagerReplay(fn)
        t0 = time.perf_counter()
        self._make_inert()
        graph = capture_graph(fn, self._mempool, self._capture_stream)
        self.capture_seconds += time.perf_counter() - t0
        return graph

    def _make_inert(self) -> None:
        """Inputs under which the warm-up run before a capture writes no KV and reads only memory that
        exists: slots -1, k 0, base 1, token 0 at position 0, block 0, the features' scratch row."""
        self._meta.zero_()
        off, rows = self._offsets, self.buckets[-1]
        self._meta[off["slots"] : off["slots"] + rows * self.max_query].fill_(-1)
        self._meta[off["feature_rows"] : off["feature_rows"] + rows * self.max_query].fill_(self.features.num_slots)
        self._meta[off["last"] : off["last"] + rows].fill_(1)
        self.out_steps.zero_()

    def warm_up(self, kinds=("draft",), max_query: int | None = None, max_steps: int | None = None) -> float:
        """Captures the greedy graphs at start-up (catch-ups up to max_query tokens, chains up to
        max_steps drafts); returns seconds."""
        t0 = time.perf_counter()
        for rows in reversed(self.buckets):  # largest first: later captures reuse its pool memory
            for query in range(1, min(max_query or self.max_query, self.max_query) + 1):
                if rows * query <= self.max_graph_tokens:
                    self.graph_for(("catch_up", rows, query, sampler.GREEDY))
            for steps in range(2, min(max_steps or self.max_steps, self.max_steps) + 1):
                self.graph_for(("chain", rows, steps, sampler.GREEDY))
        if "draft" in kinds and self.replay == "cuda":
            self.compile_shift_variants(min(max_query or self.max_query, self.max_query))
        return time.perf_counter() - t0

    def compile_shift_variants(self, max_query: int) -> list[int]:
        """Launches the shift kernel (model.verdict_shift, drafts made after a verify call) once per Triton
        variant a call can take, before any call: its row fields marked unfitted (vrows -1: nothing is
        written; every call loads its own). As GraphRunner.compile_fit_variants, so no call compiles one
        mid-step. The row fields sit at fixed offsets, so the query's variant (verify_fit.kernel_variant)
        is the only one; the verdict's row stride, 10, is of the class of every verify call's (K + 2 <= 10:
        neither 1 nor a multiple of 16). Returns the queries launched."""
        verdict = torch.zeros(1, 10, dtype=torch.long, device=self._meta.device)
        queries = variant_queries(max_query)
        for query in queries:
            inp = self.inputs(1, query)
            inp.vrows.fill_(-1)
            shift_to_verdict(inp, verdict, self.features.num_slots, use_triton=True)
        return queries


def device_inputs(arrays: dict, query: int, device: torch.device, staging: PinnedStaging | None) -> CallInputs:
    """A call's inputs as fresh device tensors (the eager path): one copy."""
    names = list(arrays)
    views = dict(zip(names, pack([arrays[name] for name in names], device, staging)))
    rows = arrays["last"].size
    views["tables"] = views["tables"].view(rows, -1)
    floats = torch.empty(2, rows, dtype=torch.float32, device=device)
    return CallInputs(temp=floats[0], top_p=floats[1], query=query, **views)

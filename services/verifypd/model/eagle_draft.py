"""Drafting with an EAGLE-3-style head (model.eagle_head) over the target's features (model.features).

Alignment (as the anchors train it): the head's row at position p pairs the target's features of
position p (the states that predicted token p + 1) with the embedding of token p + 1, writes the
head's KV at p, and predicts token p + 2. So a token x_i the lane is fed becomes row i - 1 (x_0 has
no row), and the draft pool holds rows [0, draft_computed - 1) in the router's terms.

A draft call for a request with pending token x_n at n:
  * catch-up: its fed tokens x_s .. x_n give rows s - 1 .. n - 1 from the target's features (read
    through the target block table); the last row's logits give draft 1 (token n + 1);
  * chain: step j feeds draft j at row n + j - 1 with the head's own pre-norm output of the previous
    row instead of target features, and gives draft j + 1. These rows are speculative: after the
    verify the router re-feeds from x_{n+1} (LaneInfo.reads_features), so they are rewritten from
    the target's features of the accepted positions (rollback by overwrite).
Host syncs: none. The call's device work is model.eagle_chain's (on CUDA two graph replays).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verifypd.domain.requests import SamplingParams
from verifypd.model import sampler
from verifypd.model.eagle_chain import EagleGraphs, catch_up, chain, device_inputs, host_inputs
from verifypd.model.eagle_head import EagleConfig, EagleWeights
from verifypd.model.features import FeaturePool
from verifypd.model.fp8 import linear
from verifypd.model.graph_runner import BUCKETS
from verifypd.model.kv_pool import KvPool
from verifypd.model.layout import PinnedStaging, TokenRun, build_layout, pack
from verifypd.model.llama import BatchLayout, LlamaWeights, PagedLlama
from verifypd.model.runner import PREFILL_GRAPH_QUERIES, prefill_query
from verifypd.model.verdict_shift import shift_to_verdict

GREEDY_PARAMS = SamplingParams()


class EagleModel:
    """The head's forward over its own paged KV (one layer; PagedLlama's attention backends)."""

    def __init__(self, config: EagleConfig, weights: EagleWeights, embed: torch.Tensor, attention: str = "auto"):
        self.config, self.weights, self.embed = config, weights, embed  # embed: the target's [V, H]
        self.shape = config.attention_shape()
        self.num_layers = 1
        self.vocab_size = config.vocab_size
        self.shell = PagedLlama(
            self.shape,
            LlamaWeights(embed=embed, layers=[weights.layer], final_norm=weights.final_norm, lm_head=weights.lm_head),
            attention=attention,
        )
        self.attention = self.shell.attention
        mapping = weights.draft_to_target
        # Greedy picks the argmax of the draft logits (mapped to target ids) when the map keeps the
        # target's order: the first maximum is then the same token as over the -inf-filled target
        # vocabulary, without filling and scattering V logits per step.
        self.greedy_in_draft_vocab = mapping is None or bool((mapping[1:] > mapping[:-1]).all())

    def head_input(self, ids: torch.Tensor, g: torch.Tensor, step: tuple | None = None) -> torch.Tensor:
        """[T, 2H]: concat(input_norm(embed[ids]), hidden_norm(g)); a chain step (`step`, see
        eagle_kernels.head_input) also writes its rows' positions and slots. One launch on Triton."""
        w, eps = self.weights, self.shape.rms_norm_eps
        if self.attention == "triton":
            from verifypd.model.kernels.eagle_head_input import head_input

            return head_input(ids, self.embed, g, w.layer.input_norm, w.hidden_norm, eps, step)
        if step is not None:  # the kernel's rule in torch
            j, base, ks, tables, block_size, positions, slots = step
            active = j < ks
            pos = torch.where(active, base + (j - 1), base - 1)
            block = tables.gather(1, (pos // block_size)[:, None]).squeeze(1)
            positions.copy_(pos)
            slots.copy_(torch.where(active, block * block_size + pos % block_size, -1))
        _, e = self.shell.add_rms_norm(self.embed[ids], None, w.layer.input_norm)
        _, x = self.shell.add_rms_norm(g, None, w.hidden_norm)
        return torch.cat((e, x), dim=-1)

    def layer(self, pool: torch.Tensor, batch: BatchLayout, g: torch.Tensor, x_in: torch.Tensor):
        """(h, x): h = g + attn + mlp, the pre-norm output (g itself, updated in place, on Triton),
        x = final_norm(h). Writes the rows' KV."""
        w, shell = self.weights, self.shell
        mask = shell.attention_mask(batch, pool.shape[3]) if self.attention == "reference" else None
        attn = linear(shell.attend(x_in, w.layer, pool, 0, batch, mask), w.layer.o)
        h, x = shell.add_rms_norm(g, attn, w.layer.post_norm)  # h = g + attn
        mlp = shell.mlp(w.layer, x)
        return shell.add_rms_norm(h, mlp, w.final_norm)  # h = g + attn + mlp

    def rows(self, pool: torch.Tensor, batch: BatchLayout, features: torch.Tensor):
        """Rows from the target's features [T, 3Ht]: (pre-norm output [T, H], final-normed [T, H])."""
        g = F.linear(features, self.weights.fc)
        return self.layer(pool, batch, g, self.head_input(batch.input_ids, g))

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[N, V] over the target vocabulary, -inf outside the draft vocabulary."""
        mapping = self.weights.draft_to_target
        if mapping is None:
            return draft_logits
        out = draft_logits.new_full((draft_logits.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, mapping, draft_logits)

    def choose(
        self, x: torch.Tensor, mode: str, params: sampler.SamplingTensors, positions: torch.Tensor, out: torch.Tensor
    ) -> None:
        """The next draft of each row from final-normed x [N, H] into out [N] (target ids);
        params = (temp, top_k, top_p, seeds), positions = where the chosen tokens sit (sampled)."""
        w = self.weights
        draft_logits = F.linear(x, w.lm_head)
        if mode == sampler.GREEDY and self.greedy_in_draft_vocab:
            if w.draft_to_target is None:
                torch.argmax(draft_logits, -1, out=out)
            else:
                torch.index_select(w.draft_to_target, 0, draft_logits.argmax(-1), out=out)
            return
        out.copy_(sampler.choose(self.target_logits(draft_logits), mode, *params, positions))


@dataclass
class FeatureRun(TokenRun):
    """A TokenRun of a feature draft: also the target's blocks, where its features are."""

    target_block_ids: tuple[int, ...] = ()


def head_rows(runs: list[FeatureRun]) -> tuple[list[int], list[TokenRun], list[TokenRun]]:
    """Token x_i -> row i - 1: (indices of runs that have rows, their rows in the draft pool, the same
    positions in the target's blocks)."""
    keep, draft, target = [], [], []
    for n, r in enumerate(runs):
        skip = 1 if r.start_pos == 0 else 0
        if len(r.token_ids) > skip:
            keep.append(n)
            draft.append(TokenRun(r.token_ids[skip:], r.start_pos + skip - 1, r.block_ids))
            target.append(TokenRun(r.token_ids[skip:], r.start_pos + skip - 1, r.target_block_ids))
    return keep, draft, target


class EagleRunner:
    """The draft lane's runner for a feature draft (same calls as ModelRunner's draft side)."""

    reads_features = True

    def __init__(
        self,
        model: EagleModel,
        pool: KvPool,
        features: FeaturePool,
        graphs: bool | str | None = None,
        buckets: tuple[int, ...] | None = None,
    ):
        """graphs: the draft call as CUDA graphs (None = on CUDA with the Triton backend); "eager":
        the graphs' static buffers with their functions run directly (tests, on any device)."""
        if pool.geometry.num_layers != 1:
            raise ValueError(f"an EAGLE head's pool has one layer, got {pool.geometry.num_layers}")
        self.model, self.pool, self.features = model, pool, features
        self.device = pool.device
        self.block_size = pool.geometry.block_size
        self.staging = PinnedStaging(self.device)
        if graphs is None:
            graphs = self.device.type == "cuda" and model.attention == "triton"
        self.graphs = None
        if graphs:
            self.graphs = EagleGraphs(
                model,
                pool.tensor,
                features,
                self.block_size,
                self.staging,
                replay="eager" if graphs == "eager" else "cuda",
                buckets=buckets or BUCKETS,
            )
        self.prefill_graphs: EagleGraphs | None = None  # capture_prefill_graphs
        self.prefill_queries: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def capture_prefill_graphs(self, queries: tuple[int, ...] = PREFILL_GRAPH_QUERIES) -> float:
        """One sequence's prefill rows as graphs, as ModelRunner.capture_prefill_graphs does for the
        target (same query buckets; an EagleGraphs of their own: the prefill lane's stream, not the
        draft lane's). Its catch-up graphs also choose a first draft, unused here. Returns seconds."""
        if self.graphs is None or not queries:
            return 0.0
        self.prefill_queries = tuple(sorted(queries))
        top = self.prefill_queries[-1]
        self.prefill_graphs = EagleGraphs(
            self.model,
            self.pool.tensor,
            self.features,
            self.block_size,
            PinnedStaging(self.device),
            buckets=(1,),
            max_query=top,
            max_steps=1,
            max_graph_tokens=top,
            replay=self.graphs.replay,
        )
        for query in reversed(self.prefill_queries):
            self.prefill_graphs.graph_for(("catch_up", 1, query, sampler.GREEDY))
        return self.prefill_graphs.capture_seconds

    @torch.inference_mode()
    def prefill(self, runs: list[FeatureRun]) -> None:
        """The rows a prefill chunk completes (its features were just written by the target forward):
        one sequence of up to max(prefill_queries) rows through the prefill graphs, else `rows`."""
        keep, draft_runs, target_runs = head_rows(runs)
        if len(keep) == 1 and len(runs) == 1 and self.prefill_graphs is not None:
            query = prefill_query(self.prefill_queries, len(draft_runs[0].token_ids))
            if query is not None:
                self.prefill_graphs.draft(draft_runs, target_runs, [1], [GREEDY_PARAMS], sampler.GREEDY, query)
                return
        self._ragged_rows(draft_runs, target_runs)

    @torch.inference_mode()
    def _ragged_rows(self, draft_runs: list[TokenRun], target_runs: list[TokenRun]) -> None:
        """Head rows (as head_rows gives them) from the target's features: a ragged forward, no logits."""
        if not draft_runs:
            return
        layout = build_layout(draft_runs, self.block_size)
        feature_slots = build_layout(target_runs, self.block_size).slots
        ids, positions, slots, starts, tables, fslots = pack(
            [layout.ids, layout.positions, layout.slots, layout.query_start, layout.tables, feature_slots],
            self.device,
            self.staging,
        )
        batch = BatchLayout(ids, positions, slots, tables.view(layout.tables.shape), starts, layout.max_query)
        self.model.rows(self.pool.tensor, batch, self.features.read(fslots))

    def draft(self, runs: list[FeatureRun], ks: list[int], samplings, after: tuple | None = None) -> torch.Tensor:
        """As ModelRunner.draft: tokens [B, K]. A sampled row's draft at position t is the seeded race
        winner of the head's distribution there (`sampler.choose`), coupled with the target's.
        Graphed (two replays) when the call fits the graphs' sizes (a catch-up longer than their
        query first has its older rows written: `_catch_up_beyond_graphs`), else the same functions
        eagerly. `after` (verdict, verify rows, their k): each run ends in the k + 1 tokens of a verify
        call not yet known on the host (placeholders), fitted to its verdict on the device first
        (model.verdict_shift; engine.draft_after)."""
        if any(r.start_pos + len(r.token_ids) < 2 for r in runs):
            raise ValueError("a feature draft needs the pending token at position >= 1")
        mode = sampler.choice_mode(samplings)
        graphs = self.graphs
        if graphs is not None:
            runs = self._catch_up_beyond_graphs(runs, graphs.max_query)
        _, draft_runs, target_runs = head_rows(runs)  # every run has a row (position >= 1)
        query, steps = max(len(r.token_ids) for r in draft_runs), max(ks)
        width = max(len(r.block_ids) for r in draft_runs)
        if graphs is not None and graphs.fits(len(runs), query, steps, width):
            return graphs.draft(draft_runs, target_runs, ks, samplings, mode, query, after)
        n = len(runs)
        arrays = host_inputs(
            draft_runs,
            target_runs,
            ks,
            samplings,
            block_size=self.block_size,
            scratch_row=self.features.num_slots,
            query=query,
            rows=n,
            after=after[1:] if after is not None else None,
        )
        inp = device_inputs(arrays, query, self.device, self.staging)
        if after is not None:
            shift_to_verdict(inp, after[0], self.features.num_slots, self.model.attention == "triton")
        out_steps = torch.empty(steps, n, dtype=torch.long, device=self.device)
        hidden = torch.empty(n, self.model.shape.hidden_size, dtype=self.model.embed.dtype, device=self.device)
        arange = torch.arange(n + 1, device=self.device)
        catch_up(self.model, self.pool.tensor, self.features, inp, mode, out_steps, hidden, arange)
        chain(
            self.model,
            self.pool.tensor,
            inp,
            mode,
            out_steps,
            hidden,
            torch.empty_like(inp.ks),
            torch.empty_like(inp.ks),
            arange,
            self.block_size,
            steps,
        )
        return out_steps.t().contiguous()

    def _catch_up_beyond_graphs(self, runs: list[FeatureRun], tail: int) -> list[FeatureRun]:
        """A run longer than the graphs' catch-up query `tail` (a request that plain-decoded for a while,
        then drafts again) has its older tokens' rows written first by one ragged forward, as a
        prefill chunk's are, and only its last max_query tokens go to the graphed call. The eager
        call it replaces (catch-up and chain, ~60 launches from Python) took 3.5-8.9 ms on an H200
        at batch 1-8 against ~0.2 ms for a graphed one. Same rows, same KV: a row reads only the
        KV of the rows before it, which the forward has written by then (same stream)."""
        if all(len(r.token_ids) <= tail for r in runs):
            return runs
        older = [
            FeatureRun(r.token_ids[:-tail], r.start_pos, r.block_ids, r.target_block_ids)
            for r in runs
            if len(r.token_ids) > tail
        ]
        self._ragged_rows(*head_rows(older)[1:])  # not the prefill graphs: the prefill lane's stream
        return [
            r
            if len(r.token_ids) <= tail
            else FeatureRun(r.token_ids[-tail:], r.start_pos + len(r.token_ids) - tail, r.block_ids, r.target_block_ids)
            for r in runs
        ]


def same_device(a: torch.device, b: torch.device | str) -> bool:
    """`cuda` and `cuda:0` name one GPU (torch.device equality says they differ)."""
    b = torch.device(b)
    if a.type != b.type:
        return False
    current = torch.cuda.current_device() if a.type == "cuda" else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def attach_features(target: PagedLlama, target_pool: KvPool, config: EagleConfig) -> FeaturePool:
    """A feature pool over the target pool's slots, filled by every forward of `target` from now on.
    The one `target` already fills is kept where it fits (same slots, layers, width, dtype and
    device): a tensor-parallel rank set builds its target runner, and captures its graphs (which
    write the features), once for every engine over the same models."""
    g = target_pool.geometry
    old = target.features
    if (
        old is not None
        and old.num_slots == g.num_blocks * g.block_size
        and old.capture_layers == tuple(config.aux_layer_ids)
        and old.tensor.shape[-1] == target.shape.hidden_size
        and old.tensor.dtype == target.weights.embed.dtype
        and same_device(old.tensor.device, target_pool.device)
    ):
        return old
    features = FeaturePool(
        g.num_blocks * g.block_size,
        config.aux_layer_ids,
        target.shape.hidden_size,
        target.weights.embed.dtype,
        target_pool.device,
    )
    target.features = features
    return features

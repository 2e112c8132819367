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
Host syncs: none (the chain is `draft_loop`'s state machine with a hidden-state buffer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verifypd.model import sampler
from verifypd.model.draft_loop import DraftState
from verifypd.model.eagle_chain import EagleGraphs, eagle_step
from verifypd.model.eagle_head import EagleConfig, EagleWeights
from verifypd.model.features import FeaturePool
from verifypd.model.kv_pool import KvPool
from verifypd.model.layout import PinnedStaging, TokenRun, build_layout, pack
from verifypd.model.llama import BatchLayout, LlamaWeights, PagedLlama


class EagleModel:
    """The head's forward over its own paged KV (one layer; PagedLlama's attention backends)."""

    def __init__(self, config: EagleConfig, weights: EagleWeights, embed: torch.Tensor, attention: str = "auto"):
        self.config, self.weights, self.embed = config, weights, embed     # embed: the target's [V, H]
        self.shape = config.attention_shape()
        self.num_layers = 1
        self.vocab_size = config.vocab_size
        self.shell = PagedLlama(self.shape, LlamaWeights(embed=embed, layers=[weights.layer],
                                                         final_norm=weights.final_norm, lm_head=weights.lm_head),
                                attention=attention)
        self.attention = self.shell.attention

    @torch.inference_mode()
    def forward(self, pool: torch.Tensor, batch: BatchLayout, logits_index: torch.Tensor | None, *,
                features: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows from target `features` [T, 3Ht] or the head's own `hidden` [T, H]; writes their KV.
        Returns (pre-norm output [T, H]: the next chain step's hidden, logits [len(index), V] over
        the target vocabulary, -inf outside the draft vocabulary)."""
        w, shell = self.weights, self.shell
        norm = shell._add_rms_norm
        g = F.linear(features, w.fc) if features is not None else hidden.clone()   # clone: norms may update in place
        _, e = norm(self.embed[batch.input_ids], None, w.layer.input_norm)
        _, x = norm(g, None, w.hidden_norm)
        mask = shell._attention_mask(batch, pool.shape[3]) if self.attention == "reference" else None
        attn = F.linear(shell._attention(torch.cat((e, x), dim=-1), w.layer, pool, 0, batch, mask), w.layer.o)
        h, x = norm(g, attn, w.layer.post_norm)                                     # h = g + attn
        mlp = F.linear(shell._act_mul(F.linear(x, w.layer.gate_up)), w.layer.down)
        h, x = norm(h, mlp, w.final_norm)                                           # h = g + attn + mlp
        if logits_index is None:
            return h, None
        draft_logits = F.linear(x[logits_index], w.lm_head)
        if w.draft_to_target is None:
            if logits_out is None:
                return h, draft_logits
            return h, logits_out.copy_(draft_logits)
        if logits_out is None:
            logits_out = draft_logits.new_empty(draft_logits.shape[0], self.vocab_size)
        logits_out.fill_(float("-inf"))
        return h, logits_out.index_copy_(1, w.draft_to_target, draft_logits)


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

    def __init__(self, model: EagleModel, pool: KvPool, features: FeaturePool, graphs: bool | None = None,
                 buckets: tuple[int, ...] | None = None):
        """graphs: the chain step as CUDA graphs (None = on CUDA with the Triton backend)."""
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
            self.graphs = EagleGraphs(model, pool.tensor, self.block_size, self.staging,
                                      **({"buckets": buckets} if buckets else {}))

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def _rows_forward(self, runs: list[FeatureRun], query: int | None, logits: bool):
        """Forward of the runs' rows (ragged when query is None, else padded right-aligned): returns
        (kept run indices, the batch's draft block tables, hidden [T, H], logits of each kept run's
        last row or None)."""
        keep, draft_runs, target_runs = head_rows(runs)
        if not keep:
            return keep, None, None, None
        layout = build_layout(draft_runs, self.block_size, query=query, align="right")
        feature_slots = build_layout(target_runs, self.block_size, query=query, align="right").slots
        ids, positions, slots, starts, tables, fslots = pack(
            [layout.ids, layout.positions, layout.slots, layout.query_start, layout.tables, feature_slots],
            self.device, self.staging)
        batch = BatchLayout(ids, positions, slots, tables.view(layout.tables.shape), starts, layout.max_query)
        index = starts[1:len(keep) + 1] - 1 if logits else None
        hidden, out = self.model.forward(self.pool.tensor, batch, index, features=self.features.read(fslots))
        return keep, batch.block_tables, hidden, out

    def prefill(self, runs: list[FeatureRun]) -> None:
        """The rows a prefill chunk completes (its features were just written by the target forward)."""
        self._rows_forward(runs, None, logits=False)

    def draft(self, runs: list[FeatureRun], ks: list[int], samplings) -> torch.Tensor:
        """As ModelRunner.draft: tokens [B, K]. A sampled row's draft at position t is the seeded race
        winner of the head's distribution there (`sampler.choose`), coupled with the target's."""
        if any(r.start_pos + len(r.token_ids) < 2 for r in runs):
            raise ValueError("a feature draft needs the pending token at position >= 1")
        mode = sampler.choice_mode(samplings)
        query = max(len(r.token_ids) for r in runs)
        _, tables, hidden, logits = self._rows_forward(runs, query, logits=True)
        last_rows = [r.start_pos + len(r.token_ids) - 1 for r in runs]   # row of the first draft's token
        params = sampler.params_tensor(samplings, self.device) if mode != sampler.GREEDY else (None,) * 4
        first = sampler.choose(logits, mode, *params, sampler.small_tensor(last_rows, self.device) + 1)
        steps = max(ks)
        if steps == 1:
            return first[:, None]
        state = hidden.view(len(runs), query, -1)[:, -1]                    # [B, H]: each run's last row
        if self.graphs is not None and self.graphs.fits(len(runs), steps, tables.shape[1]):
            return self.graphs.chain(samplings, first, last_rows, ks, tables, state, mode)
        st = DraftState.allocate(len(runs), steps, self.vocab_size, tables, logits.dtype)
        st.start(samplings, first, last_rows, ks, self.staging)
        state = state.clone()
        for _ in range(steps - 1):
            eagle_step(self.model, self.pool.tensor, st, state, self.block_size, mode)
        return st.out_tokens


def attach_features(target: PagedLlama, target_pool: KvPool, config: EagleConfig) -> FeaturePool:
    """A feature pool over the target pool's slots, filled by every forward of `target` from now on."""
    g = target_pool.geometry
    features = FeaturePool(g.num_blocks * g.block_size, config.aux_layer_ids, target.shape.hidden_size,
                           target.weights.embed.dtype, target_pool.device)
    target.features = features
    return features


"""Offline decoding with draft trees (`--draft-tree`): prefill, then per step one tree draft
(spec_decode.tree_draft), one target pass over every node of every tree (tree attention), acceptance
(spec_decode.tree.walk) and the accepted path's KV and features moved into place (model.tree_kv).

Acceptance is the coupled rule of the chains (model.sampler): the target's choice after each node is
its argmax (greedy) or its seeded race winner for the node's position (sampled), and the walk keeps
the child equal to that choice. The output is therefore exactly the target's plain decoding, greedy
or seeded, whatever the tree. (spec_decode.tree.accept_tree_sampled is the multi-draft rejection rule
for drafts that carry probabilities; this driver's drafts do not need it.)

Per step: the draft's catch-up (eager, ragged), then spec_decode.tree_step's device half (one CUDA
graph on a GPU, greedy), then one device-to-host copy. One batch of requests run to completion over
the decoder's own pools and blocks: the router's serving loop still drafts chains (docs/engine.md
"Draft trees").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verifypd.domain.draft_tree import TreeShape
from verifypd.domain.requests import SamplingParams
from verifypd.model import sampler
from verifypd.model.build import Models
from verifypd.model.eagle_draft import EagleModel, attach_features
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.layout import TokenRun, build_layout, to_device
from verifypd.model.llama import PagedLlama
from verifypd.spec_decode.tree_draft import DraftSeq, EagleTreeDraft, ModelTreeDraft
from verifypd.spec_decode.tree_step import TreeStep


@dataclass
class TreeStats:
    steps: int = 0  # verify passes
    tokens: int = 0  # tokens those passes emitted (accepted drafts + one target token; the first token is prefill's)
    drafted_nodes: int = 0
    seconds: float = 0.0
    per_request_steps: list[int] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(self.steps, 1)


class TreeDecoder:
    def __init__(
        self,
        models: Models,
        shape: TreeShape,
        block_size: int = 16,
        num_blocks: int = 1024,
        max_context: int = 2048,
        graphs: bool | str | None = None,
    ):
        """graphs: the step's device half as CUDA graphs (None: on CUDA with Triton attention; "eager":
        their static buffers, run directly)."""
        shape.validate()
        if models.draft_model is None:
            raise ValueError(
                f"--draft-tree needs a draft with weights (eagle:, self:N, a model), got {models.draft_name!r}"
            )
        if models.ranks is not None:
            raise ValueError("--draft-tree runs on a single-process target")
        self.shape, self.block_size, self.device = shape, block_size, models.device
        self.target: PagedLlama = models.target_model
        if self.target.windows != [0]:
            raise ValueError("--draft-tree: tree attention takes no sliding-window layers")
        # Every sequence holds the same number of blocks (fixed-width tables for the graphs); block 0
        # is the graphs' scratch.
        self.max_context = max_context
        self.blocks_per_seq = -(-(max_context + shape.nodes + 2) // block_size)
        self.num_blocks = max(num_blocks, 1 + self.blocks_per_seq)
        self.target_pool = self.pool("target", self.target, models.dtype)
        draft = models.draft_model
        self.draft_pool = self.pool("draft", draft, models.dtype)
        self.features = None
        self.drafter: ModelTreeDraft | EagleTreeDraft
        if isinstance(draft, EagleModel):
            self.features = attach_features(self.target, self.target_pool, draft.config)
            self.drafter = EagleTreeDraft(draft, self.draft_pool.tensor, self.features, block_size)
        else:
            self.drafter = ModelTreeDraft(draft, self.draft_pool.tensor, block_size)
        if graphs is None:
            graphs = self.device.type == "cuda" and self.target.attention == "triton"
        self.tree_step = TreeStep(
            self.target,
            self.target_pool.tensor,
            self.features,
            self.drafter,
            shape,
            block_size,
            self.blocks_per_seq,
            graphs,
        )

    def pool(self, role: str, model: PagedLlama | EagleModel, dtype) -> KvPool:
        s = model.shape
        geometry = PoolGeometry(model.num_layers, self.num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        return KvPool(role, geometry, dtype, self.device)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ) -> tuple[list[list[int]], TreeStats]:
        """Generated tokens per prompt (max_tokens each, or through the first of `stop_ids`) and the
        run's statistics."""
        sampling = sampling or SamplingParams()
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        for i, p in enumerate(prompts):
            if not 1 <= len(p) or len(p) + max_tokens > self.max_context:
                raise ValueError(
                    f"prompt {i}: {len(p)} tokens + max_tokens {max_tokens} must be in [1, {self.max_context}]"
                )
        if 1 + len(prompts) * self.blocks_per_seq > self.num_blocks:
            raise ValueError(
                f"{len(prompts)} prompts need {len(prompts) * self.blocks_per_seq + 1} blocks, "
                f"the pools hold {self.num_blocks}"
            )
        per = self.blocks_per_seq
        blocks = [tuple(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))]
        stats = TreeStats()
        t0 = time.perf_counter()
        first = self.prefill(prompts, blocks, sampling)
        seqs = [DraftSeq(list(p) + [t], 0, b, b) for p, t, b in zip(prompts, first, blocks, strict=True)]
        produced = [max_tokens if t in stop_ids else 1 for t in first]
        steps = [0] * len(prompts)
        while True:
            live = [i for i, n in enumerate(produced) if n < max_tokens]
            if not live:
                break
            new = self.step([seqs[i] for i in live], sampling, stats)
            for i, toks in zip(live, new, strict=True):
                take = toks[: max_tokens - produced[i]]
                stop = next((j for j, t in enumerate(take) if t in stop_ids), None)
                if stop is not None:
                    take = take[: stop + 1]
                seqs[i].tokens += take
                produced[i] = max_tokens if stop is not None else produced[i] + len(take)
                stats.tokens += len(take)
                steps[i] += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        stats.per_request_steps = steps
        return [s.tokens[len(p) :] for s, p in zip(seqs, prompts, strict=True)], stats

    def prefill(self, prompts, blocks, sampling: SamplingParams) -> list[int]:
        runs = [TokenRun(list(p), 0, b) for p, b in zip(prompts, blocks, strict=True)]
        batch = to_device(build_layout(runs, self.block_size), self.device)
        logits = self.target.forward(self.target_pool.tensor, batch, batch.query_start[1:].long() - 1)
        positions = torch.tensor([len(p) for p in prompts], device=self.device)
        return self.choose(sampling, logits.shape[0])(logits, positions).tolist()

    def choose(self, sampling: SamplingParams, rows: int):
        """The target's choice for `rows` logits rows: argmax, or the seeded race winner for the
        positions the tokens take (model.sampler)."""
        if sampling.greedy:
            return lambda logits, positions: logits.argmax(-1)
        mode = sampler.choice_mode([sampling])
        params = sampler.params_tensor([sampling] * rows, self.device)
        return lambda logits, positions: sampler.choose(logits, mode, *params, positions)

    def step(self, seqs: list[DraftSeq], sampling: SamplingParams, stats: TreeStats) -> list[list[int]]:
        """One tree draft + verify for `seqs`; returns each one's new tokens (accepted drafts + one)."""
        dev = self.device
        catch = self.drafter.catch_up(seqs)
        root = torch.tensor([s.tokens[-1] for s in seqs], device=dev)
        base = torch.tensor([s.pending for s in seqs], device=dev)
        tables = torch.tensor([list(s.target_blocks) for s in seqs], device=dev)
        choose = None if sampling.greedy else self.choose(sampling, len(seqs) * self.shape.nodes)
        path_tokens, accepted_t, bonus_t = self.tree_step.run(root, catch, base, tables, choose)
        rows = torch.cat((path_tokens, accepted_t[:, None], bonus_t[:, None]), 1).tolist()  # the one sync
        out = []
        for s, row in zip(seqs, rows, strict=True):
            s.done = self.drafter.rows_kept(s)
            *path, a, b = row
            out.append(path[1 : a + 1] + [b])
        stats.steps += 1
        stats.drafted_nodes += len(seqs) * self.shape.budget
        return out

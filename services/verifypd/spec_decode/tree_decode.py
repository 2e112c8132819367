"""Offline decoding with draft trees (`--draft-tree`): prefill, then per step one tree draft
(spec_decode.tree_draft), one target pass over every node of every tree (tree attention), acceptance
(spec_decode.tree.walk) and the accepted path's KV and features moved into place (model.tree_kv).

Acceptance is the coupled rule of the chains (model.sampler): the target's choice after each node is
its argmax (greedy) or its seeded race winner for the node's position (sampled), and the walk keeps
the child equal to that choice. The output is therefore exactly the target's plain decoding, greedy
or seeded, whatever the tree. (spec_decode.tree.accept_tree_sampled is the multi-draft rejection rule
for drafts that carry probabilities; this driver's drafts do not need it.)

Eager (no CUDA graphs), one batch of requests run to completion, its own pools and blocks: the
router's serving loop still drafts chains (docs/engine.md "Draft trees").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verifypd.domain.requests import SamplingParams
from verifypd.model import sampler
from verifypd.model.build import Models
from verifypd.model.eagle_draft import EagleModel, attach_features
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.layout import TokenRun, build_layout, to_device
from verifypd.model.llama import BatchLayout, PagedLlama
from verifypd.model.tree_kv import accepted_moves, move_kv, move_rows, slots_at
from verifypd.spec_decode.tree import TreeShape, walk
from verifypd.spec_decode.tree_draft import DraftSeq, EagleTreeDraft, ModelTreeDraft, grow_tree


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
    def __init__(self, models: Models, shape: TreeShape, block_size: int = 16, num_blocks: int = 1024):
        shape.validate()
        if models.draft_model is None:
            raise ValueError(f"--draft-tree needs a draft with weights (eagle:, self:N, a model), got {models.draft_name!r}")
        if models.ranks is not None:
            raise ValueError("--draft-tree runs on a single-process target")
        self.shape, self.block_size, self.device = shape, block_size, models.device
        self.target: PagedLlama = models.target_model
        if self.target.windows != [0]:
            raise ValueError("--draft-tree: tree attention takes no sliding-window layers")
        self.target_pool = self.pool("target", self.target, num_blocks, models.dtype)
        draft = models.draft_model
        self.draft_pool = self.pool("draft", draft, num_blocks, models.dtype)
        self.features = None
        self.drafter: ModelTreeDraft | EagleTreeDraft
        if isinstance(draft, EagleModel):
            self.features = attach_features(self.target, self.target_pool, draft.config)
            self.drafter = EagleTreeDraft(draft, self.draft_pool.tensor, self.features, block_size)
        else:
            self.drafter = ModelTreeDraft(draft, self.draft_pool.tensor, block_size)
        self.num_blocks = num_blocks

    def pool(self, role: str, model: PagedLlama | EagleModel, blocks: int, dtype) -> KvPool:
        s = model.shape
        return KvPool(role, PoolGeometry(model.num_layers, blocks, self.block_size, s.num_kv_heads, s.head_dim), dtype, self.device)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], max_tokens: int, sampling: SamplingParams | None = None
    ) -> tuple[list[list[int]], TreeStats]:
        """Generated tokens per prompt (exactly max_tokens each) and the run's statistics."""
        sampling = sampling or SamplingParams()
        if any(len(p) < 1 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        need = [-(-(len(p) + max_tokens + self.shape.nodes + 2) // self.block_size) for p in prompts]
        if sum(need) > self.num_blocks:
            raise ValueError(f"{len(prompts)} prompts need {sum(need)} blocks, the decoder's pools hold {self.num_blocks}")
        starts = [sum(need[:i]) for i in range(len(need))]
        blocks = [tuple(range(s, s + n)) for s, n in zip(starts, need, strict=True)]
        stats = TreeStats()
        t0 = time.perf_counter()
        first = self.prefill(prompts, blocks, sampling)
        seqs = [DraftSeq(list(p) + [t], 0, b, b) for p, t, b in zip(prompts, first, blocks, strict=True)]
        produced = [1] * len(prompts)
        steps = [0] * len(prompts)
        while True:
            live = [i for i, n in enumerate(produced) if n < max_tokens]
            if not live:
                break
            new = self.step([seqs[i] for i in live], sampling, stats)
            for i, toks in zip(live, new, strict=True):
                take = toks[: max_tokens - produced[i]]
                seqs[i].tokens += take
                produced[i] += len(take)
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
        return self.choose(logits, sampling, positions).tolist()

    def choose(self, logits: torch.Tensor, sampling: SamplingParams, positions: torch.Tensor) -> torch.Tensor:
        """The target's token per row of logits [R, V]: argmax, or the seeded race winner for `positions`."""
        if sampling.greedy:
            return logits.argmax(-1)
        mode = sampler.choice_mode([sampling])
        rows = logits.shape[0]
        params = sampler.params_tensor([sampling] * rows, self.device)
        return sampler.choose(logits, mode, *params, positions)

    def step(self, seqs: list[DraftSeq], sampling: SamplingParams, stats: TreeStats) -> list[list[int]]:
        """One tree draft + verify for `seqs`; returns each one's new tokens (accepted drafts + one)."""
        tree = grow_tree(self.drafter, seqs, self.shape)
        rows, nodes = tree.tokens.shape
        dev = self.device
        base = torch.tensor([s.pending for s in seqs], device=dev)
        tables = torch.tensor([list(s.target_blocks) for s in seqs], device=dev) if _even(seqs) else _padded(seqs, dev)
        index = base[:, None] + torch.arange(nodes, device=dev)
        batch = BatchLayout(
            input_ids=tree.tokens.reshape(-1),
            positions=(base[:, None] + tree.depth).reshape(-1),
            slots=slots_at(tables, index, self.block_size).reshape(-1),
            block_tables=tables,
            query_start=torch.arange(rows + 1, device=dev, dtype=torch.int32) * nodes,
            max_query=nodes,
            tree_base=base,
            tree_len=torch.full((rows,), nodes, device=dev, dtype=torch.int32),
            tree_bits=tree.ancestors.reshape(-1),
        )
        logits = self.target.forward(self.target_pool.tensor, batch, torch.arange(rows * nodes, device=dev))
        choice = self.choose(logits, sampling, batch.positions + 1).view(rows, nodes)
        verdict = walk(tree, choice)
        src, dst = accepted_moves(tables, base, verdict.path, verdict.accepted, self.block_size)
        move_kv(self.target_pool.tensor, src, dst)
        if self.features is not None:
            move_rows(self.features.tensor, src, dst)
        path_tokens = tree.tokens.gather(1, verdict.path)
        accepted, bonus = verdict.accepted.tolist(), verdict.bonus.tolist()  # the step's one host sync
        paths = path_tokens.tolist()
        out = []
        for s, a, b, p in zip(seqs, accepted, bonus, paths, strict=True):
            s.done = self.drafter.rows_kept(s)
            out.append(p[1 : a + 1] + [b])
        stats.steps += 1
        stats.drafted_nodes += rows * (nodes - 1)
        return out


def _even(seqs: list[DraftSeq]) -> bool:
    return len({len(s.target_blocks) for s in seqs}) == 1


def _padded(seqs: list[DraftSeq], dev) -> torch.Tensor:
    width = max(len(s.target_blocks) for s in seqs)
    return torch.tensor([list(s.target_blocks) + [0] * (width - len(s.target_blocks)) for s in seqs], device=dev)

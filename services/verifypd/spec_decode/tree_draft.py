"""Growing a draft tree (EAGLE-2's dynamic tree) with an EAGLE head or a model draft (`self:N`, a
small model); the tree itself, its cut and its acceptance are spec_decode.tree's.

`grow_tree` for B sequences and a TreeShape (topk K, depth D, budget N - 1):
  * catch-up: the draft is fed the committed tokens it has not seen, through the pending token;
    its last row gives the root's distribution: the K best tokens are the depth-1 candidates;
  * expansion d = 1 .. D - 1: the frontier (the K best candidates of depth d by cumulative
    log-probability) is fed in one forward, each node attending to the prefix plus its frontier
    ancestors (tree attention); its K best children are the depth d + 1 candidates (K * K);
  * the cut: the N - 1 best of all candidates (spec_decode.tree.select_tree).

The draft's tree rows are scratch: frontier node i of expansion d sits at the draft's cache index
tree_base + (d - 1) * K + i, past the rows the draft keeps. After the verify the driver re-feeds the
accepted tokens (catch-up), which rewrites those positions (rollback by overwrite, as chains do).

Draft alignment: a model draft's row at position p is token p (the root's row is the pending token at
n, the tree starts at n + 1, a depth-d node's row at n + d). An EAGLE head's row at p pairs the target's
features of p with token p + 1 (model.eagle_draft), so the pending token is row n - 1, the tree starts
at n, and a depth-d node's row is n + d - 1, fed with its parent's pre-norm output instead of features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verifypd.domain.draft_tree import TreeShape
from verifypd.model.eagle_draft import EagleModel
from verifypd.model.features import FeaturePool
from verifypd.model.layout import TokenRun, build_layout, to_device
from verifypd.model.llama import BatchLayout, PagedLlama
from verifypd.model.tree_kv import slots_at
from verifypd.spec_decode.tree import DraftTree, select_tree


@dataclass
class DraftSeq:
    """One sequence as a tree draft sees it."""

    tokens: list[int]  # committed tokens; the last one is pending (its target KV is not written)
    done: int  # the draft's rows already written (model draft: positions; head: rows)
    blocks: tuple[int, ...]  # the draft pool's blocks
    target_blocks: tuple[int, ...]  # the target's (where a head reads features)

    @property
    def pending(self) -> int:
        return len(self.tokens) - 1


@dataclass
class CatchUp:
    """What a catch-up leaves for the tree's growth (all on the device)."""

    logp: torch.Tensor  # [B, V] float32: the root's next-token log-probabilities
    hidden: torch.Tensor | None  # [B, H]: the root row's pre-norm output (a head), None (a model draft)
    base: torch.Tensor  # [B] long: the draft's first tree row (cache index)
    tables: torch.Tensor  # [B, W] long: the draft's block tables


class ModelTreeDraft:
    """A PagedLlama draft over its own pool (rows = positions)."""

    hidden = False

    def __init__(self, model: PagedLlama, pool: torch.Tensor, block_size: int):
        self.model, self.pool, self.block_size = model, pool, block_size

    def rows_kept(self, seq: DraftSeq) -> int:
        """The draft's valid rows after this step's catch-up (the tree lies past them)."""
        return seq.pending + 1

    def catch_up(self, seqs: list[DraftSeq]) -> CatchUp:
        runs = [TokenRun(s.tokens[s.done :], s.done, s.blocks) for s in seqs]
        batch = to_device(build_layout(runs, self.block_size), self.pool.device)
        base = torch.tensor([s.pending + 1 for s in seqs], device=self.pool.device)
        logits = self.model.forward(self.pool, batch, batch.query_start[1:].long() - 1)
        return CatchUp(logits.float().log_softmax(-1), None, base, batch.block_tables.long())

    def expand(self, tokens, hidden, depth: int, slot_index, bits, tree_len: int, base, tables):
        rows, k = tokens.shape
        positions = (base - 1 + depth)[:, None].expand(rows, k)
        batch = tree_batch(tokens, positions, slot_index, bits, base, tree_len, tables, self.block_size)
        logits = self.model.forward(self.pool, batch, torch.arange(rows * k, device=tokens.device))
        return logits.float().log_softmax(-1).view(rows, k, -1), None


class EagleTreeDraft:
    """An EAGLE head over its own one-layer pool and the target's features."""

    hidden = True

    def __init__(self, model: EagleModel, pool: torch.Tensor, features: FeaturePool, block_size: int):
        self.model, self.pool, self.features, self.block_size = model, pool, features, block_size

    def rows_kept(self, seq: DraftSeq) -> int:
        return seq.pending

    def catch_up(self, seqs: list[DraftSeq]) -> CatchUp:
        """Rows done .. n - 1 from the target's features of those positions and tokens done + 1 .. n."""
        if any(s.pending < 1 for s in seqs):
            raise ValueError("an EAGLE head needs the pending token at position >= 1")
        runs = [TokenRun(s.tokens[s.done + 1 :], s.done, s.blocks) for s in seqs]
        target_runs = [TokenRun(s.tokens[s.done + 1 :], s.done, s.target_blocks) for s in seqs]
        dev = self.pool.device
        batch = to_device(build_layout(runs, self.block_size), dev)
        feature_slots = torch.as_tensor(build_layout(target_runs, self.block_size).slots, device=dev)
        base = torch.tensor([s.pending for s in seqs], device=dev)
        h, x = self.model.rows(self.pool, batch, self.features.read(feature_slots))
        last = batch.query_start[1:].long() - 1
        return CatchUp(self.log_probs(x[last]), h[last].clone(), base, batch.block_tables.long())

    def expand(self, tokens, hidden, depth: int, slot_index, bits, tree_len: int, base, tables):
        rows, k = tokens.shape
        positions = (base + depth - 1)[:, None].expand(rows, k)
        batch = tree_batch(tokens, positions, slot_index, bits, base, tree_len, tables, self.block_size)
        g = hidden.reshape(rows * k, -1).clone()  # the head's layer may update it in place
        h, x = self.model.layer(self.pool, batch, g, self.model.head_input(batch.input_ids, g))
        return self.log_probs(x).view(rows, k, -1), h.view(rows, k, -1).clone()

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """[R, V] over the target's vocabulary (-inf outside a smaller draft vocabulary)."""
        logits = self.model.target_logits(F.linear(x, self.model.weights.lm_head))
        return logits.float().log_softmax(-1)


def tree_batch(tokens, positions, slot_index, bits, base, tree_len: int, tables, block_size: int) -> BatchLayout:
    """A tree-mode layout: K frontier nodes per row at cache indices base + slot_index, RoPE `positions`."""
    rows, k = tokens.shape
    dev = tokens.device
    slots = slots_at(tables, base[:, None] + slot_index, block_size)
    return BatchLayout(  # contiguous: the kernels index these flat (an expanded row may be a stride-0 view)
        input_ids=tokens.reshape(-1).contiguous(),
        positions=positions.reshape(-1).contiguous(),
        slots=slots.reshape(-1).contiguous(),
        block_tables=tables,
        query_start=torch.arange(rows + 1, device=dev, dtype=torch.int32) * k,
        max_query=k,
        tree_base=base,
        tree_len=torch.full((rows,), tree_len, device=dev, dtype=torch.int32),
        tree_bits=bits.reshape(-1).contiguous(),
    )


def grow_tree(draft: ModelTreeDraft | EagleTreeDraft, seqs: list[DraftSeq], shape: TreeShape) -> DraftTree:
    """The draft tree of each sequence (module doc); node 0 is its pending token."""
    root = torch.tensor([s.tokens[-1] for s in seqs], device=draft.pool.device)
    return grow_from_root(draft, root, draft.catch_up(seqs), shape)


def grow_from_root(
    draft: ModelTreeDraft | EagleTreeDraft, root: torch.Tensor, c: CatchUp, shape: TreeShape
) -> DraftTree:
    """The expansions and the cut after a catch-up `c`; root [B] the pending tokens. Device work of
    fixed shapes with no host sync (one CUDA graph per batch size: spec_decode.tree_step)."""
    k, dev = shape.topk, root.device
    root_logp, root_hidden = c.logp, c.hidden
    rows = root_logp.shape[0]
    score, tok = root_logp.topk(k, dim=-1)  # depth-1 candidates [B, K]
    cand_tok, cand_parent, cand_depth, cand_score = [tok], [torch.full_like(tok, -1)], [torch.ones_like(tok)], [score]
    cand_index = torch.arange(k, device=dev).expand(rows, k)  # the frontier's candidate ids
    hidden = root_hidden[:, None].expand(rows, k, -1) if root_hidden is not None else None
    parent_bits = torch.zeros(rows, k, dtype=torch.long, device=dev)
    one = torch.ones((), dtype=torch.long, device=dev)
    offset = k
    for d in range(1, shape.depth):
        slot_index = ((d - 1) * k + torch.arange(k, device=dev)).expand(rows, k)
        bits = parent_bits | (one << slot_index)
        logp, out_hidden = draft.expand(tok, hidden, d, slot_index, bits, d * k, c.base, c.tables)
        child_lp, child_tok = logp.topk(k, dim=-1)  # [B, K, K]
        child_score = (score[:, :, None] + child_lp).reshape(rows, k * k)
        cand_tok.append(child_tok.reshape(rows, k * k))
        cand_parent.append(cand_index[:, :, None].expand(rows, k, k).reshape(rows, k * k))
        cand_depth.append(torch.full((rows, k * k), d + 1, dtype=torch.long, device=dev))
        cand_score.append(child_score)
        if d == shape.depth - 1:
            break
        score, pick = child_score.topk(k, dim=-1)  # the next frontier
        tok = cand_tok[-1].gather(1, pick)
        parent = pick // k
        cand_index = offset + pick
        offset += k * k
        parent_bits = bits.gather(1, parent)
        if out_hidden is not None:
            hidden = out_hidden.gather(1, parent[:, :, None].expand(rows, k, out_hidden.shape[-1]))
    return select_tree(
        root,
        torch.cat(cand_tok, 1),
        torch.cat(cand_parent, 1),
        torch.cat(cand_depth, 1),
        torch.cat(cand_score, 1),
        shape.budget,
        max_depth=shape.depth,
    )

"""Draft trees (EAGLE-2-style dynamic trees): how a tree is cut from the drafted candidates, and how
the target's verdict over it is accepted. Pure torch, no model. (The tree's shape, `--draft-tree`:
domain.draft_tree.)

A tree per row (B rows), N = 1 + budget nodes, in topological order (a parent before its children):

    tokens    [B, N] long    node 0 is the root: the pending token (committed, KV not yet written)
    parents   [B, N] long    parent node index; -1 for the root
    depth     [B, N] long    0 for the root; a node at depth d sits at position pending + d
    ancestors [B, N] int64   bit j set iff node j is the node itself or one of its ancestors (N <= 64)

The verify forward runs all N nodes in one pass: node j's KV goes to the slot of position pending + j
(scratch beyond the accepted prefix), its RoPE position is pending + depth[j], and it attends to the
committed prefix plus the nodes of its `ancestors` bits (model.kernels.paged_attention's tree mode).

Acceptance:
  * greedy, and seeded sampling through the project's coupled race (the target's choice at a node is
    a function of its distribution, the seed and the position; model.sampler.race): `walk` from the
    root, following the child whose token equals the target's choice at the current node. The output
    is exactly what plain decoding gives.
  * sampling with draft probabilities (SpecInfer / EAGLE multi-draft rejection, `accept_siblings`,
    `accept_tree_sampled`): at a node, try each child in turn: accept it with min(1, p(x) / q_i(x));
    on rejection replace p by norm(max(p - q_i, 0)) and try the next; if every child is rejected,
    sample from the residual p. q_i is the distribution child i was drawn from: q for i.i.d. draws
    (with replacement), q with the earlier siblings removed and renormalized (without replacement),
    or the one-hot of the token for deterministic top-k children. Each makes the emitted token ~ p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N]
    parents: torch.Tensor  # [B, N]
    depth: torch.Tensor  # [B, N]
    ancestors: torch.Tensor  # [B, N] int64

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())


def ancestor_bits(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N] int64 bitmasks from parents [B, N] (topological, root -1): one gather per level."""
    n = parents.shape[1]
    one = torch.ones((), dtype=torch.long, device=parents.device)
    bits = one << torch.arange(n, device=parents.device).expand_as(parents)
    up = parents
    for _ in range(max_depth):
        has = up >= 0
        bits = bits | torch.where(has, one << up.clamp(min=0), 0)
        up = torch.where(has, parents.gather(1, up.clamp(min=0)), -1)
    return bits


def select_tree(
    root_tokens: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_parents: torch.Tensor,
    cand_depth: torch.Tensor,
    cand_scores: torch.Tensor,
    budget: int,
    max_depth: int | None = None,
) -> DraftTree:
    """The tree of the `budget` best candidates by cumulative draft log-probability (EAGLE-2's rerank).

    cand_* [B, C] in drafting order (a candidate after its parent); cand_parents index candidates,
    -1 = the root. Scores never increase from parent to child (log-probabilities <= 0) and a stable
    sort keeps a parent ahead of an equal-scored child, so the cut is closed under ancestors
    (tests check it; no host sync here). max_depth: the deepest candidate's depth (None: looked up,
    a host sync; CUDA-graph callers pass it)."""
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :budget]
    chosen = torch.sort(order, dim=1).values  # drafting order again: topological
    rows, c = cand_tokens.shape
    remap = torch.full((rows, c), -1, dtype=torch.long, device=cand_tokens.device)
    remap.scatter_(1, chosen, torch.arange(1, budget + 1, device=cand_tokens.device).expand(rows, -1))
    parent_cand = cand_parents.gather(1, chosen)
    parents = torch.where(parent_cand < 0, 0, remap.gather(1, parent_cand.clamp(min=0)))
    root_col = torch.zeros(rows, 1, dtype=torch.long, device=cand_tokens.device)
    tokens = torch.cat((root_tokens.view(rows, 1), cand_tokens.gather(1, chosen)), dim=1)
    parents = torch.cat((root_col - 1, parents), dim=1)
    depth = torch.cat((root_col, cand_depth.gather(1, chosen)), dim=1)
    levels = int(depth.max()) if max_depth is None else max_depth
    return DraftTree(tokens, parents, depth, ancestor_bits(parents, levels))


@dataclass
class TreeVerdict:
    path: torch.Tensor  # [B, max_depth + 1] accepted node indices from the root (valid up to accepted + 1)
    accepted: torch.Tensor  # [B] drafted nodes accepted (path length - 1)
    bonus: torch.Tensor  # [B] the target's token after the accepted path


def walk(tree: DraftTree, choice: torch.Tensor, max_depth: int | None = None) -> TreeVerdict:
    """Greedy / coupled-race acceptance: choice [B, N] is the target's token after each node.
    max_depth: as select_tree's (None: looked up)."""
    rows, n = tree.tokens.shape
    depth = tree.max_depth if max_depth is None else max_depth
    path = torch.zeros(rows, depth + 1, dtype=torch.long, device=choice.device)
    cur = torch.zeros(rows, dtype=torch.long, device=choice.device)
    alive = torch.ones(rows, dtype=torch.bool, device=choice.device)
    accepted = torch.zeros(rows, dtype=torch.long, device=choice.device)
    index = torch.arange(n, device=choice.device)
    for d in range(1, depth + 1):
        want = choice.gather(1, cur[:, None])
        match = (tree.parents == cur[:, None]) & (tree.tokens == want)
        found = match.any(1) & alive
        first = torch.where(match, index, n).min(1).values  # the first matching sibling
        cur = torch.where(found, first, cur)
        path[:, d] = torch.where(found, cur, 0)
        accepted += found.long()
        alive &= found
    return TreeVerdict(path, accepted, choice.gather(1, cur[:, None]).squeeze(1))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) over the last dim; where that is all zero (p == q: rejection had
    probability 0), p itself."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def accept_siblings(
    p: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None, valid: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection over siblings. p [R, V] target probabilities; tokens [R, m] the children in
    the order tried; q [R, m, V] the distribution each was drawn from (None: one-hot, deterministic
    children); valid [R, m]; u [R, m] uniforms in [0, 1). Returns (index of the accepted child or -1
    [R], p after the rejections [R, V]: where none was accepted, the emitted token is drawn from it)."""
    rows, m = tokens.shape
    accepted = torch.full((rows,), -1, dtype=torch.long, device=p.device)
    for i in range(m):
        x = tokens[:, i : i + 1]
        qi = q[:, i] if q is not None else torch.zeros_like(p).scatter_(1, x, 1.0)
        live = (accepted < 0) & valid[:, i]
        px, qx = p.gather(1, x).squeeze(1), qi.gather(1, x).squeeze(1)
        ok = live & (u[:, i] * qx < px)  # u < p(x) / q(x), q(x) > 0 for a drawn x
        accepted = torch.where(ok, i, accepted)
        rejected = live & ~ok
        p = torch.where(rejected[:, None], residual(p, qi), p)
    return accepted, p


def accept_tree_sampled(
    tree: DraftTree, p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None = None
) -> TreeVerdict:
    """Multi-draft rejection sampling down the tree. p [B, N, V]: the target's distribution after each
    node; q [B, N, V]: the distribution node j's token was drawn from (None: deterministic children)."""
    rows, n = tree.tokens.shape
    depth = tree.max_depth
    dev = p.device
    path = torch.zeros(rows, depth + 1, dtype=torch.long, device=dev)
    cur = torch.zeros(rows, dtype=torch.long, device=dev)
    alive = torch.ones(rows, dtype=torch.bool, device=dev)
    accepted = torch.zeros(rows, dtype=torch.long, device=dev)
    bonus = torch.zeros(rows, dtype=torch.long, device=dev)
    index = torch.arange(n, device=dev)
    for d in range(depth + 1):
        children = (tree.parents == cur[:, None]) & alive[:, None]  # [B, N], tried in node order
        m = int(children.sum(1).max()) if d < depth else 0
        pc = p[torch.arange(rows, device=dev), cur]  # [B, V]
        if m == 0:
            step_ok = torch.zeros(rows, dtype=torch.bool, device=dev)
            resid = pc
        else:
            slot = torch.where(children, index, n).sort(1).values[:, :m]  # child node ids, n = none
            valid = slot < n
            slot = slot.clamp(max=n - 1)
            toks = tree.tokens.gather(1, slot)
            qs = None
            if q is not None:
                qs = q[torch.arange(rows, device=dev)[:, None], slot]
            u = torch.rand(rows, m, device=dev, generator=generator)
            which, resid = accept_siblings(pc, toks, qs, valid, u)
            step_ok = which >= 0
            cur = torch.where(step_ok, slot.gather(1, which.clamp(min=0)[:, None]).squeeze(1), cur)
        ending = alive & ~step_ok
        drawn = torch.multinomial(resid, 1, generator=generator).squeeze(1)
        bonus = torch.where(ending, drawn, bonus)
        if d < depth:
            path[:, d + 1] = torch.where(alive & step_ok, cur, 0)
            accepted += (alive & step_ok).long()
        alive &= step_ok
        if not bool(alive.any()):
            break
    return TreeVerdict(path, accepted, bonus)

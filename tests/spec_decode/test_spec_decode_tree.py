"""Draft trees (spec_decode.tree): the cut, the ancestor bits, greedy walks, and the multi-draft
rejection rule's output distribution (it must be the target's, whatever the drafts)."""

from __future__ import annotations

import pytest
import torch

from verifypd.domain.draft_tree import TreeShape, parse_tree_shape
from verifypd.domain.requests import InvalidRequest
from verifypd.spec_decode import tree as tree_mod
from verifypd.spec_decode.tree import (
    DraftTree,
    accept_siblings,
    accept_tree_sampled,
    ancestor_bits,
    select_tree,
    walk,
)

TRIALS = 100_000
TV_BOUND = 0.012  # 100k draws over 5 tokens: sampling noise in TV is ~0.003


def total_variation(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    return 0.5 * float((counts / counts.sum() - p.double()).abs().sum())


def draw_siblings(q: torch.Tensor, m: int, how: str, gen: torch.Generator):
    """m sibling drafts for TRIALS rows from q [V]: tokens [R, m] and the q each was drawn from."""
    v = q.numel()
    qs = q.expand(TRIALS, v).clone()
    if how == "topk":  # deterministic children: q_i is the one-hot of the token
        tokens = q.topk(m).indices.expand(TRIALS, m).contiguous()
        return tokens, None
    tokens, rows = [], []
    for _ in range(m):
        rows.append(qs.clone())
        x = torch.multinomial(qs, 1, generator=gen)
        tokens.append(x)
        if how == "without":  # the next sibling is drawn from q without the earlier ones
            qs = qs.scatter(1, x, 0.0)
            qs = qs / qs.sum(1, keepdim=True)
    return torch.cat(tokens, 1), torch.stack(rows, 1)


def emitted(p: torch.Tensor, q: torch.Tensor, m: int, how: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens, qs = draw_siblings(q, m, how, gen)
    pp = p.expand(TRIALS, -1).clone()
    u = torch.rand(TRIALS, m, generator=gen)
    which, resid = accept_siblings(pp, tokens, qs, torch.ones(TRIALS, m, dtype=torch.bool), u)
    fallback = torch.multinomial(resid, 1, generator=gen).squeeze(1)
    return torch.where(which >= 0, tokens.gather(1, which.clamp(min=0)[:, None]).squeeze(1), fallback)


def random_pq(seed: int, v: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(v, generator=gen) ** 2
    q = torch.rand(v, generator=gen) ** 2
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("how", ["with", "without", "topk"])
@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_sibling_rejection_emits_the_target_distribution(how, m, seed):
    p, q = random_pq(seed)
    assert total_variation(emitted(p, q, m, how, seed), p) < TV_BOUND


@pytest.mark.parametrize("how", ["with", "without", "topk"])
def test_broken_residual_is_detected(monkeypatch, how):
    """The check above has teeth: keeping p after a rejection (no residual) skews the output."""
    p, q = random_pq(0)
    monkeypatch.setattr(tree_mod, "residual", lambda p, q: p)
    assert total_variation(emitted(p, q, 3, how, 0), p) > 3 * TV_BOUND


def test_tree_sampling_first_token_follows_target():
    """A depth-2 tree (3 children of the root, 2 under the first): the first emitted token ~ p[root]
    and the second, given the first was the first child's token, ~ p[that child]."""
    v, rows = 5, TRIALS
    gen = torch.Generator().manual_seed(3)
    p = torch.rand(1, 6, v, generator=gen) ** 2
    p = (p / p.sum(-1, keepdim=True)).expand(rows, -1, -1)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1]]).expand(rows, -1)
    tokens = torch.tensor([[0, 4, 1, 2, 2, 0]]).expand(rows, -1)  # node 1: p[root]'s likeliest
    depth = torch.tensor([[0, 1, 1, 1, 2, 2]]).expand(rows, -1)
    tree = DraftTree(tokens, parents, depth, ancestor_bits(parents, 2))
    verdict = accept_tree_sampled(tree, p, None, gen)
    first = torch.where(verdict.accepted >= 1, tokens.gather(1, verdict.path[:, 1:2]).squeeze(1), verdict.bonus)
    assert total_variation(first, p[0, 0]) < TV_BOUND
    via = (verdict.accepted >= 1) & (verdict.path[:, 1] == 1)
    assert int(via.sum()) > TRIALS // 2
    second = torch.where(verdict.accepted >= 2, tokens.gather(1, verdict.path[:, 2:3]).squeeze(1), verdict.bonus)
    assert total_variation(second[via], p[0, 1]) < 0.02


def test_select_tree_cuts_by_score_and_keeps_ancestors():
    # candidates: depth 1: a(-0.1) b(-1.0); depth 2 under a: c(-0.3) d(-2.0); under b: e(-1.1)
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    parents = torch.tensor([[-1, -1, 0, 0, 1]])
    depth = torch.tensor([[1, 1, 2, 2, 2]])
    scores = torch.tensor([[-0.1, -1.0, -0.3, -2.0, -1.1]])
    tree = select_tree(torch.tensor([7]), tokens, parents, depth, scores, budget=3)
    assert tree.tokens.tolist() == [[7, 10, 11, 12]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1]]
    assert tree.depth.tolist() == [[0, 1, 1, 2]]
    assert tree.ancestors.tolist() == [[0b1, 0b11, 0b101, 0b1011]]


def test_walk_follows_the_targets_choice():
    tokens = torch.tensor([[7, 10, 11, 12, 13], [7, 10, 11, 12, 13]])
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * 2)
    depth = torch.tensor([[0, 1, 1, 2, 2]] * 2)
    tree = DraftTree(tokens, parents, depth, ancestor_bits(parents, 2))
    # row 0: root -> 11 (node 2) -> 13 (node 4) -> bonus 50; row 1: root's choice 99 matches nothing
    choice = torch.tensor([[11, 0, 13, 0, 50], [99, 0, 0, 0, 0]])
    v = walk(tree, choice)
    assert v.accepted.tolist() == [2, 0]
    assert v.path[0].tolist() == [0, 2, 4]
    assert v.bonus.tolist() == [50, 99]


def test_parse_tree_shape_names_the_field():
    assert parse_tree_shape("topk=2,budget=8,depth=4") == TreeShape(2, 8, 4)
    for bad, field in [("topk=0", "topk"), ("budget=64", "budget"), ("depth=x", "depth"), ("width=3", "width")]:
        with pytest.raises(InvalidRequest, match=field):
            parse_tree_shape(bad)
    with pytest.raises(InvalidRequest, match="candidates"):
        parse_tree_shape("topk=1,depth=2,budget=5")

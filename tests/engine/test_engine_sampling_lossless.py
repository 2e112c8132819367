"""Speculative sampling must leave the target's distribution unchanged (lossless)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine_helpers import make_engine
from verifypd.engine.types import RequestSpec, SamplingParams
from verifypd.model import sampler


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square of observed counts against probs, pooling cells with small expectation."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


def test_accept_sampled_reproduces_target_distribution():
    """Kernel level: first emitted token over many seeds ~ p, for q far from p."""
    torch.manual_seed(0)
    V, K, R = 12, 3, 40000
    p_row = torch.softmax(torch.randn(V) * 1.5, -1)
    q_row = torch.softmax(torch.randn(V) * 1.5, -1)
    seeds = torch.arange(R, dtype=torch.long)
    start = torch.full((R,), 10, dtype=torch.long)
    u = sampler.uniforms(seeds, start + 1, sampler.STREAM_DRAFT)
    d0 = sampler.sample(q_row.expand(R, V), u)
    drafts = torch.stack([d0] + [torch.zeros_like(d0)] * (K - 1), 1)
    p = p_row.expand(R, K + 1, V).contiguous()
    q = q_row.expand(R, K, V).contiguous()
    accepted, final = sampler.accept_sampled(p, q, drafts, torch.ones(R, dtype=torch.long), seeds, start)
    first = torch.where(accepted > 0, drafts[:, 0], final)
    counts = np.bincount(first.numpy(), minlength=V)
    assert chi_square_pvalue(counts, p_row.numpy()) > 1e-3
    # Power check: the same counts are clearly not q, so a broken accept rule would fail.
    assert chi_square_pvalue(counts, q_row.numpy()) < 1e-6
    assert 0 < accepted.float().mean() < 1


def test_uniforms_are_uniform_and_deterministic():
    seeds = torch.arange(50000, dtype=torch.long)
    pos = torch.full_like(seeds, 3)
    u = sampler.uniforms(seeds, pos, 1)
    assert torch.equal(u, sampler.uniforms(seeds, pos, 1))
    assert not torch.equal(u, sampler.uniforms(seeds, pos, 2))
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3


def test_top_k_top_p_truncation():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)
    p = sampler.probabilities(logits, one, torch.tensor([2]), one)
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = sampler.probabilities(logits, one, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = sampler.probabilities(logits, torch.zeros(1), torch.tensor([0]), one)
    assert p.tolist() == [[1.0, 0, 0, 0]]


@pytest.mark.parametrize("k", [1, 4])
def test_engine_first_speculative_token_matches_target_softmax(tiny_models, hf_target, k):
    """End to end: with draft != target, the first token produced by a verify step (the 2nd output
    token; the 1st comes from prefill) follows the target's marginal
    P(t2) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1), and clearly not the draft's."""
    engine = make_engine(*tiny_models, k=k, num_blocks=4096, block_size=4)
    prompt = (5, 17, 33)
    temperature = 1.5
    n = 3000
    seconds = sample_second_tokens(engine, prompt, temperature, n, k + 2, 1000, hf_target.config.vocab_size)
    target_p = _second_token_marginal(hf_target, prompt, temperature)
    draft_p = _second_token_marginal(_load(tiny_models[1]), prompt, temperature)
    assert chi_square_pvalue(seconds, target_p) > 1e-3
    assert chi_square_pvalue(seconds, draft_p) < 1e-3, "test has no power: draft and target agree"


def sample_second_tokens(engine, prompt, temperature: float, n: int, max_tokens: int, seed0: int,
                         vocab: int) -> np.ndarray:
    """Counts of the 2nd output token (the first a verify step produces) over n seeded requests;
    checks the run saw both accepted and rejected drafts."""
    specs = [RequestSpec(prompt, max_tokens=max_tokens, stop_at_eos=False, request_id=f"s{i}",
                         sampling=SamplingParams(temperature=temperature, seed=seed0 + i)) for i in range(n)]
    done = engine.generate(specs)
    drafted = sum(c.usage["draft_tokens"] for c in done.values())
    accepted = sum(c.usage["accepted_tokens"] for c in done.values())
    assert 0 < accepted < drafted
    return np.bincount([c.token_ids[1] for c in done.values()], minlength=vocab)


def _load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _second_token_marginal(model, prompt, temperature) -> np.ndarray:
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([list(prompt)])).logits[0, -1].double() / temperature, -1)
        vocab = p1.numel()
        batch = torch.tensor([list(prompt) + [t] for t in range(vocab)])
        p2 = torch.softmax(model(batch).logits[:, -1].double() / temperature, -1)  # [V(t1), V(t2)]
    return (p1[:, None] * p2).sum(0).numpy()


def test_same_seed_same_output_any_batch(tiny_models):
    """Counter-based randomness: a seeded request gives the same tokens alone or in a crowd."""
    engine = make_engine(*tiny_models, k=3)
    spec = RequestSpec((9, 8, 7), max_tokens=16, stop_at_eos=False, request_id="x",
                       sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=42))
    alone = engine.generate([spec])["x"].token_ids
    crowd = [RequestSpec((i + 3, 4), max_tokens=16, stop_at_eos=False, request_id=f"c{i}",
                         sampling=SamplingParams(temperature=0.7, seed=i)) for i in range(6)]
    together = engine.generate(crowd[:3] + [spec] + crowd[3:])["x"].token_ids
    assert alone == together and len(alone) == 16

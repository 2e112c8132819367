"""Speculative sampling must leave the target's distribution unchanged (lossless). The scheme is
coupled ("Gumbel") speculative sampling, `verifypd.model.sampler`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_cases import _second_token_marginal, chi_square_pvalue, sample_second_tokens
from engine_helpers import make_engine
from scipy import stats

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.model import sampler


def test_race_samples_the_distribution_and_never_a_zero_probability_token():
    """The seeded choice alone (plain sampling): over many seeds it follows p exactly."""
    torch.manual_seed(0)
    V, R = 12, 40000
    p_row = torch.softmax(torch.randn(V) * 1.5, -1)
    p_row[3] = 0.0
    p_row /= p_row.sum()
    seeds = torch.arange(R, dtype=torch.long) * 7919 - 2**40  # negative bit patterns: seeds >= 2^63
    tokens = sampler.race(p_row.expand(R, V), seeds, torch.full((R,), 5, dtype=torch.long))
    counts = np.bincount(tokens.numpy(), minlength=V)
    assert counts[3] == 0 and chi_square_pvalue(counts, p_row.numpy()) > 1e-3
    # Power check: a slightly different distribution is clearly refused.
    other = (p_row + 0.01) / (p_row + 0.01).sum()
    assert chi_square_pvalue(counts, other.numpy()) < 1e-6


def coupling_probability(p: np.ndarray, q: np.ndarray) -> float:
    """P(the races of p and q over the same exponentials pick the same token): token v wins both iff
    E_u > E_v max(p_u / p_v, q_u / q_v) for all u != v; integrating over E_v ~ Exp(1) gives
    1 / (1 + sum_u!=v max(p_u / p_v, q_u / q_v))."""
    total = 0.0
    for v in range(len(p)):
        ratios = np.maximum(p / p[v], q / q[v])
        total += 1.0 / (1.0 + ratios.sum() - 1.0)
    return total


def test_coupled_acceptance_is_lossless_and_keeps_as_many_drafts_as_the_race_coupling_predicts():
    """Kernel level: a sampled draft proposes its race winner for the same (seed, position); the
    first emitted token follows p (not q), equals plain seeded sampling token for token, and the
    draft is kept with the coupling's probability (far more often than an independent draft's)."""
    torch.manual_seed(0)
    V, K, R = 12, 3, 40000
    p_row = torch.softmax(torch.randn(V, dtype=torch.float64) * 1.5, -1).float()
    q_row = torch.softmax(torch.randn(V, dtype=torch.float64) * 1.5, -1).float()
    seeds = torch.arange(R, dtype=torch.long)
    start = torch.full((R,), 10, dtype=torch.long)
    d0 = sampler.race(q_row.expand(R, V), seeds, start + 1)
    drafts = torch.stack([d0] + [torch.zeros_like(d0)] * (K - 1), 1)
    p = p_row.expand(R, K + 1, V).contiguous()
    accepted, final = sampler.accept_raced(p, drafts, torch.ones(R, dtype=torch.long), seeds, start)
    first = torch.where(accepted > 0, drafts[:, 0], final)
    assert torch.equal(first, sampler.race(p_row.expand(R, V), seeds, start + 1))  # = no draft at all
    counts = np.bincount(first.numpy(), minlength=V)
    assert chi_square_pvalue(counts, p_row.numpy()) > 1e-3
    assert chi_square_pvalue(counts, q_row.numpy()) < 1e-6  # power: the counts are clearly not q
    pn, qn = p_row.double().numpy(), q_row.double().numpy()
    expected = coupling_probability(pn, qn)
    tv = 0.5 * np.abs(pn - qn).sum()
    assert expected >= (1 - tv) / (1 + tv) - 1e-12 and expected > (pn * qn).sum() + 0.1
    rate = accepted.double().mean().item()
    assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / R), (rate, expected)


def test_accept_raced_counts_a_prefix_and_emits_the_bonus():
    """k drafts all equal to the target's winners: all kept and the bonus is position k+1's winner;
    a mismatch at i keeps i and emits the winner there; rows past k are ignored."""
    V, K = 20, 3
    p = torch.softmax(torch.randn(2, K + 1, V), -1)
    seeds, start = torch.tensor([11, 12]), torch.tensor([4, 9])
    pos = start[:, None] + 1 + torch.arange(K + 1)[None, :]
    winners = sampler.race(p.reshape(-1, V), seeds.repeat_interleave(K + 1), pos.reshape(-1)).view(2, K + 1)
    drafts = winners[:, :K].clone()
    drafts[1, 1] = (winners[1, 1] + 1) % V
    accepted, final = sampler.accept_raced(p, drafts, torch.tensor([3, 3]), seeds, start)
    assert accepted.tolist() == [3, 1] and final.tolist() == [winners[0, 3].item(), winners[1, 1].item()]
    accepted, final = sampler.accept_raced(p, drafts, torch.tensor([2, 1]), seeds, start)
    assert accepted.tolist() == [2, 1] and final.tolist() == [winners[0, 2].item(), winners[1, 1].item()]


def test_race_in_chunks_equals_one_piece(monkeypatch):
    probs = torch.softmax(torch.randn(10, 50), -1)
    seeds, pos = torch.arange(10) - 3, torch.arange(10) * 2
    whole = sampler.race(probs, seeds, pos)
    monkeypatch.setattr(sampler, "RACE_CHUNK_ELEMENTS", 150)  # 3 rows per chunk: 4 chunks
    assert torch.equal(sampler.race(probs, seeds, pos), whole)


def test_race_randomness_is_per_seed_position_and_token_and_batch_independent():
    seeds = torch.tensor([1, 1, 2, -5])
    pos = torch.tensor([7, 8, 7, 7])
    u = sampler.race_log_uniforms(seeds, pos, 64).exp()
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert len({tuple(r) for r in u.tolist()}) == 4  # each (seed, position) its own row
    for n in range(4):  # a row alone is the same row in the batch
        assert torch.equal(sampler.race_log_uniforms(seeds[n : n + 1], pos[n : n + 1], 64)[0].exp(), u[n])
    many = sampler.race_log_uniforms(torch.arange(200), torch.zeros(200, dtype=torch.long), 500).exp()
    assert stats.kstest(many.flatten().numpy(), "uniform").pvalue > 1e-3
    # Neighbouring tokens, positions and seeds are not correlated.
    assert abs(np.corrcoef(many[:, :-1].flatten(), many[:, 1:].flatten())[0, 1]) < 0.02
    assert abs(np.corrcoef(many[:-1].flatten(), many[1:].flatten())[0, 1]) < 0.02


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


@pytest.mark.slow
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


def _load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.slow
def test_same_seed_same_output_any_batch(tiny_models):
    """Counter-based randomness: a seeded request gives the same tokens alone or in a crowd."""
    engine = make_engine(*tiny_models, k=3)
    spec = RequestSpec(
        (9, 8, 7),
        max_tokens=16,
        stop_at_eos=False,
        request_id="x",
        sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=42),
    )
    alone = engine.generate([spec])["x"].token_ids
    crowd = [
        RequestSpec(
            (i + 3, 4),
            max_tokens=16,
            stop_at_eos=False,
            request_id=f"c{i}",
            sampling=SamplingParams(temperature=0.7, seed=i),
        )
        for i in range(6)
    ]
    together = engine.generate(crowd[:3] + [spec] + crowd[3:])["x"].token_ids
    assert alone == together and len(alone) == 16

"""The seeded race on CUDA (skipped without a GPU): the same integer randomness as on the CPU, the
same choices, and capturable in a CUDA graph (the draft loop replays it) with no host sync."""

from __future__ import annotations

import pytest
import torch

from verifypd.model import sampler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def inputs(rows: int = 64, vocab: int = 32000):
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, -1)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    positions = torch.randint(0, 100_000, (rows,), generator=gen)
    return probs, seeds, positions


def test_race_on_cuda_equals_the_cpu():
    probs, seeds, positions = inputs()
    cpu_u = sampler.race_log_uniforms(seeds, positions, probs.shape[1])
    gpu_u = sampler.race_log_uniforms(seeds.cuda(), positions.cuda(), probs.shape[1]).cpu()
    # The integer draws are the same on both devices; log (and exp, to look at them) may differ by
    # an ulp, which at 2^24 scale moves a value by up to 1 (seen on an H100 and an H200).
    assert (cpu_u.exp().mul(2**24) - gpu_u.exp().mul(2**24)).abs().max() <= 1.0
    assert torch.allclose(cpu_u, gpu_u, rtol=1e-6, atol=0)
    assert torch.equal(
        sampler.race(probs, seeds, positions), sampler.race(probs.cuda(), seeds.cuda(), positions.cuda()).cpu()
    )


def test_race_in_a_cuda_graph_follows_its_inputs():
    probs, seeds, positions = inputs()
    p, s, pos = probs.cuda(), seeds.cuda(), positions.cuda()
    out = torch.empty(len(seeds), dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as torch recommends
        out.copy_(sampler.race(p, s, pos))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(sampler.race(p, s, pos))
    for shift in (0, 1, 17):
        s.copy_(seeds.cuda() + shift)
        pos.copy_(positions.cuda() + shift)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), sampler.race(probs, seeds + shift, positions + shift))

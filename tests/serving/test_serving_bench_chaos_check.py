"""bench/chaos_check.py: an output that differs from the chaos reference is "numerical" only when every
token from the divergence on is a near-tie of the float32 batch-1 choice; a flipped token at a clear
margin is "wrong", also when it reaches the benchmark's client through a (fake) server."""

from __future__ import annotations

import pathlib
import sys
import time
from concurrent import futures

import grpc
import pytest
import torch

from verifypd.domain.convert import sampling_from_pb
from verifypd.domain.requests import SamplingParams
from verifypd.model import sampler
from verifypd.v1 import generate_pb2, generate_pb2_grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import chaos
import chaos_check

pytestmark = pytest.mark.slow  # loads a model and decodes token by token, ~20 s (tests/README.md)

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
EPS = 1e-4


@pytest.fixture(scope="module")
def rescorer(tmp_path_factory):
    path = chaos.write_tiny_model(tmp_path_factory.mktemp("chaos") / "target", seed=1)
    return chaos_check.Rescorer(path, "cpu", "auto", 512)


def decode(rescorer, prompt: list[int], n: int, sampling: SamplingParams, flip_at: int | None = None) -> list[int]:
    """n tokens chosen by the engine's own `sampler.choose` on float32 batch-1 logits; at `flip_at` the
    runner-up is emitted instead (a corrupted token), and decoding goes on from the corrupted prefix."""
    out: list[int] = []
    params = sampler.params_tensor([sampling], "cpu")
    mode = sampler.choice_mode([sampling])
    for t in range(n):
        logits = rescorer.logits(prompt + out)[-1:]
        position = torch.tensor([len(prompt) + t])
        token = int(sampler.choose(logits, mode, *params, position)[0])
        if t == flip_at:
            scores, robust, _ = chaos_check.choice_scores(logits, sampling, position, EPS)
            ranked = scores.masked_fill(~robust, -float("inf")).topk(2, dim=-1)
            assert int(ranked.indices[0, 0]) == token
            token = int(ranked.indices[0, 1])
        out.append(token)
    return out


def clear_position(rescorer, prompt, output, sampling) -> int:
    """A position whose top-2 margin is far above any tie tolerance."""
    for t in range(2, len(output)):
        row = chaos_check.check_output(rescorer, prompt, output, sampling, t, EPS, 2.0)
        if row["top2_margin"] > 0.5:
            return t
    raise AssertionError("no clearly separated position")


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_flipped_token_is_wrong_and_a_clean_output_is_not(rescorer, sampling):
    prompt = [5, 17, 40, 8, 9, 60, 33, 101]
    clean = decode(rescorer, prompt, 16, sampling)
    row = chaos_check.check_output(rescorer, prompt, clean, sampling, 0, EPS, 2.0)
    assert row["class"] == "numerical" and row["unexplained_positions"] == [] and row["gap"] == 0.0

    t = clear_position(rescorer, prompt, clean, sampling)
    corrupted = decode(rescorer, prompt, 16, sampling, flip_at=t)
    assert chaos_check.first_divergence(corrupted, clean) == t
    row = chaos_check.check_output(rescorer, prompt, corrupted, sampling, t, EPS, 2.0)
    # Only the flipped token is unexplained: what follows is a valid choice after the corrupted prefix.
    assert row["class"] == "wrong" and row["unexplained_positions"] == [t], row
    assert row["gap"] == pytest.approx(row["top2_margin"], rel=1e-5)
    # The same flip inside the tie tolerance is numerical: the class follows the margin.
    loose = chaos_check.check_output(rescorer, prompt, corrupted, sampling, t, row["gap"] * 1.01, 2.0)
    assert loose["class"] == "numerical"


def test_corruption_after_a_near_tie_is_still_wrong(rescorer):
    """A first divergence inside the tolerance does not excuse a clear flip later in the output."""
    prompt = [9, 9, 31, 200, 7]
    clean = decode(rescorer, prompt, 16, GREEDY)
    t = clear_position(rescorer, prompt, clean, GREEDY)
    corrupted = decode(rescorer, prompt, 16, GREEDY, flip_at=t)
    margin = chaos_check.check_output(rescorer, prompt, corrupted, GREEDY, t, EPS, 2.0)["gap"]
    tied = chaos_check.check_output(rescorer, prompt, corrupted, GREEDY, t - 1, margin * 0.5, 2.0)
    assert tied["class"] == "wrong" and tied["unexplained_positions"] == [t]


class FlippingServer(generate_pb2_grpc.GenerationServicer):
    """Answers each prompt with its given output (streamed in two chunks)."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]]):
        self.outputs = outputs

    def Generate(self, request, context):
        ids = self.outputs[tuple(request.token_ids.ids)]
        yield generate_pb2.GenerateResponse(token_ids=ids[:5])
        yield generate_pb2.GenerateResponse(token_ids=ids[5:])


def test_fake_server_flipping_one_token_is_counted_wrong(rescorer):
    reqs = chaos.requests_set(4, seed=3, max_tokens=12)
    prompts = [list(r.token_ids.ids) for r in reqs]
    samplings = [sampling_from_pb(r.sampling) for r in reqs]
    reference = [decode(rescorer, p, 12, s) for p, s in zip(prompts, samplings)]
    served = {tuple(p): list(r) for p, r in zip(prompts, reference)}
    flip = clear_position(rescorer, prompts[1], reference[1], samplings[1])  # request 1: sampled
    served[tuple(prompts[1])] = decode(rescorer, prompts[1], 12, samplings[1], flip_at=flip)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    generate_pb2_grpc.add_GenerationServicer_to_server(FlippingServer(served), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        load = chaos.Load(f"127.0.0.1:{port}", reqs, reference, concurrency=2)
        for th in load.threads:
            th.start()
        time.sleep(1.0)
        load.stop.set()
        for th in load.threads:
            th.join(30)
    finally:
        server.stop(0)
    assert load.lost == [] and load.ok >= 8
    during = load.completions[len(load.completions) // 2]
    windows = [chaos_check.FaultWindow("kill", "verify", during.start, during.start)]
    result = chaos_check.classify(rescorer, prompts, samplings, reference, load.completions, windows, EPS, 2.0)
    flipped = [c for c in load.completions if c.index == 1]
    assert result["wrong"] == len(flipped) == result["differ"] and result["numerical"] == 0
    (row,) = result["outputs"]
    assert (row["request"], row["first_divergence"], row["class"]) == (1, flip, "wrong")
    through = sum(c.start <= during.start <= c.end for c in flipped)
    assert result["by_class_and_fault"].get("wrong_through_lane_fault", 0) == through
    assert result["by_class_and_fault"].get("wrong_no_lane_fault", 0) == len(flipped) - through


def test_first_divergence_and_faults_during():
    assert chaos_check.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert chaos_check.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert chaos_check.first_divergence([1, 2], [1, 2, 3]) == 2
    c = chaos_check.Completion(0, 10.0, 20.0, [])
    windows = [
        chaos_check.FaultWindow("kill", "draft", 15.0, 15.0),
        chaos_check.FaultWindow("stop", "verify", 0.0, 9.9),
        chaos_check.FaultWindow("flood", None, 19.0, 30.0),
    ]
    assert chaos_check.faults_during(c, windows) == ["kill:draft", "flood"]

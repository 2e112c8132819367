"""Correctness at the edges: tiny temperatures, NaN distributions, stop-string bounds, and
garbage in KV slots no request has written."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import VOCAB, make_engine

from verifypd.domain.requests import MAX_STOP_CHARS, MAX_STOP_STRINGS, InvalidRequest, RequestSpec, SamplingParams
from verifypd.model import sampler


def test_tiny_temperatures_are_greedy_not_nan():
    logits = torch.randn(4, VOCAB)
    temp = torch.tensor([1e-45, 1e-30, 1e-6, 0.0])  # 1e-45 is a float32 denormal
    probs = sampler.probabilities(logits, temp, torch.zeros(4, dtype=torch.long), torch.ones(4))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.max(-1).values, torch.ones(4))
    assert SamplingParams(temperature=1e-45).greedy and not SamplingParams(temperature=0.5).greedy


def test_sampler_never_emits_from_a_nan_distribution():
    probs = torch.full((3, VOCAB), 1.0 / VOCAB)
    probs[1, 3] = float("nan")
    probs[2] = 0.0
    tokens = sampler.race(probs, torch.tensor([1, 2, 3]), torch.tensor([4, 4, 4]))
    assert tokens[0] != sampler.NO_TOKEN and tokens[1:].tolist() == [sampler.NO_TOKEN] * 2


def test_router_refuses_a_token_outside_the_vocabulary(tiny_models):
    """A lane fault (a NaN distribution) reaches no client as a token."""
    for overlap in (False, True):  # plain steps call verify_start when overlapped (engine.overlap)
        engine = make_engine(*tiny_models, k=0)
        engine.router.config = engine.router.config.updated(overlap=overlap)
        lane = engine.router.verify_lane
        real = lane.verify_start

        def faulty(items, real=real, **kw):
            started = real(items, **kw)
            started.result = lambda: [
                type(o)(o.request_id, o.accepted, [sampler.NO_TOKEN]) for o in type(started).result(started)
            ]
            return started

        lane.verify_start = faulty
        lane.verify = lambda items, faulty=faulty: faulty(items).result()
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            engine.generate([RequestSpec((5, 6), max_tokens=4, stop_at_eos=False)])


def test_denormal_temperature_request_gives_the_greedy_output(tiny_models):
    engine = make_engine(*tiny_models, k=4)
    prompt = (5, 6, 7, 8)
    tiny = RequestSpec(
        prompt, max_tokens=16, stop_at_eos=False, request_id="tiny", sampling=SamplingParams(temperature=1e-45, seed=3)
    )
    greedy = RequestSpec(prompt, max_tokens=16, stop_at_eos=False, request_id="greedy")
    done = engine.generate([tiny, greedy])
    assert done["tiny"].token_ids == done["greedy"].token_ids
    assert done["tiny"].token_ids != [VOCAB - 1] * 16  # what the NaN softmax used to give


def test_stop_strings_are_bounded_in_number_and_length():
    RequestSpec((5,), stop=("x",) * MAX_STOP_STRINGS).validate(vocab_size=VOCAB, max_context=64)
    with pytest.raises(InvalidRequest, match=f"stop: {MAX_STOP_STRINGS + 1} strings"):
        RequestSpec((5,), stop=("x",) * (MAX_STOP_STRINGS + 1)).validate(vocab_size=VOCAB, max_context=64)
    with pytest.raises(InvalidRequest, match=r"stop\[1\]"):
        RequestSpec((5,), stop=("x", "y" * (MAX_STOP_CHARS + 1))).validate(vocab_size=VOCAB, max_context=64)


def test_nan_in_unwritten_kv_slots_does_not_change_outputs(tiny_models):
    """Masked attention must be exact whatever garbage unwritten slots hold (the fix is in the
    attention rewrite of verifypd/model/; this test pins it)."""
    specs = [RequestSpec((5 + n, 6, 7), max_tokens=12, stop_at_eos=False, request_id=f"r{n}") for n in range(3)]
    clean = make_engine(*tiny_models, k=4).generate(specs)
    dirty = make_engine(*tiny_models, k=4)
    for runner in (dirty.verify_lane.target, dirty.draft_lane.runner):
        runner.pool.tensor.fill_(float("nan"))  # every slot no request has written yet
    done = dirty.generate(specs)
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in clean.items()}

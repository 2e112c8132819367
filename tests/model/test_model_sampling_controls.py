"""Sampling controls and logprobs through the engine: every control, greedy and seeded, gives plain
decoding's tokens (--draft none) with a draft model, self:N, prompt lookup and an EAGLE head, in one
batch beside plain requests; logprobs equal plain decoding's within float32 rounding (verify calls
of other shapes round the logits differently; the chosen and top token ids are equal)."""

from __future__ import annotations

import math

import pytest
from engine_cases import crowd, write_head
from engine_helpers import make_engine

from verifypd.domain.requests import FinishReason, InvalidRequest, RequestSpec, SamplingParams

PROMPTS = [(5, 6, 7, 5, 6, 7, 5, 6), (40, 41, 9, 40, 41, 9, 40), (11, 12, 13, 11, 12, 13)]
CONTROLS = {
    "rep": dict(repetition_penalty=3.0),
    "freq": dict(frequency_penalty=1.5, presence_penalty=0.5),
    "neg": dict(presence_penalty=-2.0, repetition_penalty=0.6),
    "bias": dict(logit_bias=((7, 5.0), (9, -100.0), (12, 3.0))),
    "min": dict(min_tokens=5, stop_token_ids=(7, 12, 41)),
    "lp": dict(logprobs=True, top_logprobs=4),
    "all": dict(frequency_penalty=0.7, min_tokens=2, logit_bias=((20, 2.0),), logprobs=True, top_logprobs=2),
}


def subjects() -> list[RequestSpec]:
    out = []
    for name, controls in CONTROLS.items():
        for mode, base in (("g", {}), ("s", {"temperature": 0.8, "seed": 31})):
            for n, prompt in enumerate(PROMPTS):
                out.append(
                    RequestSpec(
                        prompt,
                        max_tokens=18,
                        stop_at_eos=False,
                        request_id=f"{name}-{mode}-{n}",
                        sampling=SamplingParams(**base, **controls),
                    )
                )
    return out


def run(engine, specs):
    tokens, logprobs, finish, drafted = {}, {}, {}, {}
    router = engine.router
    for spec in specs:
        router.add_request(spec)
    while router.has_work():
        for out in router.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.logprobs)
            if out.finished:
                finish[out.request_id] = out.finish_reason
                drafted[out.request_id] = out.stats.accepted_tokens
    assert router.target_blocks.num_used == 0
    return tokens, logprobs, finish, drafted


@pytest.fixture(scope="module")
def reference(tiny_models):
    return run(make_engine(tiny_models[0], "none", k=0), subjects())


def test_controls_change_the_output(tiny_models, reference):
    tokens, _, finish, _ = reference
    plain, _, _, _ = run(
        make_engine(tiny_models[0], "none", k=0),
        [
            RequestSpec(
                s.prompt_ids,
                18,
                SamplingParams(s.sampling.temperature, seed=s.sampling.seed),
                stop_at_eos=False,
                request_id=s.request_id,
            )
            for s in subjects()
        ],
    )
    for name in CONTROLS:
        if name != "lp":  # each control changes some output of its six requests
            assert any(tokens[rid] != plain[rid] for rid in tokens if rid.startswith(name + "-")), name
    assert all(t == plain[rid] for rid, t in tokens.items() if rid.startswith("lp-"))
    assert any(finish[rid] is FinishReason.STOP for rid in finish if rid.startswith("min-"))
    for rid, t in tokens.items():
        if rid.startswith("min-"):
            assert not set(t[:5]) & {7, 12, 41} and (finish[rid] is not FinishReason.STOP or t[-1] in (7, 12, 41))
        if rid.startswith("bias-"):
            assert 9 not in t


@pytest.mark.parametrize("draft", ["model", "self:2", "ngram", "eagle"])
def test_controls_and_logprobs_are_exact_through_speculation(tiny_models, reference, tmp_path, draft):
    name = {"model": tiny_models[1], "eagle": None}.get(draft, draft)
    if draft == "eagle":
        name = write_head(tiny_models, tmp_path / "head")
    specs = subjects() + crowd(6)  # plain requests beside them in the batches
    tokens, logprobs, finish, accepted = run(make_engine(tiny_models[0], name, k=4), specs)
    ref_tokens, ref_logprobs, ref_finish, _ = reference
    # speculation ran for the controlled requests: drafts were verified and kept
    assert sum(n for rid, n in accepted.items() if rid in ref_tokens) > 0
    for rid, expected in ref_tokens.items():
        assert tokens[rid] == expected, rid
        assert finish[rid] == ref_finish[rid]
    assert set(logprobs) == set(ref_logprobs) and logprobs
    for rid, expected in ref_logprobs.items():
        got = logprobs[rid]
        assert [lp.token_id for lp in got] == tokens[rid] == [lp.token_id for lp in expected]
        for a, b in zip(got, expected, strict=True):
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5), rid
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == len(b.top) > 0
            assert all(math.isclose(x, y, abs_tol=1e-5) for (_, x), (_, y) in zip(a.top, b.top, strict=True))


def test_bad_control_values_name_the_field(tiny_models):
    engine = make_engine(tiny_models[0], "ngram", k=2)
    for sampling, field in (
        (SamplingParams(logit_bias=((96, 1.0),)), "sampling.logit_bias"),
        (SamplingParams(stop_token_ids=(5, 1000)), "sampling.stop_token_ids[1]"),
        (SamplingParams(top_logprobs=21, logprobs=True), "top_logprobs"),
        (SamplingParams(frequency_penalty=2.5), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
    ):
        with pytest.raises(InvalidRequest, match=field.replace("[", r"\[")):
            engine.router.add_request(RequestSpec((5, 6), 4, sampling))
    assert not engine.router.has_work()

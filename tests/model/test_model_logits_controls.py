"""model.logits_controls: the controls at position p of a verify row equal the controls of plain
decoding with the drafts before p accepted (so speculation stays exact), each control does what
domain.sampling_controls says, and rows without controls are untouched bit for bit."""

from __future__ import annotations

import random

import torch

from verifypd.domain.requests import SamplingParams
from verifypd.domain.sampling_controls import ControlContext
from verifypd.model import logits_controls

V = 40


def context(s: SamplingParams, prompt: tuple[int, ...], output: tuple[int, ...], banned=(2, 7)) -> ControlContext:
    return ControlContext(
        generated=len(output),
        output_ids=output if s.penalized else (),
        prompt_ids=prompt if s.repetition_penalty != 1 else (),
        banned=banned if s.min_tokens > len(output) else (),
    )


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7]),
        seed=rng.randrange(100),
        presence_penalty=rng.choice([0.0, 0.8, -1.2]),
        frequency_penalty=rng.choice([0.0, 0.5, 1.7]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
        min_tokens=rng.choice([0, 3, 6]),
        logit_bias=tuple(sorted({rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randrange(3))}.items())),
    )


def test_each_verify_position_equals_plain_decoding_with_the_drafts_before_it_accepted():
    rng = random.Random(0)
    torch.manual_seed(0)
    R, P = 12, 5
    samplings = [random_params(rng) for _ in range(R)]
    prompts = [tuple(rng.randrange(V) for _ in range(rng.randrange(1, 8))) for _ in range(R)]
    outputs = [tuple(rng.randrange(V) for _ in range(rng.randrange(1, 6))) for _ in range(R)]
    drafts = torch.randint(0, 8, (R, P - 1))  # few distinct ids: repeats in the drafts
    logits = torch.randn(R, P, V) * 3
    contexts = [context(s, p, o) for s, p, o in zip(samplings, prompts, outputs, strict=True)]
    together = logits_controls.apply(logits, samplings, contexts, drafts)
    assert any(s.controlled for s in samplings) and not torch.equal(together, logits)
    for r in range(R):
        for p in range(P):  # plain decoding: one position, the accepted drafts in the history
            history = outputs[r] + tuple(drafts[r, :p].tolist())
            alone = logits_controls.apply(
                logits[r : r + 1, p : p + 1], [samplings[r]], [context(samplings[r], prompts[r], history)]
            )
            assert torch.equal(together[r, p], alone[0, 0]), (r, p, samplings[r])


def test_the_controls_follow_their_definitions():
    logits = torch.tensor([[[2.0, -1.0, 0.5, 3.0, -2.0]]])
    s = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = logits_controls.apply(logits, [s], [ControlContext(2, output_ids=(3, 3), prompt_ids=(0, 1))])
    # 0, 1: prompt only (repetition); 3: twice generated (repetition, then 2 x 0.5 + 0.25)
    assert out[0, 0].tolist() == [1.0, -2.0, 0.5, 1.5 - 1.25, -2.0]
    s = SamplingParams(min_tokens=3, logit_bias=((1, 4.0), (4, -100.0)))
    out = logits_controls.apply(logits.expand(1, 3, 5), [s], [ControlContext(1, banned=(2,))], torch.tensor([[0, 0]]))
    # output 1 and 2 (positions 0, 1) cannot be token 2; output 3 (position 2) may
    assert out[0, :, 2].tolist() == [float("-inf"), float("-inf"), 0.5]
    assert out[0, 2, 1].item() == 3.0 and out[0, 2, 4].item() == -102.0


def test_rows_without_controls_are_untouched_and_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(3, 2, V)
    samplings = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams(temperature=0.5)]
    contexts = [None, ControlContext(1, output_ids=(5,)), None]
    out = logits_controls.apply(logits, samplings, contexts, torch.tensor([[5], [5], [5]]))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2]) and not torch.equal(out[1], logits[1])
    tokens = logits_controls.choose(out, samplings, [4, 4, 4])
    table = logits_controls.logprob_table(logits, tokens, 3)
    logp = torch.log_softmax(logits, -1)
    assert torch.allclose(table[..., 0].float(), logp.gather(-1, tokens[..., None])[..., 0])
    assert torch.equal(table[..., 2].long(), logp.topk(3, -1).indices[..., 0])
    lps = logits_controls.logprobs_of(table[0].tolist(), tokens[0].tolist(), 3)
    assert [lp.token_id for lp in lps] == tokens[0].tolist() and len(lps[0].top) == 3

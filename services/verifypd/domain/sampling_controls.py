"""Sampling controls: what they mean, in which order they apply, and what a lane needs to apply them.
Torch-free (the device side is model.logits_controls).

Each control changes the target's logits at every position a verify step decides (the pending
token's and each draft's, k + 1 of them), from the tokens that would precede that position if the
drafts before it are accepted. The token chosen there is then exactly plain decoding's (the race of
model.sampler over the same processed distribution), so speculation stays lossless with controls on.
Order, as vLLM's sampler (for each position t, with `out` the generated tokens before t: the
committed ones, then the drafts before t):

  1. min_tokens:  while len(out) < min_tokens, EOS (unless the request ignores it) and every
                  stop_token_id get -inf.
  2. logit_bias:  logits[id] += bias (OpenAI: -100..100).
  3. repetition_penalty (HF / vLLM): for every token in prompt + out, a positive logit is divided
                  by it, a negative one multiplied.
  4. frequency_penalty, presence_penalty (OpenAI): logits[v] -= frequency * count_out(v)
                  + presence * (count_out(v) > 0), over generated tokens only.
  5. a structured-output mask (domain.grammar, model.token_mask.apply_masks at the lanes' mask
     seam; as -inf stays -inf under 1-4, masking before or after them is the same). Where 1 leaves
     the grammar no token (min_tokens holding back the EOS that a finished grammar requires), the
     grammar wins: that position is chosen from the raw logits under the mask (the output parses).
  6. temperature, top-k, top-p (model.sampler.probabilities), then the seeded race or argmax.

Logprobs are the *raw* model log-probabilities (log_softmax of the target's logits before 1-6), as
vLLM reports by default: they say what the model thinks, comparable across requests whatever their
controls; with speculation they equal plain decoding's because the verify pass computes the same
logits. stop_token_ids end the request like EOS (the token is in token_ids, not in the text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verifypd.domain.requests import RequestSpec

_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request asking for n > 1 (or best_of) samples of one prompt:
    sample 0 keeps the request's seed (so n = 1 is the plain request), sample i > 0 takes
    splitmix64(seed + i * 0x9E3779B97F4A7C15). Deterministic, and any sample can be reproduced
    alone by sending its seed with n = 1."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class ControlContext:
    """What a lane needs of a controlled request's history to process the logits of one call's
    positions; carried by PrefillItem / VerifyItem (None for requests without controls).

    `generated`: tokens generated before the call's first chosen position (a verify item's pending
    token included: it was generated; 0 for a prefill's first token). `output_ids` (when penalized)
    are those tokens, `prompt_ids` (when repetition_penalty != 1) the prompt; `banned` the ids
    masked while fewer than min_tokens are generated."""

    generated: int
    output_ids: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    banned: tuple[int, ...] = ()


def control_context(spec: RequestSpec, output_ids: Sequence[int], eos: frozenset[int]) -> ControlContext | None:
    """The ControlContext of a request that has generated `output_ids` so far; None when it has no
    control that reads history (logit_bias alone needs none, but takes the same path)."""
    s = spec.sampling
    if not s.controlled:
        return None
    banned: tuple[int, ...] = ()
    if s.min_tokens > len(output_ids):
        banned = tuple(sorted((set(eos) if spec.stop_at_eos else set()) | set(s.stop_token_ids)))
    return ControlContext(
        generated=len(output_ids),
        output_ids=tuple(output_ids) if s.penalized else (),
        prompt_ids=tuple(spec.prompt_ids) if s.repetition_penalty != 1 else (),
        banned=banned,
    )

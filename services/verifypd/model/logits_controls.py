"""Sampling controls on the device: penalties, min_tokens and logit_bias applied to the target's
logits at every position of a call, and the logprobs of the chosen tokens. Semantics, order and
why this keeps speculation lossless: domain.sampling_controls.

A call's logits are [R, P, V]: row r's positions are its pending token's (the choice of output
number `generated`) and its drafts' (P = k + 1 in a verify call; P = 1 for a prefill's first token).
Position p's history is the row's committed tokens plus drafts[r, :p]: counts are built on the
device from the committed ids (one scatter per call) plus a running count of the drafts (cumsum of
their one-hots). Everything is per-row tensors of the batch, with no host sync: the host only knows
which controls any row uses (so a batch without penalties pays no count tensor).

Cost: requests with controls or logprobs leave the fast paths (the graphed greedy verify, the
overlapped plain-decoding chains) for the eager score + choice path; their batch pays [R, P, V]
float32 temporaries (one or two per control kind used). Requests without them take the paths they
took before, unchanged (`SamplingParams.plain`). bench/sampling_controls.py measures both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verifypd.domain.requests import SamplingParams, TokenLogprob
from verifypd.domain.sampling_controls import ControlContext
from verifypd.model import sampler


def _rows_ids(device, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = sampler.small_tensor([r for r, _ in pairs], device)
    ids = sampler.small_tensor([t for _, t in pairs], device)
    return rows, ids


def apply(
    logits: torch.Tensor,
    samplings: Sequence[SamplingParams],
    contexts: Sequence[ControlContext | None],
    drafts: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [R, P, V] (any float dtype; not written) -> processed float32 logits [R, P, V].
    drafts [R, >= P - 1]: the tokens at positions 1 .. P - 1 of each row (None when P == 1).
    Rows without controls come back as their float32 logits, bit for bit. Steps 1-4 of
    domain.sampling_controls; a structured-output mask (step 5) is applied by the caller to the
    returned logits, before `choose` (LocalVerifyLane / LocalPrefillLane: "mask seam")."""
    R, P, V = logits.shape
    out = logits.float().clone()
    device = out.device
    ctrl = [(r, s, c) for r, (s, c) in enumerate(zip(samplings, contexts, strict=True)) if s.controlled]
    if not ctrl:
        return out
    # 1. min_tokens: position p of row r chooses output number generated + p.
    banned = [(r, t) for r, _, c in ctrl if c is not None for t in c.banned]
    if banned:
        mask = torch.zeros(R, V, dtype=torch.bool, device=device)
        mask[_rows_ids(device, banned)] = True
        limit = sampler.small_tensor(
            [s.min_tokens - c.generated if c else 0 for s, c in zip(samplings, contexts, strict=True)], device
        )
        early = torch.arange(P, device=device)[None, :] < limit[:, None]  # [R, P]
        out.masked_fill_(mask[:, None, :] & early[:, :, None], float("-inf"))
    # 2. logit_bias
    biased = [(r, t, b) for r, s, _ in ctrl for t, b in s.logit_bias]
    if biased:
        bias = torch.zeros(R, V, dtype=torch.float32, device=device)
        bias[_rows_ids(device, [(r, t) for r, t, _ in biased])] = sampler.small_tensor(
            [b for _, _, b in biased], device, torch.float32
        )
        out += bias[:, None, :]
    penalized = [(r, s, c) for r, s, c in ctrl if s.penalized]
    if not penalized:
        return out
    counts = _output_counts(R, P, V, penalized, drafts, device)  # [R, P, V] float32
    # 3. repetition_penalty over prompt + generated tokens (the drafts before p included)
    if any(s.repetition_penalty != 1 for _, s, _ in penalized):
        seen = counts > 0
        prompt = [(r, t) for r, s, c in penalized if s.repetition_penalty != 1 and c is not None for t in c.prompt_ids]
        if prompt:
            in_prompt = torch.zeros(R, V, dtype=torch.bool, device=device)
            in_prompt[_rows_ids(device, prompt)] = True
            seen |= in_prompt[:, None, :]
        rep = sampler.small_tensor([s.repetition_penalty for s in samplings], device, torch.float32)[:, None, None]
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    # 4. frequency / presence over generated tokens
    freq = sampler.small_tensor([s.frequency_penalty for s in samplings], device, torch.float32)[:, None, None]
    pres = sampler.small_tensor([s.presence_penalty for s in samplings], device, torch.float32)[:, None, None]
    out -= freq * counts + pres * (counts > 0).float()
    return out


def _output_counts(R: int, P: int, V: int, penalized, drafts: torch.Tensor | None, device) -> torch.Tensor:
    """[R, P, V] float32: how often each token was generated before position p of row r."""
    base = torch.zeros(R, V, dtype=torch.float32, device=device)
    pairs = [(r, t) for r, _, c in penalized if c is not None for t in c.output_ids]
    if pairs:
        rows, ids = _rows_ids(device, pairs)
        base.index_put_((rows, ids), torch.ones(len(pairs), device=device), accumulate=True)
    counts = base[:, None, :].expand(R, P, V)
    if P > 1:
        if drafts is None:
            raise ValueError(f"penalties over {P} positions need the drafts before them")
        seen = torch.nn.functional.one_hot(drafts[:, : P - 1].long(), V).float().cumsum(1)  # [R, P-1, V]
        counts = counts + torch.cat([torch.zeros(R, 1, V, device=device), seen], 1)
    return counts.contiguous()


def choose(processed: torch.Tensor, samplings: Sequence[SamplingParams], first_pos: Sequence[int]) -> torch.Tensor:
    """The target's choice at every position: processed [R, P, V] -> tokens [R, P]; position p of row
    r sits at first_pos[r] + p (the seeded race's counter, model.sampler). Greedy rows: argmax."""
    R, P, V = processed.shape
    device = processed.device
    mode = sampler.choice_mode(samplings)
    if mode == sampler.GREEDY:
        return processed.argmax(-1)
    temp, top_k, top_p, seeds = sampler.params_tensor(samplings, device)
    probs = sampler.probabilities(
        processed.reshape(R * P, V),
        temp.repeat_interleave(P),
        top_k.repeat_interleave(P),
        top_p.repeat_interleave(P),
        truncate=mode == sampler.SAMPLE_TRUNCATED,
    )
    positions = sampler.small_tensor(list(first_pos), device)[:, None] + torch.arange(P, device=device)[None, :]
    return sampler.race(probs, seeds.repeat_interleave(P), positions.reshape(-1)).view(R, P)


def logprob_table(raw: torch.Tensor, tokens: torch.Tensor, top_n: int) -> torch.Tensor:
    """raw logits [R, P, V], chosen tokens [R, P] -> float64 [R, P, 1 + 2 top_n]: the chosen token's
    log-probability, then the top_n best (log-probability, token id) pairs (ids exact in float64),
    one tensor so the host copy is one. Raw: log_softmax of the model's logits (module doc)."""
    logp = torch.log_softmax(raw.float(), -1)
    chosen = logp.gather(-1, tokens.clamp(min=0)[..., None].long())
    if top_n == 0:
        return chosen.double()
    top_vals, top_ids = logp.topk(top_n, -1)
    pairs = torch.stack([top_vals.double(), top_ids.double()], -1).flatten(-2)
    return torch.cat([chosen.double(), pairs], -1)


def logprobs_of(row: list[list[float]], tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """One row of a host logprob_table, for the tokens it emitted (positions 0 .. len(tokens) - 1)."""
    out = []
    for p, token in enumerate(tokens):
        cell = row[p]
        top = tuple((int(cell[1 + 2 * i + 1]), cell[1 + 2 * i]) for i in range(top_n))
        out.append(TokenLogprob(token, cell[0], top))
    return out

"""Committing lane results into a request's state: drafts taken, verdicts recorded, tokens appended.
Torch-free; the step context (verifypd.router.step_context) and the strategies call these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verifypd.domain.lanes import DraftOutput
from verifypd.domain.requests import FinishReason
from verifypd.router.draft_length import request_alpha, request_rate

# A request's drafts as its draft call left them: (DraftOutput.draft_tokens, DraftOutput.draft_probs).
Proposal = tuple[Sequence[int], Any]


def take_drafts(work: list, results: list[DraftOutput]) -> dict[str, Proposal]:
    """Draft outputs by request id (of `work`, DecodeWork items), with the draft-position
    bookkeeping of pool-less lanes."""
    drafts = {}
    for w, out in zip(work, results, strict=False):
        # draft_tokens may be a lazy device-backed sequence (in-process lanes): only its length
        # is read here; the verify lane consumes the values on the device.
        drafts[out.request_id] = (out.draft_tokens, out.draft_probs)
        if out.resync_from is not None:  # a pool-less lane lost this request's history
            w.seq.draft_computed = min(w.seq.draft_computed, out.resync_from)
        elif len(out.draft_tokens) == 0:  # it took the inputs (up to the pending token), proposed none
            w.seq.draft_computed = w.seq.pending_pos + 1
    return drafts


def record_verdict(seq, acceptance, k: int, accepted: int, asked: int, prior: float | None) -> float | None:
    """One verify step's outcome in the request's stats and the draft policy's estimates (`acceptance`:
    the engine-wide AcceptanceTracker); `asked`: the k the request was asked to draft, `k` the drafts
    it verified. `prior`: `acceptance.alpha` before this outcome; returns it after (a step's rows are
    committed in a row: a plain row changes no estimate, and reading it per row cost the host ~2 us
    a request-step on the GPU)."""
    seq.stats.draft_tokens += k
    seq.stats.accepted_tokens += accepted
    seq.stats.verify_steps += 1
    if k > 0:
        seq.draft_rejections += accepted < k
        acceptance.observe(accepted, k)
    # Asked for drafts, did the lane propose any? Prompt lookup proposes nothing without a match:
    # such a step gains nothing, and the policy must count it (goodput's `rates`), or a draft
    # accepted when it proposes looks better than it is.
    if asked > 0:
        seq.drafts_asked += 1
        seq.drafts_proposed += k > 0
        acceptance.observe_proposal(k > 0)
        seq.proposal_rate = request_rate(seq.drafts_asked, seq.drafts_proposed, acceptance.proposal_rate)
    if k > 0 or asked > 0:
        prior = acceptance.alpha
    seq.alpha_estimate = request_alpha(seq.stats.accepted_tokens, seq.draft_rejections, prior)
    seq.last_k = k
    return prior


def append_tokens(
    seq, new_tokens: list[int], eos: frozenset[int], vocab_size: int, max_context: int, now: float
) -> tuple[list[int], FinishReason | None]:
    """Appends a step's tokens to `seq` up to the first that ends it (EOS, a stop token id, max_tokens,
    the context);
    returns (the tokens appended, the finish reason or None). Stop strings are the detokenizer's."""
    bad = [t for t in new_tokens if not 0 <= t < vocab_size]
    if bad:  # e.g. the sampler's NO_TOKEN for a NaN distribution: a lane fault, never streamed
        raise RuntimeError(f"a lane returned token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    finish, tokens = None, []
    for tok in new_tokens:
        tokens.append(tok)
        if seq.spec.stop_at_eos and tok in eos:
            finish = FinishReason.EOS
            break
        if tok in seq.spec.sampling.stop_token_ids:  # (masked until min_tokens: domain.sampling_controls)
            finish = FinishReason.STOP
            break
        if len(seq.output_ids) + len(tokens) >= seq.spec.max_tokens:
            finish = FinishReason.LENGTH
            break
        if seq.num_tokens + len(tokens) >= max_context:
            finish = FinishReason.LENGTH
            break
    seq.output_ids.extend(tokens)
    seq.stats.completion_tokens = len(seq.output_ids)
    seq.stats.token_times.extend([now] * len(tokens))
    if seq.stats.first_token_time is None:
        seq.stats.first_token_time = now
    return tokens, finish

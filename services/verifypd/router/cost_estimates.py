"""Step costs of unmeasured k, from the measured ones (StepCostModel.step_s). Torch-free.

`medians` maps (padded batch bucket, k) to a measured step's seconds. A lock-step step is taken as
    step(B, k) = plain(B) + overhead(B) + k * per_token(B)        (k >= 1)
where `overhead` is what any drafting step adds to a plain one (a draft call, an unchained step:
on the embedded model at 16 requests a k = 1 step cost ~1.55 plain steps, H200) and `per_token`
what each drafted token adds. Estimates are conservative, never cheaper than this model allows
from what was measured, so the policy does not draft at a k whose cost it guessed low:

  * below the smallest measured drafting k: that step less the per-token cost of the drafting ks
    alone (`_per_token`; never the line from plain decoding, which spreads the overhead over the ks
    and made a k = 1 step look 1.2 plain steps where k = 8 cost 2.5 and k = 1 1.55);
  * between two measured ks: linear;
  * beyond the largest measured k: along the steeper of the measured slope and the prior;
  * no drafting k measured at this bucket, plain decoding measured: the relative cost
    step / plain of the nearest bucket within BORROW_SPAN where drafting was measured (the tail of
    a batch, 2 or 4 requests, was costed at the prior 10 % per token while a k = 1 step there cost
    2.8 plain steps); farther apart the GPU's regime may differ (memory-bound at 1 request,
    compute-bound at 64), so not from there;
  * otherwise: each drafted token adds DRAFT_COST_PRIOR of a plain step.
A step with more drafts never costs less than a measured one with fewer (lock-step: it runs at
least that work), nor a drafting step less than half the cheapest step measured at its bucket.
"""

from __future__ import annotations

import bisect

# Unmeasured: each drafted token is taken to add 10 % of a plain decode step.
DRAFT_COST_PRIOR = 0.1
# Relative drafting costs are borrowed from buckets at most this many doublings apart (4 x the batch).
BORROW_SPAN = 2


def lock_step_estimates(medians: dict[tuple[int, int], float], bucket: int, hi: int) -> list[float] | None:
    """A lock-step step's seconds at `bucket` for every k in 0..hi (see the module's rules), in one
    pass over what is measured there: a k decision asks for every k, and asked one at a time they
    cost ~130 Python calls per decision (the medians move with every plain step, so each decision
    recomputed them). None when nothing is measured at the bucket."""
    measured = at_bucket(medians, bucket)
    if not measured:
        return None
    plain = measured.get(0)
    drafting = {kk: v for kk, v in measured.items() if kk > 0}
    ks = sorted(drafting)
    half = 0.5 * min(measured.values())
    borrowed = None if drafting or hi == 0 else _borrowed_ratios(medians, bucket, hi)
    per_token = _per_token(drafting, plain) if drafting else 0.0
    steeper = 0.0
    if drafting:  # beyond every measured k: the steeper of the slope over all measured ks and the prior
        top = ks[-1]
        prior = DRAFT_COST_PRIOR * (plain if plain is not None else drafting[top] / (1 + DRAFT_COST_PRIOR * top))
        steeper = max(slope(measured), prior)
    out, floor = [], 0.0  # floor: the dearest step measured at a smaller k
    for k in range(hi + 1):
        exact = measured.get(k)
        if exact is not None:
            out.append(max(exact, floor))
            floor = max(floor, exact)
            continue
        if k == 0:  # only drafting steps measured: below them by their per-token cost, at least half
            lo = ks[0]
            out.append(max(drafting[lo] - lo * _per_token(drafting, None), half))
            continue
        if not drafting:
            assert plain is not None
            estimate = plain * (borrowed[k] if borrowed is not None else 1.0 + DRAFT_COST_PRIOR * k)
        else:
            above = bisect.bisect_right(ks, k)  # ks[above:] > k (k itself is not measured)
            if 0 < above < len(ks):
                lo, up = ks[above - 1], ks[above]
                estimate = drafting[lo] + (drafting[up] - drafting[lo]) * (k - lo) / (up - lo)
            elif above == 0:  # below every measured drafting k
                lo = ks[0]
                estimate = drafting[lo] - (lo - k) * per_token
            else:
                top = ks[-1]
                estimate = drafting[top] + (k - top) * steeper
            estimate = max(estimate, half)
        out.append(max(estimate, floor))
    return out


def pipelined_estimate(medians: dict[tuple[int, int], float], bucket: int, k: int) -> float | None:
    """A pipelined step's seconds at (bucket, k) from the ks measured there (a group's drafts overlap
    the other group's verify, so no monotone floor): exact; between two measured ks linearly;
    beyond them along the measured slope (least squares; the prior with one point only), never
    under half the cheapest step measured there. None when nothing is measured at the bucket."""
    measured = at_bucket(medians, bucket)
    if not measured:
        return None
    exact = measured.get(k)
    if exact is not None:
        return exact
    below, above = [kk for kk in measured if kk < k], [kk for kk in measured if kk > k]
    if below and above:
        lo, hi = max(below), min(above)
        return measured[lo] + (measured[hi] - measured[lo]) * (k - lo) / (hi - lo)
    ref = max(below) if below else min(above)
    return max(measured[ref] + (k - ref) * slope(measured), 0.5 * min(measured.values()))


def at_bucket(medians: dict[tuple[int, int], float], bucket: int) -> dict[int, float]:
    """{k: seconds} measured at `bucket`."""
    return {kk: v for (bb, kk), v in medians.items() if bb == bucket}


def slope(measured: dict[int, float]) -> float:
    """Seconds per drafted token over the measured ks of one bucket (least squares, never negative;
    one point: the prior DRAFT_COST_PRIOR of the plain step that point implies)."""
    if len(measured) == 1:
        ((k, seconds),) = measured.items()
        return DRAFT_COST_PRIOR * seconds / (1 + DRAFT_COST_PRIOR * k)
    mean_k = sum(measured) / len(measured)
    mean_s = sum(measured.values()) / len(measured)
    num = sum((k - mean_k) * (v - mean_s) for k, v in measured.items())
    den = sum((k - mean_k) ** 2 for k in measured)
    return max(num / den, 0.0)


def _per_token(drafting: dict[int, float], plain: float | None) -> float:
    """What each drafted token adds, for costing ks below the measured drafting ones: the slope of
    the drafting steps alone (their fixed overhead left out) with two or more measured; with one,
    at k, its cost above plain decoding split into k + 1 equal shares, one of them the overhead
    (more than the line from plain decoding leaves a smaller k, less than a measured overhead may
    be); the prior's share of its implied plain step when plain decoding is unmeasured too."""
    if len(drafting) >= 2:
        return slope(drafting)
    ((k, seconds),) = drafting.items()
    if plain is None:
        return DRAFT_COST_PRIOR * seconds / (1 + DRAFT_COST_PRIOR * k)
    return max(seconds - plain, 0.0) / (k + 1)


def _borrowed_ratios(medians: dict[tuple[int, int], float], bucket: int, hi: int) -> list[float] | None:
    """step(b, k) / step(b, 0) for k in 0..hi at the bucket b nearest `bucket`, at most BORROW_SPAN
    doublings away (ties: the smaller, the dearer relative to its plain step on a host-bound
    engine), where plain decoding and a drafting k are measured; None if there is none."""
    span = bucket.bit_length()
    buckets = {
        bb
        for (bb, kk) in medians
        if kk > 0 and (bb, 0) in medians and bb != bucket and abs(bb.bit_length() - span) <= BORROW_SPAN
    }
    if not buckets:
        return None
    nearest = min(buckets, key=lambda b: (abs(b.bit_length() - span), b))
    estimates = lock_step_estimates(medians, nearest, hi)
    assert estimates is not None
    plain = medians[(nearest, 0)]
    return [estimate / plain for estimate in estimates]

"""pdv pipelining's two groups of decoding requests: which group a request is in, and how far the
drafting group may draft. Torch-free.

Each pipelined step one group drafts (its drafts held for the next step) while the other verifies the
drafts it made the step before (Scheduler.plan, docs/engine.md "Schedules").
"""

from __future__ import annotations

from verifypd.router.sequence import Sequence

# A drafting group's k is capped at k_max * VERIFY_QUEUE_SOFT / q once q, the requests in the step's
# verify call, exceeds VERIFY_QUEUE_SOFT: a long verify queue means a large, compute-bound verify,
# where every drafted token costs its share of verify compute next step.
VERIFY_QUEUE_SOFT = 32


def assign_groups(decoding: list[Sequence], phase: int) -> None:
    """Newcomers join the smaller group (ties: `phase`, the one drafting now); when requests leave, the
    newest requests holding no drafts move until the sizes differ by at most one."""
    sizes = [sum(s.group == g for s in decoding) for g in (0, 1)]
    for seq in decoding:
        if seq.group is None:
            seq.group = phase if sizes[phase] <= sizes[1 - phase] else 1 - phase
            sizes[seq.group] += 1
    for seq in reversed(decoding):
        big = 0 if sizes[0] > sizes[1] else 1
        if sizes[big] - sizes[1 - big] <= 1:
            break
        if seq.group == big and seq.held_draft is None:
            seq.group = 1 - big
            sizes[big] -= 1
            sizes[1 - big] += 1


def drafting_k_limit(k_max: int, queue: int) -> int:
    """The drafting group's largest k when `queue` requests are in the step's verify call."""
    return k_max if queue <= VERIFY_QUEUE_SOFT else max(1, k_max * VERIFY_QUEUE_SOFT // queue)

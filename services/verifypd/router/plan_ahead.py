"""Planning ahead: a step planned on the scheduler's state before the step in flight reaches the host.
Torch-free.

A chained plain step (steps.overlapped) is certain to be what `Scheduler.plan` would make: its
decoding requests plain-decode (`plan_follow`), and the waiting requests it admits are the ones `plan`
would admit now, by priority, within the prefill token budget, below max_running, with a block
reserve of one per running request (`admit_follow`). Two kinds of admission need the regular step
instead (`follow_blocked`): a prompt longer than the budget (chunked over several steps) and a
preempted request's recompute, which samples no first token for the next step to read. Drafts
launched after a verify call (steps.draft_after) take the k `plan_after` decides, and a speculative
step launched ahead (steps.speculate_ahead) reserves blocks by `BlockReservations.fits_ahead` and
`reserve_target`.
"""

from __future__ import annotations

from verifypd.domain.config import RuntimeConfig
from verifypd.router.draft_length import StepCostModel, cap_k
from verifypd.router.scheduler import Scheduler
from verifypd.router.sequence import Sequence
from verifypd.router.step_plan import PrefillChunk


def plan_after(
    scheduler: Scheduler, config: RuntimeConfig, costs: StepCostModel, rows: list[tuple[Sequence, int]]
) -> list[tuple[Sequence, int]]:
    """The next step's drafting work, (request, k) pairs, for `rows` (request, k of its verify call
    in flight), planned before that call's verdict (steps.draft_after): the batch's k as
    `Scheduler.plan` would decide it now, capped per request for the longest outcome (every draft
    accepted), draft blocks reserved for it without preemption (a request that does not fit is
    left out: it joins the next step at k = 0). A decision of k = 0 (or with probes) drafts
    nothing now and is kept for the next `Scheduler.plan`."""
    decision = scheduler.k
    decision.decided = None
    seqs = [seq for seq, _ in rows]
    if not seqs:
        return []
    k_batch, probed = decision.batch_k(config, costs, seqs, config.k_max, "batch")
    if k_batch == 0 or probed:
        decision.decided = (frozenset(s.request_id for s in seqs), k_batch, probed)
        return []
    work = []
    for seq, k_now in rows:
        pending = seq.pending_pos + k_now + 1  # the next pending position if all k_now are accepted
        k = min(cap_k(config, k_batch, seq.spec.max_k, seq.remaining_tokens - 1), scheduler.max_context - 1 - pending)
        # the head writes rows up to pending + k - 1 (the chain's last step feeds at that position)
        if k > 0 and scheduler.blocks.draft.grow(seq.draft_blocks, pending + k):
            work.append((seq, k))
    return work


def plan_follow(scheduler: Scheduler, config: RuntimeConfig, costs: StepCostModel, seqs: list[Sequence]) -> bool:
    """The k = 0 step after the one in flight, planned before that one's tokens are committed:
    `seqs` (each with one token in flight: a decoding request's next token, or the first token of
    a request whose prefill is in flight) get the blocks of one more position, and the k decision
    is recorded as `plan` would record it. Only where that step is certain to be what `plan`
    would make: k 0 with no probe (KDecision.plain_certain), every block free without preemption.
    Otherwise nothing changes and False is returned."""
    # Held at k = 0 (router.zero_hold), or k_max 0, nothing drafts until that ends, so the draft pool's
    # blocks are not grown: the step that drafts next reserves them all (`BlockReservations.reserve`),
    # as a draft that catches up after plain steps needs them.
    decision, blocks = scheduler.k, scheduler.blocks
    held = decision.held("batch", None)
    draft = config.k_max > 0 and not held
    if not seqs or not decision.plain_certain(config, costs, seqs, held) or not blocks.next_position_fits(seqs, draft):
        return False
    k_batch, probed = decision.batch_k(config, costs, seqs, config.k_max, "batch")
    if probed or (k_batch or config.k_min) and any(scheduler.cap(config, s, k_batch) for s in seqs):
        return False  # (plain_certain rules this out; with k 0 and k_min 0 every cap is 0)
    blocks.reserve_next_position(seqs, draft)
    return True


def join_now(scheduler: Scheduler, config: RuntimeConfig, chunks: list[PrefillChunk]) -> bool:
    """Can the requests just admitted (`admit_follow`'s chunks) decode in the chained step
    launched with their prefill (steps.overlapped: prefill first, their first token fed from it)?
    Only with `config.admit_ahead`, where k is 0 whatever the batch (plan_follow decided k for the
    batch without them), and the blocks of their first decode position are free; then those are
    reserved. Otherwise nothing changes and False is returned (they join the step after, their
    prefill beside)."""
    seqs = [c.seq for c in chunks]
    if not config.admit_ahead or not seqs or not all(c.sample_first for c in chunks):
        return False
    if not (
        config.k_max == 0
        or scheduler.never_drafts
        or not config.adaptive
        and config.k_initial == 0
        or all(s.spec.max_k == 0 for s in scheduler.running)
    ):
        return False
    if not scheduler.blocks.next_position_fits(seqs):  # the first token sits at pending_pos + 1: the prompt's end
        return False
    scheduler.blocks.reserve_next_position(seqs)
    return True


def follow_blocked(scheduler: Scheduler, config: RuntimeConfig) -> bool:
    """`plan` would start the head of the queue now, but not as one whole-prompt chunk that
    samples its first token (a prompt longer than the prefill budget, a recompute after
    preemption): a chained step cannot take it, the chain must end for the regular step."""
    head = scheduler.queue_head
    if head is None or len(scheduler.running) >= scheduler.max_running:
        return False
    return not head.samples_after_prefill or head.prefill_target - head.target_computed > config.prefill_token_budget


def admit_follow(scheduler: Scheduler, config: RuntimeConfig, costs: StepCostModel) -> list[PrefillChunk]:
    """Admits waiting requests into the chained step (called after `plan_follow` reserved its
    decode blocks, as `plan` reserves decode before prefill): by priority while each whole
    prompt fits the remaining budget and the pool (with a reserve of one block per running
    request), below max_running. A request that would only get part of the remaining budget
    stays queued (the head of the queue next step, with the whole budget). Returns the
    scheduler's PrefillChunks (each a whole prompt that samples the first token)."""
    budget = config.prefill_token_budget
    chunks = []
    while (seq := scheduler.queue_head) is not None and len(scheduler.running) < scheduler.max_running:
        need = seq.prefill_target - seq.target_computed
        if not seq.samples_after_prefill or need > budget:
            break
        chunk = scheduler.blocks.prefill_chunk(seq, budget, reserve=len(scheduler.running))
        if chunk is None:
            break  # no room: it waits, as a regular step's prefill plan does
        scheduler.admit_head()
        chunks.append(chunk)
        budget -= need
    scheduler.mark_draft_kv(config, costs, chunks)
    return chunks

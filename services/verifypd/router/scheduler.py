"""Continuous-batching scheduler: which requests prefill (chunked) and which decode this step.

Torch-free. Policy:
  * decoding requests first (latency-critical), in priority order; each gets k from the
    draft-length policy and blocks for k+1 target / k draft positions. When blocks run out the
    request first falls back to k = 0, then the lowest-priority, newest running request is
    preempted by recompute (blocks freed, tokens kept, re-queued) — never an out-of-memory crash;
  * then prefill chunks within the per-step token budget: requests already prefilling, then new
    ones by priority. A new request is admitted only if its chunk fits with a reserve of one block
    per running request left over, so admissions do not immediately force preemptions.

The schedule (`RuntimeConfig.schedule`, docs/engine.md "Schedules") changes what one step holds:
  * baseline: ONE request per step (round-robin over the running requests, admitting a waiting
    one when a slot is free): its prefill chunk, or its draft + verify, each a one-item lane call;
  * pd, and pdv without pipelining: the above, every decoding request draft + verify lock-step;
  * pdv pipelined: decoding requests are in two groups; each step one group drafts (drafts held
    until the next step) while the other verifies the drafts it made the step before.

Steps planned before the step in flight reaches the host (a chained plain step, the drafts launched
after a verify call) are planned on the scheduler's state by router.plan_ahead.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from verifypd.domain.config import RuntimeConfig
from verifypd.router.block_manager import BlockManager
from verifypd.router.block_reservations import BlockReservations
from verifypd.router.draft_length import ProbeSchedule, StepCostModel, cap_k
from verifypd.router.k_decision import KDecision
from verifypd.router.pipeline_groups import assign_groups, drafting_k_limit
from verifypd.router.prefix_cache import PrefixCache
from verifypd.router.sequence import SeqStatus, Sequence
from verifypd.router.step_plan import DecodeWork, PrefillChunk, StepPlan


class Scheduler:
    def __init__(
        self,
        target_blocks: BlockManager,
        draft_blocks: BlockManager | None,
        max_context: int,
        max_running: int = 256,
        lazy_draft_prefill: bool = False,
        never_drafts: bool = False,
        clock: Callable[[], float] = time.monotonic,
        prefix: PrefixCache | None = None,
    ):
        """`lazy_draft_prefill`: the prefill lane takes chunks without draft KV (per item), and the
        draft lane catches a lagging draft KV up (a model draft, not a feature draft): a chunk then
        writes draft KV only while drafting is expected (`drafts_soon`). `never_drafts`: the draft
        lane proposes nothing (`--draft none`), so every k is 0: the policy, which never sees an
        acceptance there, would otherwise keep asking for k_initial drafts, and each such step
        (a draft call answering nothing, then a k = 0 verify) could not be chained (steps.overlapped).
        `prefix`: prefix caching (router.prefix_cache): a waiting request is admitted after its cached
        prefix (`BlockReservations.admit_cached`); its draft KV may then start shorter and catch up in
        the draft call."""
        self.never_drafts = never_drafts
        self.clock = clock  # the router's: stamps a request's first admission (queue time)
        self.lazy_draft_prefill = lazy_draft_prefill and draft_blocks is not None
        self.blocks = BlockReservations(target_blocks, draft_blocks, prefix)
        self.max_context = max_context
        self.max_running = max_running
        self._waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by sort_key
        self.running: list[Sequence] = []
        # the draft-length decisions and their state (router.k_decision)
        self.k = KDecision(never_drafts, draft_blocks is None, self.cap)
        self._phase = 0  # pdv: the group that drafts in the current pipelined step
        self._rr_last = -1  # baseline: arrival order of the request served last (round-robin)

    @property
    def probes(self) -> ProbeSchedule:
        return self.k.probes

    @property
    def held_steps(self) -> int:
        """Decisions taken in the k = 0 hold (benchmarks, tests)."""
        return self.k.hold.steps

    # -- queue -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (seq.sort_key(), seq))
        self.k.hold.joined()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def queue_head(self) -> Sequence | None:
        """The waiting request admitted next (None: none waits)."""
        return self._waiting[0][1] if self._waiting else None

    def has_work(self) -> bool:
        return bool(self._waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drops a finished or cancelled sequence and returns its blocks."""
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self._waiting = [(key, s) for key, s in self._waiting if s is not seq]
            heapq.heapify(self._waiting)

    def all_sequences(self) -> list[Sequence]:
        return self.running + [s for _, s in self._waiting]

    # -- planning ----------------------------------------------------------------------------
    def plan(self, config: RuntimeConfig, costs: StepCostModel) -> StepPlan:
        if config.schedule == "baseline":
            return self._plan_single(config, costs)
        preempted: list[Sequence] = []
        out_of_room: list[Sequence] = []
        ahead: list[DecodeWork] = []
        pipelined = config.pipelined and self._pipeline_now(config, costs)
        if pipelined:
            decode, ahead = self._plan_pipelined(config, costs, preempted, out_of_room)
        else:
            decode = self._plan_decode(config, costs, preempted, out_of_room)
        self.k.decided = None  # plan_after's decision serves the plan right after it only
        budget = config.prefill_token_budget
        if not decode and not ahead:  # nothing decodes this step: a larger prefill delays nobody's token
            budget = max(budget, config.idle_prefill_token_budget)
        prefill = self._plan_prefill(budget)
        self.mark_draft_kv(config, costs, prefill)
        return StepPlan(
            prefill=prefill,
            decode=decode,
            preempted=preempted,
            out_of_room=out_of_room,
            draft_ahead=ahead,
            pipelined=pipelined,
        )

    def mark_draft_kv(self, config: RuntimeConfig, costs: StepCostModel, chunks: list[PrefillChunk]) -> None:
        """Lazy draft prefill: a chunk writes draft KV only while drafting is expected soon."""
        if self.lazy_draft_prefill and chunks:
            reason = self.k.draft_kv_reason(config, costs, len(self.running) + len(self._waiting))
            for chunk in chunks:  # draft KV stays contiguous: a chunk after a skipped one skips too
                seq = chunk.seq
                chunk.with_draft = reason is not None and seq.spec.max_k != 0 and seq.draft_computed == chunk.start
            if reason == "probe" and any(c.with_draft for c in chunks):
                self.k.probe_kv = True  # the probes pay for it (charge_probe_kv, after the step)

    def drafts_soon(self, config: RuntimeConfig, costs: StepCostModel) -> bool:
        """Whether a request prefilled now is expected to draft before long, so its prefill should
        write draft KV too (KDecision.draft_kv_reason). Otherwise the draft's prefill is work for a draft
        nobody may call: a batch that stopped drafting at acceptance 0.1 paid it for every new prompt."""
        return self.k.draft_kv_reason(config, costs, len(self.running) + len(self._waiting)) is not None

    def charge_probe_kv(self, costs: StepCostModel, prefill_s: float) -> None:
        """After a step: draft KV its prefill wrote only for a probe is the probes' expense
        (KDecision.charge_probe_kv)."""
        self.k.charge_probe_kv(costs, prefill_s, len(self.running))

    def settle_probes(self, plan: StepPlan | None, costs: StepCostModel, seconds: float) -> None:
        """After a step: if it probed, what it took above a plain step at its batch settles the
        probes' charge (ProbeSchedule.settle)."""
        if plan is None or not self.k.probes.unsettled:  # (most steps: nothing to scan the plan for)
            return
        if not any(w.probe for w in plan.decode) and not any(w.probe for w in plan.draft_ahead):
            return
        batch = len(plan.decode) + len(plan.draft_ahead)
        self.k.probes.settle(seconds / costs.step_s(batch, 0) - 1.0)

    def _pipeline_now(self, config: RuntimeConfig, costs: StepCostModel) -> bool:
        return self.k.pipeline_now(config, costs, [s for s in self.running if s.status is SeqStatus.DECODING])

    def _plan_decode(
        self,
        config: RuntimeConfig,
        costs: StepCostModel,
        preempted: list[Sequence],
        out_of_room: list[Sequence],
        only: Sequence | None = None,
    ) -> list[DecodeWork]:
        """Lock-step: every decoding request (or `only`) drafts and verifies in this step; a request
        still holding pipelined drafts (the schedule changed, or the batch shrank to one) verifies them."""
        decoding = (
            [only]
            if only is not None
            else sorted((s for s in self.running if s.status is SeqStatus.DECODING), key=Sequence.sort_key)
        )
        fresh = [s for s in decoding if s.held_draft is None]
        # Requests still holding drafts of a pipelined step (pdv just chose lock-step, or the schedule
        # changed) verify them alone this step; the others wait one step rather than draft now: one
        # verify call verifies the proposals of one draft call (the split topology hands them over in
        # one DraftHandoff slot per draft call, call_codec.encode_verify).
        draining = len(fresh) < len(decoding)
        # Drafts made right after the last verify call (steps.draft_after): the others join at k = 0.
        joining = draining and all(s.held_draft.predrafted for s in decoding if s.held_draft is not None)
        k_batch, probed = (
            (0, {}) if draining else self.k.decided_k(config, costs, fresh, "single" if only is not None else "batch")
        )
        work: list[DecodeWork] = []
        for seq in decoding:
            if seq in preempted or (draining and seq.held_draft is None and not joining):
                continue
            probe = seq.request_id in probed
            if seq.held_draft is not None:
                k, held = len(seq.held_draft.tokens), True
            else:
                k, held = self.cap(config, seq, probed.get(seq.request_id, k_batch)), False
            reserved = self._reserve_or_preempt(seq, k, preempted, out_of_room, can_drop_k=not held)
            if reserved is not None:
                work.append(DecodeWork(seq, reserved, held=held and reserved > 0, probe=probe and reserved > 0))
        return [w for w in work if w.seq not in preempted]

    def _plan_pipelined(
        self, config: RuntimeConfig, costs: StepCostModel, preempted: list[Sequence], out_of_room: list[Sequence]
    ) -> tuple[list[DecodeWork], list[DecodeWork]]:
        """Group `phase` drafts (its drafts are held for the next step); the other group verifies the
        drafts it made in the previous step. Roles swap every pipelined step, so each request
        alternates draft step / verify step. A request whose k is 0 (speculation off, max_k = 0, one
        token left) plain-decodes every step in the verify call, whichever its group."""
        self._phase ^= 1
        decoding = sorted((s for s in self.running if s.status is SeqStatus.DECODING), key=Sequence.sort_key)
        assign_groups(decoding, self._phase)
        drafting = [s for s in decoding if s.group == self._phase and s.held_draft is None]
        verifying = [s for s in decoding if not (s.group == self._phase and s.held_draft is None)]
        verify: list[DecodeWork] = []
        last_k = self.k.last_k.get(("group", 1 - self._phase))
        for seq in verifying:  # first: their blocks for n + k + 1 were reserved when they drafted
            if seq in preempted:
                continue
            if seq.held_draft is None and self.cap(config, seq, config.k_max if last_k is None else last_k) > 0:
                # Just moved here (joined, rebalanced): it waits one step and drafts with its group
                # next step, so its k sequence is a lock-step run's. (Seeded tokens no longer depend
                # on k: coupled acceptance, verifypd.model.sampler. Plain-decoding it now instead
                # would be correct too; a possible latency trade.)
                continue
            k = len(seq.held_draft.tokens) if seq.held_draft is not None else 0
            reserved = self._reserve_or_preempt(seq, k, preempted, out_of_room, can_drop_k=False)
            if reserved is not None:
                verify.append(DecodeWork(seq, reserved, held=reserved > 0))
        queue = len(verify)
        hi = drafting_k_limit(config.k_max, queue)
        k_group, probed = self.k.batch_k(config, costs, drafting, hi, ("group", self._phase), decoding=len(decoding))
        ahead: list[DecodeWork] = []
        for seq in drafting:
            if seq in preempted:
                continue
            probe = seq.request_id in probed
            reserved = self._reserve_or_preempt(
                seq, self.cap(config, seq, probed.get(seq.request_id, min(k_group, hi))), preempted, out_of_room
            )
            if reserved is None:
                continue
            # k = 0 (speculation off, nothing left to draft, no room): plain decoding now, not idling
            (ahead if reserved > 0 else verify).append(DecodeWork(seq, reserved, probe=probe and reserved > 0))
        return [w for w in verify if w.seq not in preempted], [w for w in ahead if w.seq not in preempted]

    def cap(self, config: RuntimeConfig, seq: Sequence, k_batch: int) -> int:
        """`seq`'s k from the batch's: within its max_k, its tokens left and the context."""
        k = cap_k(config, k_batch, seq.spec.max_k, seq.remaining_tokens)
        return max(0, min(k, self.max_context - 1 - seq.pending_pos))  # verify writes positions n..n+k

    def _reserve_or_preempt(
        self, seq: Sequence, k: int, preempted: list[Sequence], out_of_room: list[Sequence], can_drop_k: bool = True
    ) -> int | None:
        """Blocks for k + 1 target / k draft positions: k falls to 0 first, then the lowest-priority
        newest other request is preempted. Returns the k reserved, None if `seq` is out of room."""
        n = seq.pending_pos
        while not self.blocks.reserve(seq, n, k):
            if k > 0 and can_drop_k:
                k = 0
                continue
            victim = self._pick_victim(exclude=seq)
            if victim is None:  # alone and still no room: the pool cannot hold this request
                out_of_room.append(seq)
                return None
            self._preempt(victim)
            preempted.append(victim)
        return k

    def _plan_single(self, config: RuntimeConfig, costs: StepCostModel) -> StepPlan:
        """baseline: one request this step, round-robin by arrival over the running requests plus
        the head of the queue when a slot is free: its next prefill chunk, or its draft + verify."""
        preempted: list[Sequence] = []
        out_of_room: list[Sequence] = []
        head = self.queue_head if len(self.running) < self.max_running else None
        order = sorted(self.running + ([head] if head is not None else []), key=lambda s: s.arrival_order)
        later = [s for s in order if s.arrival_order > self._rr_last]
        for seq in later + [s for s in order if s not in later]:
            if seq.status is SeqStatus.DECODING:
                decode = self._plan_decode(config, costs, preempted, out_of_room, only=seq)
                self._rr_last = seq.arrival_order
                return StepPlan([], decode, preempted, out_of_room)
            chunk = self.blocks.prefill_chunk(
                seq, config.prefill_token_budget, reserve=len(self.running) if seq is head else 0
            )
            if chunk is None:
                continue
            if seq is head:
                self.admit_head()
            self._rr_last = seq.arrival_order
            return StepPlan([chunk], [], preempted, out_of_room)
        return StepPlan([], [], preempted, out_of_room)

    def admit_head(self) -> None:
        """The head of the waiting queue starts prefilling; its first admission ends its queue time."""
        seq = heapq.heappop(self._waiting)[1]
        seq.status = SeqStatus.PREFILLING
        self.running.append(seq)
        self.k.hold.joined()
        if seq.stats.scheduled_time is None:
            seq.stats.scheduled_time = self.clock()

    def _pick_victim(self, exclude: Sequence) -> Sequence | None:
        candidates = [s for s in self.running if s is not exclude]
        return max(candidates, key=Sequence.sort_key) if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.add(seq)

    def _plan_prefill(self, budget: int) -> list[PrefillChunk]:
        chunks: list[PrefillChunk] = []
        for seq in sorted((s for s in self.running if s.status is SeqStatus.PREFILLING), key=Sequence.sort_key):
            if budget <= 0:
                return chunks
            chunk = self.blocks.prefill_chunk(seq, budget, reserve=0)
            if chunk is None:
                continue
            chunks.append(chunk)
            budget -= chunk.end - chunk.start
        while budget > 0 and (head := self.queue_head) is not None and len(self.running) < self.max_running:
            chunk = self.blocks.prefill_chunk(head, budget, reserve=len(self.running))
            if chunk is None:
                break  # head of the queue does not fit: keep FIFO-by-priority order, wait
            self.admit_head()
            chunks.append(chunk)
            budget -= chunk.end - chunk.start
        return chunks

"""The scheduler's side of overlapped scheduling (engine.overlap): planning the step after the one in
flight before that one's tokens reach the host. Torch-free; a mixin of `Scheduler`
(verifypd.router.scheduler), whose state and helpers (`_batch_k`, `_cap`, `_reserve`, `_chunk`,
the waiting heap) it uses, so that the chained step is planned by the same rules as `plan`.

A chained step is certain to be what `plan` would make: its decoding requests plain-decode
(`plan_follow`), and the waiting requests it admits are the ones `plan` would admit now, by
priority, within the prefill token budget, below max_running, with a block reserve of one per
running request (`admit_follow`). Two kinds of admission need the regular step instead
(`follow_blocked`): a prompt longer than the budget (chunked over several steps) and a preempted
request's recompute, which samples no first token for the next step to read.
"""

from __future__ import annotations

import heapq

from verifypd.domain.config import RuntimeConfig
from verifypd.router.draft_length import StepCostModel, cap_k
from verifypd.router.sequence import SeqStatus, Sequence


class FollowPlanning:
    # plan_after's k decision when it drafted nothing: (request ids, k, probes), taken by the next
    # `_plan_decode` of the same requests instead of deciding again (one decision per step).
    _decided: tuple[frozenset, int, dict] | None = None

    def plan_after(
        self, config: RuntimeConfig, costs: StepCostModel, rows: list[tuple[Sequence, int]]
    ) -> list[tuple[Sequence, int]]:
        """The next step's drafting work, (request, k) pairs, for `rows` (request, k of its verify call
        in flight), planned before that call's verdict (engine.draft_after): the batch's k as
        `_plan_decode` would decide it now, capped per request for the longest outcome (every draft
        accepted), draft blocks reserved for it without preemption (a request that does not fit is
        left out: it joins the next step at k = 0). A decision of k = 0 (or with probes) drafts
        nothing now and is kept for the next `_plan_decode`."""
        self._decided = None
        seqs = [seq for seq, _ in rows]
        if not seqs:
            return []
        k_batch, probed = self._batch_k(config, costs, seqs, config.k_max, "batch")
        if k_batch == 0 or probed:
            self._decided = (frozenset(s.request_id for s in seqs), k_batch, probed)
            return []
        work = []
        for seq, k_now in rows:
            pending = seq.pending_pos + k_now + 1  # the next pending position if all k_now are accepted
            k = min(cap_k(config, k_batch, seq.spec.max_k, seq.remaining_tokens - 1), self.max_context - 1 - pending)
            # the head writes rows up to pending + k - 1 (the chain's last step feeds at that position)
            if k > 0 and (self.poolless_draft or self.draft.grow(seq.draft_blocks, pending + k)):
                work.append((seq, k))
        return work

    def fits_ahead(self, seqs: list[Sequence]) -> bool:
        """Would `_plan_decode` reserve the next step of `seqs` (each at the k of the drafts it holds, or
        0) without preempting anyone? (engine.spec_ahead plans ahead only then.)"""
        ks = [len(s.held_draft.tokens) if s.held_draft is not None else 0 for s in seqs]
        target = sum(self.target.extra_blocks_needed(s.target_blocks, s.pending_pos + k + 1) for s, k in zip(seqs, ks))
        if target > self.target.num_free:
            return False
        return (
            self.poolless_draft
            or sum(self.draft.extra_blocks_needed(s.draft_blocks, s.pending_pos + k) for s, k in zip(seqs, ks))
            <= self.draft.num_free
        )

    def reserve_target(self, rows: list[tuple[Sequence, int]]) -> bool:
        """Target blocks for `rows` (request, positions it may write), all or none, without preemption:
        a verify call launched before the verdict of the one before it may write its longest outcome's
        positions (engine.spec_ahead). False (nothing reserved) if they are not free."""
        need = sum(self.target.extra_blocks_needed(s.target_blocks, n) for s, n in rows)
        if need > self.target.num_free:
            return False
        for seq, n in rows:
            self.target.grow(seq.target_blocks, n)
        return True

    def _decided_k(
        self, config: RuntimeConfig, costs: StepCostModel, seqs: list[Sequence], key: str
    ) -> tuple[int, dict]:
        """`_batch_k` for `_plan_decode`, or the decision plan_after already took for these requests."""
        decided, self._decided = self._decided, None
        if decided is not None and key == "batch" and decided[0] == frozenset(s.request_id for s in seqs):
            return decided[1], decided[2]
        return self._batch_k(config, costs, seqs, config.k_max, key)

    def plan_follow(self, config: RuntimeConfig, costs: StepCostModel, seqs: list[Sequence]) -> bool:
        """The k = 0 step after the one in flight, planned before that one's tokens are committed:
        `seqs` (each with one token in flight: a decoding request's next token, or the first token of
        a request whose prefill is in flight) get the blocks of one more position, and the k decision
        is recorded as `plan` would record it. Only where that step is certain to be what `plan`
        would make: k 0 with no probe (`_plain_certain`), every block free without preemption.
        Otherwise nothing changes and False is returned."""
        if not seqs or not self._plain_certain(config, costs, seqs) or not self._next_position_fits(seqs):
            return False
        k_batch, probed = self._batch_k(config, costs, seqs, config.k_max, "batch")
        if probed or any(self._cap(config, s, k_batch) for s in seqs):  # _plain_certain rules this out
            return False
        self._reserve_next_position(seqs)
        return True

    def _next_position_fits(self, seqs: list[Sequence]) -> bool:
        """The token in flight of each of `seqs` sits at pending_pos + 1 and is verified there: its KV
        needs pending_pos + 2 target positions (a draft holds one fewer). Are those blocks free?"""
        need = sum(self.target.extra_blocks_needed(s.target_blocks, s.pending_pos + 2) for s in seqs)
        return need <= self.target.num_free and (
            self.poolless_draft
            or sum(self.draft.extra_blocks_needed(s.draft_blocks, s.pending_pos + 1) for s in seqs)
            <= self.draft.num_free
        )

    def _reserve_next_position(self, seqs: list[Sequence]) -> None:
        """Reserves what `_next_position_fits` counted free (as _reserve(seq, n + 1, 0))."""
        for seq in seqs:
            reserved = self._reserve(seq, seq.pending_pos + 1, 0)
            assert reserved, "blocks counted free were not"

    def join_now(self, config: RuntimeConfig, chunks: list) -> bool:
        """Can the requests just admitted (`admit_follow`'s chunks) decode in the chained step
        launched with their prefill (engine.overlap: prefill first, their first token fed from it)?
        Only with `config.admit_ahead`, where k is 0 whatever the batch (plan_follow decided k for the batch without them), and
        the blocks of their first decode position are free; then those are reserved. Otherwise
        nothing changes and False is returned (they join the step after, their prefill beside)."""
        seqs = [c.seq for c in chunks]
        if not config.admit_ahead or not seqs or not all(c.sample_first for c in chunks):
            return False
        if not (
            config.k_max == 0
            or self.never_drafts
            or not config.adaptive
            and config.k_initial == 0
            or all(s.spec.max_k == 0 for s in self.running)
        ):
            return False
        if not self._next_position_fits(seqs):  # the first token sits at pending_pos + 1: the prompt's end
            return False
        self._reserve_next_position(seqs)
        return True

    def follow_blocked(self, config: RuntimeConfig) -> bool:
        """`plan` would start the head of the queue now, but not as one whole-prompt chunk that
        samples its first token (a prompt longer than the prefill budget, a recompute after
        preemption): a chained step cannot take it, the chain must end for the regular step."""
        if not self._waiting or len(self.running) >= self.max_running:
            return False
        head = self._waiting[0][1]
        return (
            not head.samples_after_prefill or head.prefill_target - head.target_computed > config.prefill_token_budget
        )

    def admit_follow(self, config: RuntimeConfig, costs: StepCostModel) -> list:
        """Admits waiting requests into the chained step (called after `plan_follow` reserved its
        decode blocks, as `plan` reserves decode before prefill): by priority while each whole
        prompt fits the remaining budget and the pool (with a reserve of one block per running
        request), below max_running. A request that would only get part of the remaining budget
        stays queued (the head of the queue next step, with the whole budget). Returns the
        scheduler's PrefillChunks (each a whole prompt that samples the first token)."""
        budget = config.prefill_token_budget
        chunks = []
        while self._waiting and len(self.running) < self.max_running:
            seq = self._waiting[0][1]
            need = seq.prefill_target - seq.target_computed
            if not seq.samples_after_prefill or need > budget:
                break
            chunk = self._chunk(seq, budget, reserve=len(self.running))
            if chunk is None:
                break  # no room: it waits, as in _plan_prefill
            heapq.heappop(self._waiting)
            seq.status = SeqStatus.PREFILLING
            self.running.append(seq)
            chunks.append(chunk)
            budget -= need
        self._mark_draft_kv(config, costs, chunks)
        return chunks

    def release_tables(self, target: list[int], draft: list[int]) -> None:
        """Returns blocks held back from a finished request (engine.overlap) once nothing queued writes them."""
        self.target.free(target)
        self.draft.free(draft)

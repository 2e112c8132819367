"""Continuous-batching scheduler: which requests prefill (chunked) and which decode this step.

Torch-free. Policy:
  * decoding requests first (latency-critical), in priority order; each gets k from the
    draft-length policy and blocks for k+1 target / k draft positions. When blocks run out the
    request first falls back to k = 0, then the lowest-priority, newest running request is
    preempted by recompute (blocks freed, tokens kept, re-queued) — never an out-of-memory crash;
  * then prefill chunks within the per-step token budget: requests already prefilling, then new
    ones by priority. A new request is admitted only if its chunk fits with a reserve of one block
    per running request left over, so admissions do not immediately force preemptions.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from verifypd.engine.block_manager import BlockManager
from verifypd.engine.draft_length import RuntimeConfig, StepCostModel, cap_k, choose_batch_k

# With speculation off, a decode step now and then drafts k = 1 to keep measuring acceptance: after
# 32 steps, then after twice as many each time a probe confirms k = 0 (up to 1024), since a probe
# costs a draft call that first catches up on every token decoded since the last one.
PROBE_FIRST, PROBE_MAX = 32, 1024
from verifypd.engine.sequence import Sequence, SeqStatus


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int  # exclusive
    sample_first: bool  # last chunk of a fresh prompt: sample the first output token


@dataclass
class DecodeWork:
    seq: Sequence
    k: int


@dataclass
class StepPlan:
    prefill: list[PrefillChunk]
    decode: list[DecodeWork]
    preempted: list[Sequence]
    out_of_room: list[Sequence]  # alone in a full pool: the router ends them with LENGTH

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, target_blocks: BlockManager, draft_blocks: BlockManager | None, max_context: int,
                 max_running: int = 256):
        self.target = target_blocks
        self.draft = draft_blocks or _NoPool()  # None: a pool-less draft lane needs no draft blocks
        self.max_context = max_context
        self.max_running = max_running
        self._waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by sort_key
        self.running: list[Sequence] = []
        self._steps_without_drafts = 0
        self._probe_interval = PROBE_FIRST
        self._last_k: int | None = None

    # -- queue -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (seq.sort_key(), seq))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drops a finished or cancelled sequence and returns its blocks."""
        self.target.free(seq.target_blocks)
        self.draft.free(seq.draft_blocks)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self._waiting = [(key, s) for key, s in self._waiting if s is not seq]
            heapq.heapify(self._waiting)

    def all_sequences(self) -> list[Sequence]:
        return self.running + [s for _, s in self._waiting]

    # -- planning ----------------------------------------------------------------------------
    def plan(self, config: RuntimeConfig, costs: StepCostModel) -> StepPlan:
        preempted: list[Sequence] = []
        out_of_room: list[Sequence] = []
        decode = self._plan_decode(config, costs, preempted, out_of_room)
        prefill = self._plan_prefill(config.prefill_token_budget)
        return StepPlan(prefill=prefill, decode=decode, preempted=preempted, out_of_room=out_of_room)

    def _plan_decode(self, config: RuntimeConfig, costs: StepCostModel, preempted: list[Sequence],
                     out_of_room: list[Sequence]) -> list[DecodeWork]:
        decoding = sorted((s for s in self.running if s.status is SeqStatus.DECODING), key=Sequence.sort_key)
        batch = len(decoding)
        work: list[DecodeWork] = []
        k_batch = 0
        if decoding:
            prior = costs.acceptance.alpha
            alphas = [prior if s.alpha_estimate is None else s.alpha_estimate for s in decoding]
            probe = self._steps_without_drafts >= self._probe_interval
            k_batch = choose_batch_k(config, alphas, costs, batch, config.k_max, probe=probe, current=self._last_k)
            self._last_k = k_batch
            if probe and k_batch == 1:
                self._probe_interval = min(2 * self._probe_interval, PROBE_MAX)
            elif k_batch > 0:
                self._probe_interval = PROBE_FIRST  # speculation chosen on its own merits
            self._steps_without_drafts = self._steps_without_drafts + 1 if k_batch == 0 else 0
        for seq in decoding:
            if seq in preempted:
                continue
            n = seq.pending_pos
            k = cap_k(config, k_batch, seq.spec.max_k, seq.remaining_tokens)
            k = max(0, min(k, self.max_context - 1 - n))  # verify writes positions n..n+k
            while not self._reserve(seq, n, k):
                if k > 0:
                    k = 0
                    continue
                victim = self._pick_victim(exclude=seq)
                if victim is None:  # alone and still no room: the pool cannot hold this request
                    out_of_room.append(seq)
                    break
                self._preempt(victim)
                preempted.append(victim)
                work = [w for w in work if w.seq is not victim]
            else:
                work.append(DecodeWork(seq, k))
        return work

    def _reserve(self, seq: Sequence, n: int, k: int) -> bool:
        if not (self.target.can_grow(seq.target_blocks, n + k + 1)
                and self.draft.can_grow(seq.draft_blocks, n + k)):
            return False
        self.target.grow(seq.target_blocks, n + k + 1)
        self.draft.grow(seq.draft_blocks, n + k)
        return True

    def _pick_victim(self, exclude: Sequence) -> Sequence | None:
        candidates = [s for s in self.running if s is not exclude]
        return max(candidates, key=Sequence.sort_key) if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        self.target.free(seq.target_blocks)
        self.draft.free(seq.draft_blocks)
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.add(seq)

    def _plan_prefill(self, budget: int) -> list[PrefillChunk]:
        chunks: list[PrefillChunk] = []
        for seq in sorted((s for s in self.running if s.status is SeqStatus.PREFILLING), key=Sequence.sort_key):
            if budget <= 0:
                return chunks
            chunk = self._chunk(seq, budget, reserve=0)
            if chunk is None:
                continue
            chunks.append(chunk)
            budget -= chunk.end - chunk.start
        while budget > 0 and self._waiting and len(self.running) < self.max_running:
            seq = self._waiting[0][1]
            chunk = self._chunk(seq, budget, reserve=len(self.running))
            if chunk is None:
                break  # head of the queue does not fit: keep FIFO-by-priority order, wait
            heapq.heappop(self._waiting)
            seq.status = SeqStatus.PREFILLING
            self.running.append(seq)
            chunks.append(chunk)
            budget -= chunk.end - chunk.start
        return chunks

    def _chunk(self, seq: Sequence, budget: int, reserve: int) -> PrefillChunk | None:
        start = seq.target_computed
        end = min(seq.prefill_target, start + budget)
        if not (self.target.can_grow(seq.target_blocks, end, reserve)
                and self.draft.can_grow(seq.draft_blocks, end, reserve)):
            return None
        self.target.grow(seq.target_blocks, end)
        self.draft.grow(seq.draft_blocks, end)
        last = end == seq.prefill_target
        return PrefillChunk(seq, start, end, sample_first=last and seq.samples_after_prefill)


class _NoPool:
    """Stands in for the draft BlockManager when the draft lane owns no pool: always room, no blocks."""

    def can_grow(self, blocks: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return True

    def grow(self, blocks: list[int], num_tokens: int) -> None:
        pass

    def free(self, blocks: list[int]) -> None:
        pass

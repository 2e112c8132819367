"""Overlapped plain decoding: step N + 1 is launched while step N runs on the GPU. Torch-free.

(docs/engine.md "Overlapped scheduling"; RuntimeConfig.overlap, `--overlap`.) Without it every
step's host work (commit, stream, plan, layout, launch) runs while the GPU waits for it. With it:

  * the router's regular step launches a plain-decoding verify call N (every request k = 0) and,
    before waiting on it, `follow`s it: the same requests, each one position on, blocks reserved
    ahead (Scheduler.plan_follow), their pending tokens fed on the device from N's output (a
    TokenFeed: the verify lane writes row r of N's chosen tokens into its static input ids, stream-
    ordered after N). Then N's results are waited for and committed as usual;
  * the next `Router.step()` finds N + 1 in flight (`advance`): it launches N + 2 the same way,
    then waits on N + 1 and commits it. So the GPU always has the next step queued, and the one
    wait per step is the device-to-host copy of the results.

Requests N surely finishes (max_tokens, context) are left out of N + 1. One that finishes after the
fact (EOS, a stop string) or is cancelled while a step holding it is in flight keeps its row
(wasted work): its tokens are dropped at commit, and its blocks are held back (`InFlight.held`)
until that step's results are on the host, so no block is handed to another request while a queued
forward may still write it. (Stream order would put that write first anyway; the hold makes it
independent of the stream the next owner writes from.)

A chain goes on only while the next step is certain to be what the scheduler would plan: nothing
waiting or prefilling, every running request in the step, k certainly 0 (Scheduler.plan_follow),
blocks free without preemption, the config still asking for it. Otherwise the step in flight is
committed and the next call is a regular step: speculative steps (k > 0, whose next positions
depend on acceptance), prefills and preemptions take today's path unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verifypd.engine.draft_length import RuntimeConfig
from verifypd.engine.scheduler import DecodeWork
from verifypd.engine.sequence import Sequence, SeqStatus
from verifypd.engine.types import RequestOutput
from verifypd.lanes.interface import KvHandle, TokenFeed, VerifyItem


@dataclass
class InFlight:
    """A plain-decoding verify call launched and not yet committed."""

    work: list[DecodeWork]
    items: list[VerifyItem]
    started: Any                  # the lane's StartedCall; `.next_tokens` feeds the step after it
    dead: set[str] = field(default_factory=set)  # request ids finished meanwhile: rows dropped at commit
    # (target, draft) block tables of dead requests, returned once the results are on the host
    held: list[tuple[list[int], list[int]]] = field(default_factory=list)
    members: set[str] = field(default_factory=set)

    def __post_init__(self):
        self.members = {w.seq.request_id for w in self.work}


class Overlap:
    def __init__(self, router):  # verifypd.engine.router.Router (which imports this module)
        self.router = router
        self.inflight: InFlight | None = None
        self.steps = 0    # steps launched ahead (benchmarks, tests)
        self.dropped = 0  # rows launched for requests that finished meanwhile (wasted work)

    def supported(self) -> bool:
        return getattr(self.router.verify_lane, "feeds_tokens", False)

    def eligible(self, config: RuntimeConfig, work: list[DecodeWork], drafting_ahead: bool) -> bool:
        """May a regular step's verify call of `work` start a chain (plain decoding, lock-step)?"""
        return (config.overlap and bool(work) and not drafting_ahead and self.inflight is None
                and all(w.k == 0 and not w.held for w in work) and self.supported())

    # -- launching --------------------------------------------------------------------------
    def start(self, config: RuntimeConfig, work: list[DecodeWork], items: list[VerifyItem], started) -> None:
        """Called by the regular step right after launching `items`, before waiting on them."""
        self.inflight = self._follow(config, InFlight(work, items, started))

    def _follow(self, config: RuntimeConfig, prev: InFlight) -> InFlight | None:
        """Launches the k = 0 step after `prev` if it is certain to be the scheduler's next plan."""
        router, sched = self.router, self.router.scheduler
        next_tokens = getattr(prev.started, "next_tokens", None)
        if not config.overlap or next_tokens is None or sched.num_waiting:
            return None
        alive = prev.members - prev.dead
        if len(sched.running) != len(alive) or any(
                s.request_id not in alive or s.status is not SeqStatus.DECODING or s.held_draft is not None
                for s in sched.running):
            return None  # something else runs next step (a prefill, a request not in prev)
        rows, seqs = [], []
        for row, w in enumerate(prev.work):
            seq = w.seq
            if seq.request_id in prev.dead or self._finishes(seq):
                continue
            assert seq.pending_pos == prev.items[row].start_pos, "a request moved while its step was in flight"
            rows.append(row)
            seqs.append(seq)
        if not sched.plan_follow(config, router.costs, seqs):
            return None
        pool = router.target_pool
        items = []
        for seq in seqs:
            n = seq.pending_pos + 1  # the position of the token in flight
            items.append(VerifyItem(request_id=seq.request_id, pending_token=0, start_pos=n, draft_tokens=(),
                                    sampling=seq.spec.sampling,
                                    target_kv=KvHandle(pool.pool_id, pool.generation, tuple(seq.target_blocks), n, n)))
        started = router.verify_lane.verify_start(items, feed=TokenFeed(next_tokens, tuple(rows)))
        self.steps += 1
        return InFlight([DecodeWork(s, 0) for s in seqs], items, started)

    def _finishes(self, seq: Sequence) -> bool:
        """The token in flight surely ends `seq` (Router._emit's length checks)."""
        return len(seq.output_ids) + 1 >= seq.spec.max_tokens or seq.num_tokens + 1 >= self.router.max_context

    # -- committing -------------------------------------------------------------------------
    def advance(self, config: RuntimeConfig) -> tuple[list[RequestOutput], float, int]:
        """A `Router.step()` with a step in flight: launch the one after it, then wait on it and
        commit its live rows. Returns (outputs, seconds waited for the results, rows verified)."""
        router, prev = self.router, self.inflight
        try:
            self.inflight = self._follow(config, prev)
        except BaseException:
            self.inflight = None
            self._settle(prev)
            raise
        t0 = router._clock()
        results = self._settle(prev)
        waited = router._clock() - t0
        live = [(w, item, res) for w, item, res in zip(prev.work, prev.items, results)
                if w.seq.request_id not in prev.dead]
        self.dropped += len(prev.items) - len(live)
        outputs: list[RequestOutput] = []
        if live:
            work, items, res = (list(x) for x in zip(*live))
            router._commit_verify(work, items, res, outputs)
        return outputs, waited, len(prev.items)

    def _settle(self, prev: InFlight) -> list:
        """Waits for `prev`'s results, then returns the blocks held back for it (even on an error:
        its forwards are over or never ran)."""
        try:
            return prev.started.result()
        finally:
            for target, draft in prev.held:
                self.router.scheduler.release_tables(target, draft)
            prev.held.clear()

    def on_finish(self, seq: Sequence) -> None:
        """Before `seq`'s blocks are freed (finished, cancelled): if a step in flight holds a row of
        it, the row is dropped at commit and the blocks wait for that step's results."""
        f = self.inflight
        if f is None or seq.request_id not in f.members or seq.request_id in f.dead:
            return
        f.dead.add(seq.request_id)
        f.held.append((seq.target_blocks, seq.draft_blocks))
        seq.target_blocks, seq.draft_blocks = [], []

    def drop(self) -> None:
        """Lane restart (Router.reset_kv): waits out the step in flight, if any, and forgets it; its
        held blocks belong to pools that are being replaced."""
        prev, self.inflight = self.inflight, None
        if prev is None:
            return
        try:
            prev.started.result()
        except Exception:  # the lanes are being reset: its results are of no use either way
            pass

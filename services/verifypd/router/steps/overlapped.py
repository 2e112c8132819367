"""Overlapped scheduling: step N + 1 is launched while step N runs on the GPU. Torch-free.

(docs/engine.md "Overlapped scheduling"; RuntimeConfig.overlap, `--overlap`.) Without it every
step's host work (commit, stream, plan, layout, launch) runs while the GPU waits for it. With it:

  * a regular (lock-step) step launches a plain-decoding verify call N (every request k = 0) and,
    before waiting on it, `follow`s it: the same requests, each one position on, blocks reserved
    ahead (plan_ahead.plan_follow), their pending tokens fed on the device from N's output (a
    TokenFeed: the verify lane writes row r of N's chosen tokens into its static input ids, stream-
    ordered after N). Then N's results are waited for and committed as usual;
  * the next `Router.step()` finds N + 1 in flight (`step`): it launches N + 2 the same way,
    then waits on N + 1 and commits it. So the GPU always has the next step queued, and the one
    wait per step is the device-to-host copy of the results.

Arrivals go on in the chain (a served closed loop admits a request nearly every step): when
requests wait that `plan` would admit now (plan_ahead.admit_follow: priorities, token budget, max
running, block reserve), N + 1 carries their prefill, started beside its verify call as a regular
step starts it (after it on the lanes' streams). The in-flight record holds the started prefill
and its chunks; they are committed with N + 1 (first tokens streamed then, as a regular step
would). The admitted requests join N + 2 at once: their pending (first) token is read on the
device from the prefill's sampled first tokens, a second source of N + 2's TokenFeed (rows after
N + 1's). So an arrival costs no step of decoding and the chain does not break.

Requests N surely finishes (max_tokens, context; a joining request with max_tokens 1) are left out
of N + 1. One that finishes after the fact (EOS, a stop string, also at its first token) or is
cancelled while a step holding it is in flight keeps its row (wasted work), or its prefill chunk
if that is in flight: its tokens are dropped at commit, and its blocks are held back
(`InFlight.held`) until that step's results are on the host, so no block is handed to another
request while a queued forward may still write it. (Stream order would put that write first
anyway; the hold makes it independent of the stream the next owner writes from.)

A chain goes on only while the next step is certain to be what the scheduler would plan: every
running request in the step (or joining it), k certainly 0 (plan_ahead.plan_follow), blocks free
without preemption, the config still asking for it, and no waiting request that only a regular
step can start (plan_ahead.follow_blocked: a prompt longer than the prefill budget, chunked; a
recompute after preemption). Otherwise the step in flight is committed and the next call is a
regular step: speculative steps (k > 0, whose next positions depend on acceptance), chunked
prefills, preemptions, pipelined pdv and tensor-parallel targets take today's path unchanged.
`steps` / `admitting` count the steps launched ahead (with a prefill beside), `breaks` why a chain
ended (telemetry exports them: verifypd.engine.chained_steps).

Split topology (lanes in other processes, lanes/rpc/call_pipeline.py): N + 1 goes over the verify
lane's call channel before N's reply, fed by reference to N's tokens on that lane's device. Arrivals
are prefilled beside a chained step N + 1 on the prefill lane, whose first tokens reach this process
only when N + 1 is committed, after N + 2 was launched: they join N + 3 (`InFlight.late`), their
pending tokens sent from the host (HostTokens, the feed's last source) beside the fed rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verifypd.domain.lanes import HostTokens, TokenFeed, VerifyItem, feeds_host_tokens, feeds_tokens
from verifypd.domain.requests import RequestOutput
from verifypd.router.lane_items import kv_handle
from verifypd.router.plan_ahead import admit_follow, follow_blocked, join_now, plan_follow
from verifypd.router.prefill_calls import BesidePrefill, StartedPrefill, start_prefill
from verifypd.router.sequence import SeqStatus, Sequence
from verifypd.router.step_context import StepContext
from verifypd.router.step_plan import DecodeWork, PrefillChunk
from verifypd.router.steps import StepResult


@dataclass
class InFlight:
    """A plain-decoding verify call launched and not yet committed, with the prefill of the requests
    it admitted (started beside it) if any."""

    work: list[DecodeWork]
    items: list[VerifyItem]
    started: Any  # the lane's StartedCall; `.next_tokens` feeds the step after it
    prefill: list[PrefillChunk] = field(default_factory=list)  # whole prompts, each samples its first token
    prefill_started: StartedPrefill | None = None  # of `prefill`; `.next_tokens`: first tokens
    # Admitted requests prefilled just before this step's verify call, which decodes them (their first
    # token fed from the prefill on the device): (chunks, StartedPrefill), committed with the step
    # before this one, in the same Router.step() call (Overlapped.step), so no TTFT is lost.
    ahead: tuple[list[PrefillChunk], StartedPrefill] | None = None
    # Split (a prefill lane in another process): the requests prefilled beside the step before this
    # one, whose first tokens reached this process only when that step was committed, after this one
    # was launched: they join the step after this one, their pending tokens sent from the host (HostTokens).
    late: list[Sequence] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)  # request ids finished meanwhile: rows dropped at commit
    # (target, draft) block tables of dead requests, returned once the results are on the host
    held: list[tuple[list[int], list[int]]] = field(default_factory=list)
    members: set[str] = field(default_factory=set)  # the verify call's requests
    admitted: set[str] = field(default_factory=set)  # the prefill's requests

    def __post_init__(self):
        self.members = {w.seq.request_id for w in self.work}
        self.admitted = {c.seq.request_id for c in self.prefill}


class Overlapped:
    """Chains of plain-decoding steps, each launched before the one before it is committed."""

    def __init__(self) -> None:
        self.inflight: InFlight | None = None
        self.steps = 0  # steps launched ahead (benchmarks, tests, telemetry)
        self.admitting = 0  # of those, steps that carried a prefill of admitted requests
        self.joined = 0  # requests that decoded in the step right after their prefill, fed on the device
        self.dropped = 0  # rows launched for requests that finished meanwhile (wasted work)
        self.breaks: dict[str, int] = {}  # why a chain ended: running, waiting, plan, off
        # Host seconds the last `step` spent launching and committing prefills of arrivals: not
        # part of the plain step's cost the router records (the draft-length policy compares with it).
        self.prefill_s = 0.0

    def can_run(self, ctx: StepContext) -> bool:
        """A chained step is in flight: this step launches the next one and commits it."""
        return self.inflight is not None

    @staticmethod
    def supported(ctx: StepContext) -> bool:
        return feeds_tokens(ctx.verify_lane)

    def eligible(self, ctx: StepContext, work: list[DecodeWork], drafting_ahead: bool) -> bool:
        """May a regular step's verify call of `work` start a chain (plain decoding, lock-step)?"""
        return (
            ctx.config.overlap
            and bool(work)
            and not drafting_ahead
            and self.inflight is None
            and all(w.k == 0 and not w.held for w in work)
            # sampling controls, logprobs and structured output need the host's history at every launch
            and all(w.seq.spec.plain for w in work)
            and self.supported(ctx)
        )

    # -- launching --------------------------------------------------------------------------
    def start(
        self,
        ctx: StepContext,
        work: list[DecodeWork],
        items: list[VerifyItem],
        started,
        beside: BesidePrefill | None = None,
    ) -> None:
        """Called by the regular step right after launching `items` (and `beside`, its prefill started
        beside them), before waiting on them; the regular step commits them."""
        prefill = (beside.chunks, beside.started) if beside is not None else ([], None)
        # Its arrivals join beside (not ahead): the regular step commits its own calls, not a
        # prefill launched ahead of the step it starts (only `step` commits those).
        self.inflight = self._follow(ctx, InFlight(work, items, started, *prefill), ahead_ok=False)

    def _broken(self, reason: str) -> None:
        """Counts why a chain ended (`breaks`)."""
        self.breaks[reason] = self.breaks.get(reason, 0) + 1

    @staticmethod
    def _admits(ctx: StepContext) -> bool:
        """May a chained step start a prefill beside its verify call, as a regular step would?"""
        config, lane = ctx.config, ctx.prefill_lane
        return (
            ctx.overlap_prefill
            and config.priorities.prefill <= config.priorities.verify
            and hasattr(lane, "prefill_start")
            # a remote prefill's first tokens come to the host: they join a step later (InFlight.late)
            and (not getattr(lane, "remote", False) or feeds_host_tokens(ctx.verify_lane))
        )

    def _follow(self, ctx: StepContext, prev: InFlight, ahead_ok: bool = True) -> InFlight | None:
        """Launches the k = 0 step after `prev` (and the prefill of requests it admits) if it is
        certain to be the scheduler's next plan."""
        config, sched, lane = ctx.config, ctx.scheduler, ctx.verify_lane
        next_tokens = getattr(prev.started, "next_tokens", None)
        if not config.overlap or next_tokens is None or not feeds_tokens(lane):  # (chains start where it feeds)
            self._broken("off")
            return None
        if any(not c.sample_first for c in prev.prefill):  # part of a long prompt, a recompute
            self._broken("running")
            return None
        joining = [(j, c.seq) for j, c in enumerate(prev.prefill) if c.seq.request_id not in prev.dead]
        first_tokens = prev.prefill_started.next_tokens if joining and prev.prefill_started is not None else None
        late: list[Sequence] = []  # joiners of the step after this one (their first tokens come to the host)
        if joining and first_tokens is None:
            # a prefill lane that leaves no first tokens on the device (a request that is not plain:
            # sampling controls, logprobs, structured output; no chained step may hold it either)
            if not feeds_host_tokens(lane) or not all(seq.spec.plain for _, seq in joining):
                self._broken("off")
                return None
            late, joining = [seq for _, seq in joining], []
        # prev's late joiners: their prefill was committed with the step before prev; first token on the host
        hosted = [s for s in prev.late if s.status is SeqStatus.DECODING]
        alive, joiners = prev.members - prev.dead, {seq.request_id for _, seq in joining}
        joiners |= {seq.request_id for seq in late}
        hosted_ids = {s.request_id for s in hosted}
        if len(sched.running) != len(alive) + len(joiners) + len(hosted) or any(
            s.held_draft is not None
            or not (
                s.status is SeqStatus.DECODING
                and (s.request_id in alive or s.request_id in hosted_ids)
                or s.status is SeqStatus.PREFILLING
                and s.request_id in joiners
            )
            for s in sched.running
        ):
            self._broken("running")  # something else runs next step (a chunked prefill, ...)
            return None
        if sched.num_waiting and follow_blocked(sched, config) or sched.num_waiting and not self._admits(ctx):
            self._broken("waiting")
            return None
        rows, seqs = [], []
        for row, w in enumerate(prev.work):
            seq = w.seq
            if seq.request_id in prev.dead or self._finishes(ctx, seq):
                continue
            assert seq.pending_pos == prev.items[row].start_pos, "a request moved while its step was in flight"
            rows.append(row)
            seqs.append(seq)
        for j, seq in joining:  # first token in flight: row j of the prefill's, after prev's rows
            if self._finishes(ctx, seq):
                continue
            assert seq.pending_pos == prev.prefill[j].end - 1, "a request moved while its prefill was in flight"
            rows.append(len(prev.items) + j)
            seqs.append(seq)
        if not plan_follow(sched, config, ctx.costs, seqs + hosted):
            self._broken("plan")
            return None
        chunks = admit_follow(sched, config, ctx.costs) if sched.num_waiting else []
        sources = [next_tokens, first_tokens] if joining else [next_tokens]
        ahead = None
        # (a request that is not plain, RequestSpec.plain, gets no first token to feed: beside, not ahead;
        # nor one a remote prefill lane admits: its first token comes to the host)
        plain = all(c.seq.spec.plain for c in chunks) and not getattr(ctx.prefill_lane, "remote", False)
        if chunks and ahead_ok and plain and join_now(sched, config, chunks):
            offset = len(prev.items) + (len(prev.prefill) if joining else 0)  # rows of the sources before it
            ahead = self._prefill_ahead(ctx, chunks, offset, rows, seqs, sources)
            chunks = []
        in_flight = len(seqs)  # with a token in flight; the `hosted` after them have theirs on the host
        if hosted:  # the last source: their pending tokens, from the host
            offset = len(prev.items) + (len(prev.prefill) if joining else 0) + (len(ahead[0]) if ahead else 0)
            rows += [offset + i for i in range(len(hosted))]
            seqs += hosted
            sources.append(HostTokens(s.ids(s.pending_pos, s.pending_pos + 1)[0] for s in hosted))
        pool = ctx.target_pool
        items = []
        for i, seq in enumerate(seqs):
            n = seq.pending_pos + (1 if i < in_flight else 0)  # the position of its pending token
            items.append(
                VerifyItem(
                    request_id=seq.request_id,
                    pending_token=0,
                    start_pos=n,
                    draft_tokens=(),
                    sampling=seq.spec.sampling,
                    target_kv=kv_handle(pool, seq.target_blocks, n, n, seq.target_freed),
                )
            )
        try:
            started = lane.verify_start(items, feed=TokenFeed(tuple(sources), tuple(rows)))
        except BaseException:
            if ahead is not None:
                self._wait_quietly(ahead[1])
            raise
        prefill_started = None
        if ahead is not None:
            self.admitting += 1
        if chunks:
            try:  # beside the verify call, as a regular step's `beside`
                prefill_started = start_prefill(ctx, chunks)
                self.prefill_s += prefill_started.launch_s
            except BaseException:
                self._wait_quietly(started)
                raise
            self.admitting += 1
        self.steps += 1
        self.joined += sum(row >= len(prev.items) for row in rows)
        flight = InFlight([DecodeWork(s, 0) for s in seqs], items, started, chunks, prefill_started, ahead=ahead)
        flight.late = late
        return flight

    def _prefill_ahead(
        self,
        ctx: StepContext,
        chunks: list[PrefillChunk],
        offset: int,
        rows: list[int],
        seqs: list[Sequence],
        sources: list,
    ) -> tuple[list[PrefillChunk], StartedPrefill]:
        """Starts the admitted requests' prefill ahead of the verify call that decodes them too (adds
        their rows, from `offset` on, and the prefill's first tokens as the feed's next source): the
        verify stream waits for the prefill's (LocalVerifyLane: on_stream). Committed with the step
        before (`InFlight.ahead`, Overlapped.step)."""
        started = start_prefill(ctx, chunks)
        if started.next_tokens is None:
            self._wait_quietly(started)
            raise RuntimeError("a prefill lane that samples every item left no first tokens on the device")
        for j, c in enumerate(chunks):
            if not self._finishes(ctx, c.seq):
                rows.append(offset + j)
                seqs.append(c.seq)
        sources.append(started.next_tokens)
        return chunks, started

    @staticmethod
    def _finishes(ctx: StepContext, seq: Sequence) -> bool:
        """The token in flight surely ends `seq` (the length checks of StepContext.emit)."""
        return len(seq.output_ids) + 1 >= seq.spec.max_tokens or seq.num_tokens + 1 >= ctx.max_context

    # -- committing -------------------------------------------------------------------------
    def step(self, ctx: StepContext) -> StepResult:
        """A `Router.step()` with a step in flight: launch the one after it, then wait on it and
        commit its live rows (then its prefill's live chunks: first tokens). Its cost is a plain
        step's of its rows, without the host work of arrivals' prefills (`prefill_s`)."""
        prev = self.inflight
        assert prev is not None, "no chained step in flight"
        self.prefill_s = 0.0
        try:
            self.inflight = self._follow(ctx, prev)
        except BaseException:
            self.inflight = None
            self._settle(ctx, prev)
            raise
        ahead, next_step = None, self.inflight
        if next_step is not None and next_step.ahead is not None:
            ahead, next_step.ahead = next_step.ahead, None
        try:
            outputs, waited = self._commit(ctx, prev)
        except BaseException:
            if ahead is not None:  # no call left in flight behind the error
                self._wait_quietly(ahead[1])
            raise
        if ahead is not None:  # first tokens of the requests the new step decodes already
            chunks, started = ahead
            t0 = ctx.clock()
            results, seconds = started.result()
            ctx.observer.on_lane_step("prefill", seconds, len(chunks))
            outputs += ctx.commit_prefill(chunks, results)
            self.prefill_s += started.launch_s + ctx.clock() - t0
        rows = len(prev.items)
        ctx.observer.on_lane_step("verify", waited, rows)
        return StepResult(outputs, (False, rows, 0), excluded=(self.prefill_s,))

    def _commit(self, ctx: StepContext, prev: InFlight) -> tuple[list[RequestOutput], float]:
        """Waits for `prev` and commits its live rows, then its prefill's live chunks (first tokens)."""
        results, prefilled, waited = self._settle(ctx, prev)
        live = [
            (w, item, res)
            for w, item, res in zip(prev.work, prev.items, results, strict=False)
            if w.seq.request_id not in prev.dead
        ]
        self.dropped += len(prev.items) - len(live)
        outputs: list[RequestOutput] = []
        if live:
            work, items, res = (list(x) for x in zip(*live, strict=False))
            ctx.commit_verify(work, items, res, outputs)
        if prefilled is not None:
            t0 = ctx.clock()
            results, seconds = prefilled
            ctx.observer.on_lane_step("prefill", seconds, len(prev.prefill))
            kept = [
                (c, res) for c, res in zip(prev.prefill, results, strict=False) if c.seq.request_id not in prev.dead
            ]
            if kept:
                outputs += ctx.commit_prefill(*(list(x) for x in zip(*kept, strict=False)))
            self.prefill_s += ctx.clock() - t0
        return outputs, waited

    def _settle(self, ctx: StepContext, prev: InFlight) -> tuple[list, tuple[list, float] | None, float]:
        """Waits for `prev`'s results (verify, then its prefill's), then returns the blocks held back
        for it (even on an error: its forwards are over or never ran). Returns (verify results,
        (prefill results, seconds) or None, seconds waited for the verify results)."""
        t0 = ctx.clock()
        try:
            results = prev.started.result()
            waited = ctx.clock() - t0
        finally:
            try:
                prefilled = None
                if prev.prefill_started is not None:  # (no clock reads in the chain's usual step)
                    t0 = ctx.clock()
                    prefilled = prev.prefill_started.result()
                    self.prefill_s += ctx.clock() - t0
            finally:
                for target, draft in prev.held:
                    ctx.scheduler.blocks.release_tables(target, draft)
                prev.held.clear()
        return results, prefilled, waited

    def on_finish(self, seq: Sequence) -> None:
        """Before `seq`'s blocks are freed (finished, cancelled): if a step in flight holds a row of
        it (or its prefill), the row is dropped at commit and the blocks wait for that step's results."""
        f = self.inflight
        rid = seq.request_id
        if f is None or rid not in f.members and rid not in f.admitted or rid in f.dead:
            return
        f.dead.add(rid)
        f.held.append((seq.target_blocks, seq.draft_blocks))
        seq.target_blocks, seq.draft_blocks = [], []

    def drop(self) -> None:
        """Lane restart (Router.reset_kv): waits out the step in flight, if any, and forgets it; its
        held blocks belong to pools that are being replaced."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self._wait_quietly(prev.started)
            for started in (prev.prefill_started, prev.ahead[1] if prev.ahead else None):
                if started is not None:
                    self._wait_quietly(started)

    @staticmethod
    def _wait_quietly(started) -> None:
        try:
            started.result()
        except Exception:  # the lanes are being reset (or failed): its results are of no use either way
            pass

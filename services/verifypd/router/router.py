"""The router: owns every request's state and runs the speculative loop over the three lanes.

Torch-free. One `step()` = plan (scheduler) -> lane calls in lane-priority order -> commit the
lanes' results into sequence state -> stream outputs. The schedule (RuntimeConfig.schedule, see
docs/engine.md "Schedules") is a policy over the same lanes: baseline and pd steps are lock-step
(draft, then verify of the same requests); a pipelined pdv step runs the draft call of one group
and the verify call of the other concurrently (the draft call on a worker thread). With in-process
CUDA lanes a lock-step step's prefill call is launched while the GPU runs its verify call, so the
prefill's host work hides under decode's GPU work. Losslessness lives in the verify lane's
acceptance rule; the router's job is the bookkeeping that keeps KV positions and tokens aligned
(see `verifypd.router.sequence` for the layout invariant).
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.lanes import (
    DraftItem,
    DraftLane,
    KvHandle,
    LaneError,
    PoolInfo,
    PrefillLane,
    VerifyItem,
    VerifyLane,
)
from verifypd.domain.requests import FinishReason, InvalidRequest, RequestOutput, RequestSpec, RequestStats
from verifypd.router.block_manager import BlockManager, check_fits
from verifypd.router.detokenize import Decode, IncrementalDetokenizer
from verifypd.router.draft_after import DraftAfter, held_after
from verifypd.router.draft_length import TYPICAL_DRAFT_INPUT, StepCostModel
from verifypd.router.overlap import Overlap
from verifypd.router.router_calls import BesidePrefill, append_tokens, record_verdict, take_drafts
from verifypd.router.router_calls import pool_of as _pool
from verifypd.router.router_prefill import PrefillCalls
from verifypd.router.scheduler import DecodeWork, Scheduler
from verifypd.router.sequence import HeldDraft, SeqStatus, Sequence
from verifypd.router.spec_ahead import SpecAhead
from verifypd.spec_decode.lookup_mix import LookupMix

# Diagnostics only: VERIFYPD_SERIAL_PIPELINE=1 keeps pdv's groups and held drafts but makes the
# draft call after the verify call instead of beside it (tells a concurrency fault from the rest).
SERIAL_PIPELINE = os.environ.get("VERIFYPD_SERIAL_PIPELINE") == "1"


class EngineObserver:
    """Telemetry hooks; the default does nothing. Implemented by verifypd.telemetry."""

    def on_lane_step(self, lane: str, seconds: float, batch: int) -> None: ...
    def on_verify(self, k: int, accepted: int) -> None: ...
    def on_request_finished(self, seq: Sequence) -> None: ...
    def on_step(self, router: Router) -> None: ...
    def on_idle(self, router: Router) -> None: ...  # state changed without a step (abort, idle, reset)


class Router(PrefillCalls):
    def __init__(
        self,
        prefill: PrefillLane,
        draft: DraftLane,
        verify: VerifyLane,
        *,
        decode: Decode | None,
        eos_token_ids: Seq[int],
        config: RuntimeConfig | None = None,
        max_running: int = 256,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        lookup: LookupMix | None = None,
    ):
        self.prefill_lane, self.draft_lane, self.verify_lane = prefill, draft, verify
        # Lanes that keep per-request state for the router (the call channel's request keys and
        # block tables) are told when a request is done.
        self._releasing = [lane for lane in (prefill, draft, verify) if hasattr(lane, "release")]
        verify_info, draft_info = verify.describe(), draft.describe()
        self.target_pool = _pool(verify_info.pools, "target")
        # None: a pool-less draft lane (prompt lookup, none): no draft blocks, no draft KV in prefill.
        self.draft_pool = _pool(draft_info.pools, "draft", required=False)
        self.feature_draft = draft_info.reads_features  # see LaneInfo.reads_features
        self.lookup = lookup  # a feature draft mixed with prompt lookup (engine.lookup_mix)
        self.vocab_size = verify_info.vocab_size
        self.max_context = verify_info.max_context
        self.target_blocks = BlockManager(self.target_pool.num_blocks, self.target_pool.block_size, "target")
        self.draft_blocks = (
            BlockManager(self.draft_pool.num_blocks, self.draft_pool.block_size, "draft") if self.draft_pool else None
        )
        self.scheduler = Scheduler(
            self.target_blocks,
            self.draft_blocks,
            self.max_context,
            max_running,
            lazy_draft_prefill=self._lazy_draft_prefill(),
            never_drafts=self._never_drafts(),
        )
        self.config = config or RuntimeConfig()
        self.config.validate()
        self.costs = StepCostModel()
        self.observer = observer or EngineObserver()
        self._decode = decode
        self._eos = frozenset(eos_token_ids)
        self._clock = clock
        # Prefill beside decode (docs/engine.md): with lanes whose calls start asynchronously, a
        # step's prefill is launched while the GPU runs its verify call. Off only to measure it.
        self.overlap_prefill = True
        self._arrivals = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pool: ThreadPoolExecutor | None = None  # pdv: runs the draft call beside the verify call
        self.overlap = Overlap(self)  # plain-decoding steps launched ahead (RuntimeConfig.overlap, engine.overlap)
        self.draft_after = DraftAfter(self)  # speculative steps' next drafts launched before the verdict
        self.ahead = SpecAhead(self)  # speculative steps launched before the step before them streams
        self._prefill_pool: ThreadPoolExecutor | None = None  # pdv over lane processes: prefill beside decode

    def close(self) -> None:
        """Stops the pipelining worker thread (if one was started); the router stays usable."""
        pools, self._pool, self._prefill_pool = (self._pool, self._prefill_pool), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, spec: RequestSpec) -> str:
        spec.validate(vocab_size=self.vocab_size, max_context=self.max_context)
        check_fits(spec, self.max_context, [b for b in (self.target_blocks, self.draft_blocks) if b is not None])
        request_id = spec.request_id or uuid.uuid4().hex
        if request_id in self._seqs:
            raise InvalidRequest(f"request_id {request_id!r} is already in flight; use a unique id")
        stats = RequestStats(prompt_tokens=len(spec.prompt_ids), arrival_time=self._clock())
        seq = Sequence(spec=spec, request_id=request_id, arrival_order=next(self._arrivals), stats=stats)
        self._seqs[request_id] = seq
        if self._decode is not None:  # None: the front end detokenizes and applies stop strings
            self._detok[request_id] = IncrementalDetokenizer(self._decode, spec.prompt_ids, spec.stop)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels a request; its blocks return to the pools immediately."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        out = self._finish(seq, FinishReason.CANCELLED, [], "")
        self.refresh_gauges()  # gauges (blocks in use, queues) must not keep the old load
        return out

    def refresh_gauges(self) -> None:
        """Tells the observer the state changed without a step (so step counters stay steps)."""
        hook = getattr(self.observer, "on_idle", None)
        if hook is not None:
            hook(self)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.overlap.inflight is not None or self.ahead.inflight is not None

    def sequences(self) -> list[Sequence]:
        return list(self._seqs.values())

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        config = self.config  # one config per step; UpdateConfig takes effect on the next one
        t_step = self._clock()
        if self.overlap.inflight is not None:  # launch the next plain step, commit the one in flight
            outputs, waited, rows = self.overlap.advance(config)
            self.observer.on_lane_step("verify", waited, rows)
            self.observer.on_step(self)
            self._record_cost((False, rows, 0), self._clock() - t_step - self.overlap.prefill_s)
            return outputs
        if self.ahead.inflight is not None:  # commit the speculative step launched ahead (and launch the next)
            outputs, sample = self.ahead.advance()
            self.observer.on_step(self)
            if sample is not None:
                self._record_cost(sample, self._clock() - t_step)
            return outputs
        plan = self.ahead.take_plan() or self.scheduler.plan(config, self.costs)
        outputs = [self._finish(seq, FinishReason.LENGTH, [], "") for seq in plan.out_of_room]
        # pd and pdv: decode is high priority, prefill after it (unless priorities say otherwise).
        prefill_first = config.priorities.prefill > config.priorities.verify
        # Pipelined pdv over lane processes: the prefill call (other requests, other blocks) goes out
        # beside the decode calls instead of after them; its results are committed after decode's.
        pending = None
        if (
            plan.prefill
            and (plan.decode or plan.draft_ahead)
            and config.pipelined
            and getattr(self.prefill_lane, "remote", False)
        ):
            if self._prefill_pool is None:
                self._prefill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifypd-prefill")
            pending = self._prefill_pool.submit(self._call_prefill, self._prefill_items(plan.prefill))
        beside = None  # in-process: the prefill call starts while the verify call runs on the GPU
        if (
            plan.prefill
            and plan.decode
            and not plan.draft_ahead
            and pending is None
            and not prefill_first
            and self.overlap_prefill
            and self._starts_async(self.verify_lane, self.prefill_lane)
        ):
            beside = BesidePrefill(plan.prefill)
        serial_prefill_s = 0.0  # prefill run before or after decode, not beside it
        try:
            if prefill_first and pending is None:
                t0 = self._clock()
                outputs += self._run_prefill(plan.prefill)
                serial_prefill_s += self._clock() - t0
            try:
                sample = self._run_decode(plan.decode, plan.draft_ahead, outputs, beside)
            except BaseException:
                if pending is not None:  # no call left in flight behind the error
                    wait_for_futures([pending])
                raise
            if pending is not None or not prefill_first:
                t0 = self._clock()
                outputs += self._run_prefill(plan.prefill, pending or (beside.started if beside else None))
                if pending is None:
                    serial_prefill_s += self._clock() - t0
        except BaseException as exc:
            # Tokens committed before the failing call are already in the sequences: hand their
            # chunks to the caller with the error, or the client's stream would skip them.
            if isinstance(exc, LaneError):
                exc.outputs = outputs
            raise
        self.observer.on_step(self)
        if sample is not None:
            # Whole-step cost: planning, the lane calls, committing and the observer, without a
            # prefill that ran before or after decode. Host work per step is what a pipelined step
            # (half the batch verified) pays twice per token as often as a lock-step one. Nor the
            # launch of a prefill beside the verify call: 16 prompts' launch (~0.9 ms, H200) once
            # made a plain step at 16 requests cost 1.8 ms instead of ~1.0, and speculation that
            # ran at 0.7 x plain decoding looked like a gain (session 31).
            seconds = self._clock() - t_step - serial_prefill_s - self._beside_s
            if (
                sample[2] == 0
                and not sample[0]
                and (not plan.prefill or beside is not None)
                and config.overlap
                and self.overlap.supported()
            ):
                seconds = min(seconds, self._verify_s)  # chained, its host work hides behind the GPU's
            self._record_cost(sample, seconds)
        return outputs

    def _record_cost(self, sample: tuple[bool, int, int], seconds: float) -> None:
        pipelined, verified, k = sample
        if pipelined:
            self.costs.observe_pipelined(verified, k, seconds)
        else:
            self.costs.observe_step(verified, k, seconds)

    def reset_kv(self) -> int:
        """After a lane restart: re-reads the lanes' pools (new pool ids / generations), forgets all
        KV and re-queues every request for recompute (the preemption path). Tokens already emitted
        are kept, so a request continues where its stream stopped. Returns the requests re-queued."""
        self.overlap.drop()
        self.ahead.drop()
        verify_info, draft_info = self.verify_lane.describe(), self.draft_lane.describe()
        self.target_pool = _pool(verify_info.pools, "target")
        self.draft_pool = _pool(draft_info.pools, "draft", required=False)  # None: pool-less draft lane
        seqs = sorted(self.scheduler.all_sequences(), key=Sequence.sort_key)
        self.target_blocks = BlockManager(self.target_pool.num_blocks, self.target_pool.block_size, "target")
        self.draft_blocks = (
            BlockManager(self.draft_pool.num_blocks, self.draft_pool.block_size, "draft") if self.draft_pool else None
        )
        self.scheduler = Scheduler(
            self.target_blocks,
            self.draft_blocks,
            self.max_context,
            self.scheduler.max_running,
            lazy_draft_prefill=self._lazy_draft_prefill(),
            never_drafts=self._never_drafts(),
        )
        for seq in seqs:  # the old block tables point into pools that are gone: drop, don't free
            seq.target_blocks.clear()
            seq.draft_blocks.clear()
            if seq.status is not SeqStatus.WAITING:
                seq.reset_for_recompute()
            self.scheduler.add(seq)
        self.refresh_gauges()
        return len(seqs)

    def _lazy_draft_prefill(self) -> bool:
        """Prefill may skip a model draft's KV while nobody drafts (Scheduler.drafts_soon): in-process lanes."""
        return (
            self.draft_pool is not None
            and not self.feature_draft
            and getattr(self.prefill_lane, "per_item_draft_kv", False)
        )  # the lane RPC sends all or none

    def _never_drafts(self) -> bool:
        """`--draft none` (lanes/ngram.NoDraftLane) proposes nothing: k is 0, whatever the policy says."""
        return self.draft_lane.describe().draft_model == "none"

    @staticmethod
    def _starts_async(*lanes) -> bool:
        return all(getattr(lane, "starts_async", False) for lane in lanes)

    def _draft_items(self, work: list[DecodeWork]) -> list[DraftItem]:
        items = []
        for w in work:
            seq, n = w.seq, w.seq.pending_pos
            items.append(
                DraftItem(
                    request_id=seq.request_id,
                    input_tokens=seq.ids(seq.draft_computed, n + 1),
                    start_pos=seq.draft_computed,
                    k=w.k,
                    sampling=seq.spec.sampling,
                    draft_kv=self._draft_handle(seq, seq.draft_computed, seq.draft_computed),
                    target_kv=self._handle(
                        self.target_pool, seq.target_blocks, seq.target_computed, seq.target_computed
                    )
                    if self.feature_draft
                    else None,
                )
            )
        return items

    def _call_draft(self, items: list[DraftItem]) -> tuple[list, float]:
        t0 = self._clock()
        results = self.draft_lane.draft(items)
        return results, self._clock() - t0

    def _typical_draft(self, items: list[DraftItem]) -> bool:
        """A draft call worth costing: no long catch-up on tokens decoded without drafting (an eager
        draft prefill); a pool-less lane (prompt lookup) catches up by appending host tokens. A
        feature draft is re-fed every accepted token of the last step: up to k_max + 1 is typical."""
        limit = self.config.k_max + 1 if self.feature_draft else TYPICAL_DRAFT_INPUT
        return self.draft_pool is None or max(len(i.input_tokens) for i in items) <= limit

    def _proposals(self, work: list[DecodeWork]) -> tuple[dict[str, tuple[object, object]], bool]:
        """This step's proposals of `work`'s requests that draft now (k > 0, no held drafts, or held
        ones made after the last verify call that prompt lookup replaces), by request id; and whether
        the step is a typical cost sample (no long draft catch-up, no probe of part of the batch)."""
        drafting = [w for w in work if w.k > 0 and not w.held]
        drafts: dict[str, tuple[object, object]] = {}
        typical = True
        looking = drafting + [w for w in work if w.held and held_after(w.seq)]  # (engine.draft_after)
        if self.lookup is not None and looking:
            # Steps mixing lookup's proposals with the head's (or lookup's alone, no draft call) are
            # cost samples too: the policy's k then weighs what this mix costs as it runs.
            drafts = {rid: (tokens, None) for rid, tokens in self.lookup.take(looking).items()}
            for w in looking:
                w.lookup = w.seq.request_id in drafts
            drafting = [w for w in drafting if not w.lookup]
        if drafting:
            items = self._draft_items(drafting)
            results, draft_s = self._call_draft(items)
            drafts.update(take_drafts(drafting, results))
            self.observer.on_lane_step("draft", draft_s, len(items))
            typical = self._typical_draft(items)
            # A probe drafting for part of the batch costs less than a k = 1 step of all of it.
            typical = typical and sum(w.probe for w in work) in (0, len(work))
        return drafts, typical

    def _verify_items(self, work: list[DecodeWork], drafts: dict, typical: bool) -> tuple[list[VerifyItem], bool]:
        items = []
        for w in work:
            seq, n = w.seq, w.seq.pending_pos
            if w.held:
                held = seq.held_draft
                assert held is not None and held.start_pos == n and len(held.tokens) == w.k, "held drafts out of step"
                tokens, probs = drafts[seq.request_id] if w.lookup else (held.tokens, held.probs)
                typical = typical and held.typical
            else:
                tokens, probs = drafts.get(seq.request_id, ((), None))
            items.append(
                VerifyItem(
                    request_id=seq.request_id,
                    pending_token=seq.ids(n, n + 1)[0],
                    start_pos=n,
                    draft_tokens=tokens,
                    draft_probs=probs,
                    sampling=seq.spec.sampling,
                    target_kv=self._handle(self.target_pool, seq.target_blocks, n, seq.target_computed),
                )
            )
        return items, typical

    def _launch_after(self, work: list[DecodeWork], items: list[VerifyItem], started):
        """Right after the verify call of `items` (`started`): the next step's drafts (engine.draft_after).
        Returns (draft_after.Launched or None, host seconds spent)."""
        t0 = self._clock()
        launched = self.draft_after.launch(self.config, work, items, started)
        seconds = self._clock() - t0
        if launched is not None:
            self.observer.on_lane_step("draft", seconds, len(launched.work))
            self.ahead.fit_next(self.config, launched, work, items, started)  # their verify call, fitted
        return launched, seconds

    def _run_decode(
        self,
        work: list[DecodeWork],
        ahead: list[DecodeWork],
        outputs: list[RequestOutput],
        beside: BesidePrefill | None = None,
    ) -> tuple[bool, int, int] | None:
        """Lock-step: draft `work` (those with k > 0 and no held drafts), then verify `work`;
        `beside` (lock-step only): its prefill is started once the verify call is queued, before its
        results (and with it a chain may start: the prefilled requests then join the next step).
        Pipelined (`ahead` non-empty): draft `ahead` on the worker thread while verifying `work`
        (held drafts or k = 0) here; `ahead`'s drafts are held until the next step verifies them.
        Returns what the step's cost describes, (pipelined, requests verified, k), or None for a
        step not worth learning from (see StepCostModel)."""
        if not work and not ahead:
            return None
        drafts, typical = self._proposals(work)
        ahead_items = self._draft_items(ahead)
        ahead_typical = not ahead_items or self._typical_draft(ahead_items)
        future = None
        if ahead_items and work and not SERIAL_PIPELINE:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifypd-draft")
            future = self._pool.submit(self._call_draft, ahead_items)
        items, typical = self._verify_items(work, drafts, typical)
        results, verify_error, verify_s, beside_s, launched, after_s = None, None, 0.0, 0.0, None, 0.0
        if items:
            t0 = self._clock()
            after = not ahead_items and self.draft_after.eligible(self.config, items)
            try:
                if beside is not None or after:
                    started = self.verify_lane.verify_start(items)
                    if after:  # the next step's drafts, fitted to this call's verdict on the device
                        launched, after_s = self._launch_after(work, items, started)
                if beside is not None:
                    t_beside = self._clock()
                    beside.started = self._start_prefill(beside.chunks)
                    if self.overlap.eligible(self.config, work, bool(ahead_items)):
                        self.overlap.start(self.config, work, items, started, beside)
                    beside_s = self._clock() - t_beside  # the prefill's launch: not the verify lane's time
                    # Verify already done: the step waited on the prefill's launch; not its cost.
                    typical = typical and not started.ready()
                    results = started.result()
                elif after:
                    results = started.result()
                elif self.overlap.eligible(self.config, work, bool(ahead_items)):
                    started = self.verify_lane.verify_start(items)
                    t_follow = self._clock()
                    self.overlap.start(self.config, work, items, started)  # the next step, queued behind
                    beside_s = self._clock() - t_follow  # its launch: not this verify call's time
                    results = started.result()
                else:
                    results = self.verify_lane.verify(items)
            except BaseException as exc:  # first let the concurrent draft call finish
                verify_error = exc
            verify_s = self._clock() - t0 - beside_s - after_s
        self._verify_s, self._beside_s = verify_s, beside_s
        ahead_results, draft_error = None, None
        if ahead_items:
            try:
                ahead_results, ahead_s = future.result() if future is not None else self._call_draft(ahead_items)
            except BaseException as exc:
                draft_error = exc
        if verify_error is not None:
            raise verify_error
        sample = None
        if items:
            self.observer.on_lane_step("verify", verify_s, len(items))
            k_max = max(len(i.draft_tokens) for i in items)
            held = [w.seq.held_draft for w in work if w.held and not held_after(w.seq)]
            if not ahead_items and not held and typical:  # a lock-step step
                sample = (False, len(items), k_max)
            elif held and ahead_items and typical and ahead_typical and len(held) == len(items):
                # Pipelined: this group's verify call and the other group's draft call ran side by
                # side; the step's wall time is what pipelining costs (docs/engine.md "Schedules").
                sample = (True, len(items), k_max)
            self._commit_verify(work, items, results, outputs, launched)
        if draft_error is not None:
            raise draft_error
        if ahead_items:
            self.observer.on_lane_step("draft", ahead_s, len(ahead_items))
            drafts = take_drafts(ahead, ahead_results)
            for w in ahead:
                tokens, probs = drafts[w.seq.request_id]
                # Held even when empty (a pool-less lane proposed nothing): the request then plain-decodes
                # in its next step, as a lock-step step verifies it with k = 0 right after the draft.
                w.seq.held_draft = HeldDraft(w.seq.pending_pos, tokens, probs, ahead_typical, requested_k=w.k)
        return sample

    def _commit_verify(
        self, work: list[DecodeWork], items: list[VerifyItem], results, outputs: list[RequestOutput], launched=None
    ) -> None:
        """Commits a verify call: positions, verdicts, tokens; holds the drafts launched after it
        (`launched`, engine.draft_after); streams the requests it ends (or may end, on a stop string),
        then may launch the next step (engine.spec_ahead), then streams the others."""
        appended = []
        for w, item, res in zip(work, items, results):
            seq, n, k = w.seq, item.start_pos, len(item.draft_tokens)
            m = res.accepted
            assert 0 <= m <= k and len(res.new_tokens) == m + 1, "verify lane broke its contract"
            seq.target_computed = n + m + 1
            if k > 0 and not w.lookup:  # the draft lane wrote positions draft_computed .. n + k - 1
                # (a feature draft's rows past its inputs are speculative: re-fed from n + 1)
                seq.draft_computed = n + 1 if self.feature_draft else min(n + k, n + m + 1)
            record_verdict(
                seq,
                self.costs.acceptance,
                k,
                m,
                asked=seq.held_draft.requested_k if seq.held_draft is not None else w.k,
            )
            seq.held_draft = None
            self.observer.on_verify(k, m)
            tokens, finish = append_tokens(
                seq, res.new_tokens, self._eos, self.vocab_size, self.max_context, self._clock()
            )
            appended.append((seq, tokens, finish, k))
        later = appended
        if launched is not None:
            self.draft_after.hold(launched)
            later = []
            for seq, tokens, finish, k in appended:
                if finish is not None or seq.spec.stop:
                    outputs += self._stream(seq, tokens, finish, k)
                else:
                    later.append((seq, tokens, finish, k))
            self.ahead.launch(self.config, launched)
        for seq, tokens, finish, k in later:
            outputs += self._stream(seq, tokens, finish, k)

    # -- committing tokens -------------------------------------------------------------------
    def _emit(self, seq: Sequence, new_tokens: list[int], applied_k: int) -> list[RequestOutput]:
        """Appends tokens, applies EOS / max_tokens / context / stop strings, builds the chunk."""
        tokens, finish = append_tokens(seq, new_tokens, self._eos, self.vocab_size, self.max_context, self._clock())
        return self._stream(seq, tokens, finish, applied_k)

    def _stream(
        self, seq: Sequence, tokens: list[int], finish: FinishReason | None, applied_k: int
    ) -> list[RequestOutput]:
        """The chunk of tokens just appended (append_tokens): detokenized, stop strings applied."""
        detok = self._detok.get(seq.request_id)
        text, stop_hit = detok.add([t for t in tokens if t not in self._eos]) if detok else ("", False)
        if stop_hit:
            finish = FinishReason.STOP
        if finish is not None:
            return [self._finish(seq, finish, tokens, text, applied_k)]
        return [RequestOutput(seq.request_id, tokens, text, False, None, seq.stats, applied_k)]

    def _finish(
        self, seq: Sequence, reason: FinishReason, tokens: list[int], text: str, applied_k: int = 0
    ) -> RequestOutput:
        detok = self._detok.pop(seq.request_id, None)
        if detok is not None and reason is not FinishReason.STOP:
            text += detok.flush()
        self.overlap.on_finish(seq)  # a row in a step still in flight: its blocks wait for that step
        if self.lookup is not None:
            self.lookup.forget(seq.request_id)
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.request_id]
        for lane in self._releasing:
            lane.release((seq.request_id,))
        self.observer.on_request_finished(seq)
        return RequestOutput(seq.request_id, tokens, text, True, reason, seq.stats, applied_k)

    def _draft_handle(self, seq: Sequence, seq_len: int, committed: int) -> KvHandle | None:
        if self.draft_pool is None:
            return None
        return self._handle(self.draft_pool, seq.draft_blocks, seq_len, committed)

    @staticmethod
    def _handle(pool: PoolInfo, blocks: list[int], seq_len: int, committed: int) -> KvHandle:
        return KvHandle(pool.pool_id, pool.generation, tuple(blocks), seq_len, min(committed, seq_len))

"""The router: owns every request's state and runs the speculative loop over the three lanes.

Torch-free. One `step()` = pick the step's strategy (verifypd.router.steps) and run it: plan
(scheduler) -> lane calls in lane-priority order -> commit the lanes' results into sequence state ->
stream outputs. The schedule (RuntimeConfig.schedule, see docs/engine.md "Schedules") is a policy
over the same lanes: baseline and pd steps are lock-step (draft, then verify of the same requests);
a pipelined pdv step runs the draft call of one group and the verify call of the other concurrently.
Steps may be launched before the one before them has reached the host (a chain of plain steps; a
speculative step launched ahead); the next `step()` commits them. Losslessness lives in the verify
lane's acceptance rule; the router's job is the bookkeeping that keeps KV positions and tokens
aligned (see `verifypd.router.sequence` for the layout invariant). The strategies share one typed
step context (verifypd.router.step_context); docs/engine.md "Step strategies".
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, Generic, TypeVar, overload

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.grammar import GrammarCompiler
from verifypd.domain.lanes import DraftLane, PoolInfo, PrefillLane, VerifyLane
from verifypd.domain.lookup import PromptLookup
from verifypd.domain.requests import FinishReason, InvalidRequest, RequestOutput, RequestSpec, RequestStats
from verifypd.router.block_manager import BlockManager, check_fits
from verifypd.router.detokenize import Decode, IncrementalDetokenizer
from verifypd.router.draft_length import StepCostModel
from verifypd.router.prefix_cache import PrefixCache
from verifypd.router.scheduler import Scheduler
from verifypd.router.sequence import SeqStatus, Sequence
from verifypd.router.step_context import StepContext
from verifypd.router.steps import StepStrategy
from verifypd.router.steps.baseline import Baseline
from verifypd.router.steps.draft_after import DraftAfter
from verifypd.router.steps.lock_step import LockStep
from verifypd.router.steps.overlapped import Overlapped
from verifypd.router.steps.pipelined import Pipelined
from verifypd.router.steps.speculate_ahead import SpeculateAhead

T = TypeVar("T")


class EngineObserver:
    """Telemetry hooks; the default does nothing. Implemented by verifypd.telemetry."""

    def on_lane_step(self, lane: str, seconds: float, batch: int) -> None: ...
    def on_verify(self, k: int, accepted: int) -> None: ...
    def on_request_finished(self, seq: Sequence) -> None: ...
    def on_step(self, router: Router) -> None: ...
    def on_idle(self, router: Router) -> None: ...  # state changed without a step (abort, idle, reset)


class _Shared(Generic[T]):
    """A Router attribute that is the step context's (the lanes, pools, scheduler, config, ...): read
    and set on the Router, as before the strategies shared it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, router: None, owner: type) -> _Shared[T]: ...
    @overload
    def __get__(self, router: Router, owner: type) -> T: ...
    def __get__(self, router: Router | None, owner: type) -> Any:
        return self if router is None else getattr(router.context, self._name)

    def __set__(self, router: Router, value: T) -> None:
        setattr(router.context, self._name, value)


class Router:
    prefill_lane: _Shared[PrefillLane] = _Shared()
    draft_lane: _Shared[DraftLane] = _Shared()
    verify_lane: _Shared[VerifyLane] = _Shared()
    target_pool: _Shared[PoolInfo] = _Shared()
    draft_pool: _Shared[PoolInfo | None] = _Shared()  # None: a pool-less draft lane (prompt lookup, none)
    target_blocks: _Shared[BlockManager] = _Shared()
    draft_blocks: _Shared[BlockManager | None] = _Shared()
    scheduler: _Shared[Scheduler] = _Shared()
    prefix: _Shared[PrefixCache | None] = _Shared()  # None: prefix caching off
    config: _Shared[RuntimeConfig] = _Shared()  # one config per step; UpdateConfig takes effect on the next one
    costs: _Shared[StepCostModel] = _Shared()
    observer: _Shared[EngineObserver] = _Shared()
    lookup: _Shared[PromptLookup | None] = _Shared()  # prompt lookup mixed into a feature draft (eagle+ngram:)
    feature_draft: _Shared[bool] = _Shared()  # see LaneInfo.reads_features
    vocab_size: _Shared[int] = _Shared()
    max_context: _Shared[int] = _Shared()
    # Prefill beside decode (docs/engine.md): with lanes whose calls start asynchronously, a step's
    # prefill is launched while the GPU runs its verify call. Off only to measure it.
    overlap_prefill: _Shared[bool] = _Shared()

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
        lookup: PromptLookup | None = None,
        grammar: GrammarCompiler | None = None,
        prefix_cache: bool = True,
    ):
        """`grammar`: compiles constrained requests' grammars (structured output); None refuses them.
        `prefix_cache`: automatic prefix caching (router.prefix_cache), where the lanes allow it
        (StepContext._prefix_cache)."""
        self.grammar = grammar
        self.context = StepContext(
            prefill,
            draft,
            verify,
            decode=decode,
            eos_token_ids=frozenset(eos_token_ids),
            config=config or RuntimeConfig(),
            max_running=max_running,
            observer=observer or EngineObserver(),
            clock=clock,
            lookup=lookup,
            prefix_cache=prefix_cache,
        )
        self._arrivals = itertools.count()
        # The step strategies (verifypd.router.steps). Two launch steps ahead, the next step commits:
        self.overlap = Overlapped()  # plain-decoding steps launched ahead (RuntimeConfig.overlap)
        self.draft_after = DraftAfter()  # speculative steps' next drafts launched before the verdict
        self.ahead = SpeculateAhead(self.draft_after, self.overlap)  # speculative steps launched ahead
        self.context.finish_hooks.append(self.overlap.on_finish)  # its rows of a request that ended
        # The others run the step the scheduler plans, by the plan's kind (the first that can).
        self._planned: tuple[StepStrategy, ...] = (
            Pipelined(self.overlap, self.ahead),
            Baseline(self.overlap, self.ahead),
            LockStep(self.overlap, self.ahead),
        )

    def close(self) -> None:
        """Stops the pipelining worker threads (if any were started); the router stays usable."""
        self.context.close()

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, spec: RequestSpec) -> str:
        ctx = self.context
        spec.validate(vocab_size=ctx.vocab_size, max_context=ctx.max_context)
        check_fits(spec, ctx.max_context, [b for b in (ctx.target_blocks, ctx.draft_blocks) if b is not None])
        if not spec.plain and not all(
            getattr(lane, "applies_controls", False) for lane in (ctx.prefill_lane, ctx.verify_lane)
        ):  # the logits are processed in the lanes' process; nothing of it travels the lane RPC (yet)
            field, what = (
                (spec.constraint.field, "structured output")
                if spec.constraint is not None
                else ("sampling", "penalties, min_tokens, logit_bias and logprobs")
            )
            raise InvalidRequest(
                f"{field}: {what} need in-process lanes (a colocated server, tensor parallel included); "
                "this server's lanes do not apply them"
            )
        request_id = spec.request_id or uuid.uuid4().hex
        if request_id in ctx.sequences:
            raise InvalidRequest(f"request_id {request_id!r} is already in flight; use a unique id")
        if spec.constraint is not None:
            ctx.grammars[request_id] = self.grammar_state(spec)
        stats = RequestStats(prompt_tokens=len(spec.prompt_ids), arrival_time=ctx.clock())
        seq = Sequence(spec=spec, request_id=request_id, arrival_order=next(self._arrivals), stats=stats)
        ctx.sequences[request_id] = seq
        if ctx.decode is not None:  # None: the front end detokenizes and applies stop strings
            ctx.detokenizers[request_id] = IncrementalDetokenizer(ctx.decode, spec.prompt_ids, spec.stop)
        ctx.scheduler.add(seq)
        return request_id

    def grammar_state(self, spec: RequestSpec):
        """The matcher of a constrained request, or InvalidRequest naming its field."""
        assert spec.constraint is not None
        field = spec.constraint.field  # (in-process lanes: checked by add_request)
        if self.grammar is None:
            raise InvalidRequest(f"{field}: structured output needs the model's tokenizer; this model has none")
        return self.grammar.state(spec.constraint)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels a request; its blocks return to the pools immediately."""
        seq = self.context.sequences.get(request_id)
        if seq is None:
            return None
        out = self.context.finish(seq, FinishReason.CANCELLED, [], "")
        self.refresh_gauges()  # gauges (blocks in use, queues) must not keep the old load
        return out

    def refresh_gauges(self) -> None:
        """Tells the observer the state changed without a step (so step counters stay steps)."""
        hook = getattr(self.observer, "on_idle", None)
        if hook is not None:
            hook(self)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.context.eos

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.overlap.inflight is not None or self.ahead.inflight is not None

    def sequences(self) -> list[Sequence]:
        return list(self.context.sequences.values())

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step, run by the strategy this step is for (`_strategy`); then the observer hears of
        it and, if it is worth learning from, its cost goes to the step-cost model: the whole step
        (planning, the lane calls, committing and the observer) less what the strategy excludes."""
        ctx = self.context
        t_step = ctx.clock()
        result = self._strategy(ctx).step(ctx)
        self.observer.on_step(self)
        seconds = ctx.clock() - t_step
        for excluded in result.excluded:  # a prefill run before, after or beside decode
            seconds -= excluded
        ctx.scheduler.settle_probes(ctx.plan, ctx.costs, seconds)
        ctx.scheduler.charge_probe_kv(ctx.costs, sum(result.excluded))
        if result.sample is not None:
            if result.cap_s is not None:
                seconds = min(seconds, result.cap_s)
            ctx.record_cost(result.sample, seconds)
        return result.outputs

    def _strategy(self, ctx: StepContext) -> StepStrategy:
        """A step launched ahead is committed by the strategy that launched it (a chained plain step:
        overlapped; a speculative step: speculate-ahead). Otherwise the scheduler plans the step (or
        the plan speculate-ahead made and did not launch is taken) and the plan picks: a pipelined pdv
        step with a group drafting ahead, baseline's one request, or lock-step."""
        ctx.plan = None
        for launched_ahead in (self.overlap, self.ahead):
            if launched_ahead.can_run(ctx):
                return launched_ahead
        ctx.plan = self.ahead.take_plan(ctx) or ctx.scheduler.plan(ctx.config, ctx.costs)
        return next(strategy for strategy in self._planned if strategy.can_run(ctx))

    def reset_kv(self) -> int:
        """After a lane restart: re-reads the lanes' pools (new pool ids / generations), forgets all
        KV and re-queues every request for recompute (the preemption path). Tokens already emitted
        are kept, so a request continues where its stream stopped. Returns the requests re-queued."""
        ctx = self.context
        self.overlap.drop()
        self.ahead.drop()
        verify_info, draft_info = ctx.verify_lane.describe(), ctx.draft_lane.describe()
        old = ctx.scheduler
        seqs = sorted(old.all_sequences(), key=Sequence.sort_key)
        ctx.attach_pools(verify_info.pools, draft_info.pools, old.max_running)
        for seq in seqs:  # the old block tables point into pools that are gone: drop, don't free
            seq.target_blocks.clear()
            seq.draft_blocks.clear()
            if seq.status is not SeqStatus.WAITING:
                seq.reset_for_recompute()
            ctx.scheduler.add(seq)
        self.refresh_gauges()
        return len(seqs)

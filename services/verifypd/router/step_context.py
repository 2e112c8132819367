"""The step context: what a step strategy (verifypd.router.steps) works with. Torch-free.

One per Router, handed to every strategy's `step`: the lanes, the KV pools and their block managers,
the scheduler, the runtime config, the step-cost model, the observer, the requests' sequences and
detokenizers, and the plan of the step being run (`plan`). Its methods make the lane calls (timed,
on a worker thread where one runs beside another), commit their results into sequence state
(verdicts, tokens, first tokens, blocks out of the window), stream chunks and finish requests. What
only reads it lives beside it: the lane items (router.lane_items), the step's draft proposals
(router.proposals), a prefill call run or started beside a verify call (router.prefill_calls). A
strategy keeps its own calls in flight; none holds the Router, and the context holds no strategy (a
strategy that must hear of a request ending while a call of it is in flight registers in `finish_hooks`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.grammar import GrammarState
from verifypd.domain.lanes import DraftItem, DraftLane, PoolInfo, PrefillItem, PrefillLane, VerifyItem, VerifyLane
from verifypd.domain.lookup import PromptLookup
from verifypd.domain.requests import FinishReason, RequestOutput, TokenLogprob
from verifypd.router.block_manager import BlockManager
from verifypd.router.commits import append_tokens, record_verdict
from verifypd.router.detokenize import Decode, IncrementalDetokenizer
from verifypd.router.draft_length import StepCostModel
from verifypd.router.prefix_cache import PrefixCache, root_key
from verifypd.router.scheduler import Scheduler
from verifypd.router.sequence import SeqStatus, Sequence
from verifypd.router.step_plan import DecodeWork, PrefillChunk, StepPlan

# A step's cost sample (StepCostModel): (pipelined, requests verified, k).
CostSample = tuple[bool, int, int]


class LaneObserver(Protocol):
    """The observer hooks a step calls (the Router's EngineObserver; verifypd.core.telemetry)."""

    def on_lane_step(self, lane: str, seconds: float, batch: int) -> None: ...
    def on_verify(self, k: int, accepted: int) -> None: ...
    def on_request_finished(self, seq: Sequence) -> None: ...


@dataclass
class Verified:
    """A verify row committed into its sequence (`commit_verdicts`) and not yet streamed."""

    seq: Sequence
    tokens: list[int]
    finish: FinishReason | None
    k: int
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked


def pool_of(pools: tuple[PoolInfo, ...], role: str, required: bool = True) -> PoolInfo | None:
    """The pool of `role` a lane announced (None for a missing optional one)."""
    for pool in pools:
        if pool.role == role:
            return pool
    if not required:
        return None
    raise ValueError(f"lane announced no {role} pool")


class StepContext:
    def __init__(
        self,
        prefill: PrefillLane,
        draft: DraftLane,
        verify: VerifyLane,
        *,
        decode: Decode | None,
        eos_token_ids: frozenset[int],
        config: RuntimeConfig,
        max_running: int,
        observer: LaneObserver,
        clock: Callable[[], float],
        lookup: PromptLookup | None,
        prefix_cache: bool = True,
    ):
        self.prefill_lane, self.draft_lane, self.verify_lane = prefill, draft, verify
        self.prefix_cache_wanted = prefix_cache  # on where the lanes allow it (`_prefix_cache`)
        # Lanes that keep per-request state for the router (the call channel's request keys and
        # block tables) are told when a request is done.
        self.releasing = [lane for lane in (prefill, draft, verify) if hasattr(lane, "release")]
        verify_info, draft_info = verify.describe(), draft.describe()
        self.feature_draft = draft_info.reads_features  # see LaneInfo.reads_features
        self.lookup = lookup  # a feature draft mixed with prompt lookup (spec_decode.lookup_mix)
        self.vocab_size = verify_info.vocab_size
        self.max_context = verify_info.max_context
        self.target_model = verify_info.target_model
        self.target_pool: PoolInfo
        self.draft_pool: PoolInfo | None  # None: a pool-less draft lane (prompt lookup, none)
        self.target_blocks: BlockManager
        self.draft_blocks: BlockManager | None
        self.scheduler: Scheduler
        self.clock = clock  # before attach_pools: the scheduler stamps admissions with it
        self.prefix: PrefixCache | None  # None: prefix caching off
        self.attach_pools(verify_info.pools, draft_info.pools, max_running)
        self.config = config
        self.config.validate()
        self.costs = StepCostModel()
        self.observer = observer
        self.decode = decode
        self.eos = eos_token_ids
        # Prefill beside decode (docs/engine.md): with lanes whose calls start asynchronously, a
        # step's prefill is launched while the GPU runs its verify call. Off only to measure it.
        self.overlap_prefill = True
        self.sequences: dict[str, Sequence] = {}  # every request in flight, by id
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Structured output: the matcher of each constrained request in flight, by id. No step of such a
        # request is launched ahead (RequestSpec.plain; draft-after: plain_item): each step's masks need
        # the tokens committed before it, and its drafts, on the host.
        self.grammars: dict[str, GrammarState] = {}
        self.plan: StepPlan | None = None  # the plan of the step being run (None: a step launched ahead)
        # Called with a request before its blocks are freed (finished, cancelled): strategies with
        # a call of it in flight hold its blocks back until that call is over (steps.overlapped).
        self.finish_hooks: list[Callable[[Sequence], None]] = []
        self.draft_thread: ThreadPoolExecutor | None = None  # pdv: the draft call beside the verify call
        self.prefill_thread: ThreadPoolExecutor | None = None  # pdv over lane processes: prefill beside decode

    # -- pools -------------------------------------------------------------------------------
    def attach_pools(self, target_pools: tuple[PoolInfo, ...], draft_pools: tuple[PoolInfo, ...], max_running: int):
        """Block managers and a scheduler over the pools the lanes announced (at start, and after a
        lane restart: Router.reset_kv)."""
        target_pool = pool_of(target_pools, "target")
        assert target_pool is not None  # (pool_of raises for a missing required pool)
        self.target_pool = target_pool
        self.draft_pool = pool_of(draft_pools, "draft", required=False)
        caching = self._prefix_cache()
        # A model draft's pool is keyed like the target's; an EAGLE head's is not (router.prefix_cache).
        draft_caching = (
            caching
            and self.draft_pool is not None
            and not self.feature_draft
            and self.draft_pool.block_size == self.target_pool.block_size
        )
        target, draft = self.target_pool, self.draft_pool
        self.target_blocks = BlockManager(
            target.num_blocks, target.block_size, "target", caching=caching, window=target.window
        )
        self.draft_blocks = (
            BlockManager(draft.num_blocks, draft.block_size, "draft", caching=draft_caching, window=draft.window)
            if draft
            else None
        )
        self.prefix = (
            PrefixCache(self.target_blocks, self.draft_blocks if draft_caching else None, root_key(self.target_model))
            if caching
            else None
        )
        self.scheduler = Scheduler(
            self.target_blocks,
            self.draft_blocks,
            self.max_context,
            max_running,
            lazy_draft_prefill=self._lazy_draft_prefill(),
            never_drafts=self._never_drafts(),
            clock=self.clock,
            prefix=self.prefix,
        )

    def _prefix_cache(self) -> bool:
        """Prefix caching, if wanted, where a request may start with target KV longer than its draft
        KV: without a draft pool, or with a prefill lane that takes draft KV per item (in-process)."""
        return self.prefix_cache_wanted and (
            self.draft_pool is None or getattr(self.prefill_lane, "per_item_draft_kv", False)
        )

    def _lazy_draft_prefill(self) -> bool:
        """Prefill may skip a model draft's KV while nobody drafts (Scheduler.drafts_soon): in-process lanes."""
        return (
            self.draft_pool is not None
            and not self.feature_draft
            and getattr(self.prefill_lane, "per_item_draft_kv", False)
        )  # the lane RPC sends all or none

    def _never_drafts(self) -> bool:
        """`--draft none` (spec_decode.ngram.NoDraftLane) proposes nothing: k is 0, whatever the policy says."""
        return self.draft_lane.describe().draft_model == "none"

    def release_out_of_window(self, seq: Sequence) -> None:
        """After a commit: returns the blocks of windowed pools that no later query of `seq` can see
        (BlockManager.release_before). Queries come at positions >= the committed ones (rollback
        never goes below them); a feature draft also reads the target's rows from its own
        draft_computed on, so the target keeps those too."""
        if self.target_blocks.window:  # (a call per request per step saved where nothing slides)
            first = seq.target_computed
            if self.feature_draft:
                first = min(first, seq.draft_computed)
            seq.target_freed = self.target_blocks.release_before(seq.target_blocks, seq.target_freed, first)
        if self.draft_blocks is not None and self.draft_blocks.window:
            seq.draft_freed = self.draft_blocks.release_before(seq.draft_blocks, seq.draft_freed, seq.draft_computed)

    # -- lane calls and worker threads -------------------------------------------------------
    def call_prefill(self, items: list[PrefillItem]) -> tuple[list, float]:
        t0 = self.clock()
        results = self.prefill_lane.prefill(items)
        return results, self.clock() - t0

    def call_draft(self, items: list[DraftItem]) -> tuple[list, float]:
        t0 = self.clock()
        results = self.draft_lane.draft(items)
        return results, self.clock() - t0

    def submit_draft(self, items: list[DraftItem]) -> Future:
        """The draft call of `items` on the draft worker thread (pdv: beside the verify call)."""
        if self.draft_thread is None:
            self.draft_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifypd-draft")
        return self.draft_thread.submit(self.call_draft, items)

    def submit_prefill(self, items: list[PrefillItem]) -> Future:
        """The prefill call of `items` on the prefill worker thread (beside the decode calls)."""
        if self.prefill_thread is None:
            self.prefill_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifypd-prefill")
        return self.prefill_thread.submit(self.call_prefill, items)

    def close(self) -> None:
        """Stops the worker threads (if any were started); the context stays usable."""
        threads, self.draft_thread, self.prefill_thread = (self.draft_thread, self.prefill_thread), None, None
        for thread in threads:
            if thread is not None:
                thread.shutdown(wait=True)

    # -- commits -----------------------------------------------------------------------------
    def commit_prefill(self, chunks: list[PrefillChunk], results) -> list[RequestOutput]:
        outputs = []
        for c, res in zip(chunks, results, strict=False):
            seq = c.seq
            seq.target_computed = c.end
            # A pool-less lane gets the prompt with its first draft call, and so does a model draft
            # whose KV this chunk skipped (draft_computed lags; the draft call catches up).
            if self.draft_pool is not None and c.with_draft:
                seq.draft_computed = c.end
            if self.prefix is not None:
                self.prefix.register(seq)
            self.release_out_of_window(seq)
            if c.end == seq.prefill_target:
                seq.status = SeqStatus.DECODING
            if c.sample_first:
                assert res.first_token is not None, "prefill lane returned no first token"
                outputs += self.emit(seq, [res.first_token], applied_k=0, logprobs=getattr(res, "logprobs", None))
        return outputs

    def commit_verdicts(self, work: list[DecodeWork], items: list[VerifyItem], results) -> list[Verified]:
        """Commits a verify call into its sequences: positions, verdicts, tokens (nothing streamed)."""
        verified = []
        prior = self.costs.acceptance.alpha
        for w, item, res in zip(work, items, results, strict=False):
            seq, n, k = w.seq, item.start_pos, len(item.draft_tokens)
            m = res.accepted
            assert 0 <= m <= k and len(res.new_tokens) == m + 1, "verify lane broke its contract"
            seq.target_computed = n + m + 1
            if k > 0 and not w.lookup:  # the draft lane wrote positions draft_computed .. n + k - 1
                # (a feature draft's rows past its inputs are speculative: re-fed from n + 1)
                seq.draft_computed = n + 1 if self.feature_draft else min(n + k, n + m + 1)
            prior = record_verdict(
                seq,
                self.costs.acceptance,
                k,
                m,
                asked=seq.held_draft.requested_k if seq.held_draft is not None else w.k,
                prior=prior,
            )
            seq.held_draft = None
            if self.lookup is not None:
                self.lookup.settle(seq.request_id, w.lookup, k, m, res.new_tokens)
            self.observer.on_verify(k, m)
            tokens, finish = append_tokens(
                seq, res.new_tokens, self.eos, self.vocab_size, self.max_context, self.clock()
            )
            # after the tokens: the accepted drafts' blocks are keyed by them (PrefixCache.register)
            if self.prefix is not None:
                self.prefix.register(seq)
            self.release_out_of_window(seq)
            logprobs = getattr(res, "logprobs", None)
            verified.append(Verified(seq, tokens, finish, k, logprobs[: len(tokens)] if logprobs is not None else None))
        return verified

    def stream_verified(self, verified: list[Verified], outputs: list[RequestOutput]) -> None:
        """Streams committed verify rows into `outputs`, in order (finishing the requests they end)."""
        for v in verified:
            outputs += self.stream(v.seq, v.tokens, v.finish, v.k, v.logprobs)

    def commit_verify(
        self, work: list[DecodeWork], items: list[VerifyItem], results, outputs: list[RequestOutput]
    ) -> None:
        """Commits a verify call and streams its rows into `outputs`."""
        self.stream_verified(self.commit_verdicts(work, items, results), outputs)

    # -- streaming ---------------------------------------------------------------------------
    def emit(
        self, seq: Sequence, new_tokens: list[int], applied_k: int, logprobs: list[TokenLogprob] | None = None
    ) -> list[RequestOutput]:
        """Appends tokens, applies EOS / max_tokens / context / stop strings, builds the chunk."""
        tokens, finish = append_tokens(seq, new_tokens, self.eos, self.vocab_size, self.max_context, self.clock())
        return self.stream(seq, tokens, finish, applied_k, logprobs[: len(tokens)] if logprobs is not None else None)

    def stream(
        self,
        seq: Sequence,
        tokens: list[int],
        finish: FinishReason | None,
        applied_k: int,
        logprobs: list[TokenLogprob] | None = None,
    ) -> list[RequestOutput]:
        """The chunk of tokens just appended (append_tokens): detokenized, stop strings applied."""
        detok = self.detokenizers.get(seq.request_id)
        hidden = self.eos | frozenset(seq.spec.sampling.stop_token_ids)  # ids that end it, not text
        text, stop_hit = detok.add([t for t in tokens if t not in hidden]) if detok else ("", False)
        if stop_hit:
            finish = FinishReason.STOP
        if finish is not None:
            return [self.finish(seq, finish, tokens, text, applied_k, logprobs)]
        return [RequestOutput(seq.request_id, tokens, text, False, None, seq.stats, applied_k, logprobs)]

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        tokens: list[int],
        text: str,
        applied_k: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        """Ends `seq` (finished or cancelled): its last chunk; its blocks return to the pools."""
        detok = self.detokenizers.pop(seq.request_id, None)
        self.grammars.pop(seq.request_id, None)
        if detok is not None and reason is not FinishReason.STOP:
            text += detok.flush()
        for hook in self.finish_hooks:  # a row in a step still in flight: its blocks wait for that step
            hook(seq)
        if self.lookup is not None:
            self.lookup.forget(seq.request_id)
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self.sequences[seq.request_id]
        for lane in self.releasing:
            lane.release((seq.request_id,))
        self.observer.on_request_finished(seq)
        return RequestOutput(seq.request_id, tokens, text, True, reason, seq.stats, applied_k, logprobs)

    # -- costs -------------------------------------------------------------------------------
    def record_cost(self, sample: CostSample, seconds: float) -> None:
        pipelined, verified, k = sample
        if pipelined:
            self.costs.observe_pipelined(verified, k, seconds)
        else:
            self.costs.observe_step(verified, k, seconds)

"""In-process lanes over ModelRunners: the co-located transport (zero copy: draft probabilities
stay on the device and pass to the verify lane by reference). The only lane code touching torch.

Host syncs: one device-to-host copy per lane call (the tokens the router needs), taken when the
caller asks for the results (`verify_start` / `prefill_start` return before it, so the router can
queue a prefill behind a running verify); small host lists reach the device through pinned memory
(`sampler.small_tensor`), never through a copy that waits for the GPU. Sampling, acceptance and
the draft loop's feeding of tokens stay on the device; on CUDA the forwards are CUDA-graph replays
(see `verifypd.model.graph_runner`).

Streams (CUDA only; on CPU there are none): the draft and verify lanes each run on their own
stream, draft at the higher priority, so a pipelined (pdv) step's draft call of one group and
verify call of the other, issued from two threads, can overlap on the GPU. Prefill runs on the
thread's current (default) stream. Ordering: the draft and verify streams wait for the current
stream when a call starts, the prefill lane waits for both streams when it starts (the pools and
the runners' static buffers are shared between prefill and the decode lanes), and drafts crossing
from the draft stream to the verify stream carry an event the verify stream waits on (and their
memory is `record_stream`ed there). Draft tokens are all that crosses: coupled acceptance needs no
draft probabilities (`sampler.accept_raced`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence

import torch

from verifypd.domain.lanes import (
    DraftItem,
    DraftOutput,
    Finished,
    KvHandle,
    LaneInfo,
    PrefillItem,
    PrefillOutput,
    StartedCall,
    plain_item,
)
from verifypd.lanes.device_values import (
    DeviceDraftTokens,
    DraftBatch,
    HostCopy,
)
from verifypd.model import logits_controls, sampler
from verifypd.model.eagle_draft import EagleRunner, FeatureRun
from verifypd.model.runner import ModelRunner, TokenRun
from verifypd.model.token_mask import apply_masks

# sampler.choose's (temperature, top_k, top_p, seeds): tensors, or None in greedy mode.
_ChoiceParams = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]

# CUDA stream priorities (lower = more urgent; CUDA clamps to the device's range). Prefill, the
# low-priority lane, runs on the default stream (priority 0).
DRAFT_STREAM_PRIORITY, VERIFY_STREAM_PRIORITY = -2, -1


def lane_stream(device: torch.device, priority: int) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device=device, priority=priority) if device.type == "cuda" else None


_INTERPRETER_LOCK = threading.Lock()


def interpreted(runner: ModelRunner | EagleRunner) -> bool:
    """Triton kernels under Triton's CPU interpreter (tests), whose launch state is global."""
    return os.environ.get("TRITON_INTERPRET") == "1" and getattr(runner.model, "attention", None) == "triton"


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None, serial: bool = False) -> Iterator[None]:
    """Runs the block on `stream` after the work already queued on the current stream. `serial`
    (the Triton interpreter): lane calls run one at a time."""
    if serial:
        with _INTERPRETER_LOCK:
            yield
        return
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


class LocalPrefillLane:
    # Items may come without draft KV one by one (the router's lazy draft prefill): only those with
    # a draft_kv get a draft forward.
    per_item_draft_kv = True
    applies_controls = True  # sampling controls, logprobs (model.logits_controls) and token masks (model.token_mask)

    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner | EagleRunner | None,
        info: LaneInfo,
        wait_for: Sequence[torch.cuda.Stream | None] = (),
    ):
        """`wait_for`: the decode lanes' streams; prefill starts after their queued work."""
        self.target, self.draft, self.info = target, draft, info
        self.wait_for = [st for st in wait_for if st is not None]

    def describe(self) -> LaneInfo:
        return self.info

    @property
    def starts_async(self) -> bool:
        return self.target.device.type == "cuda"

    def prefill(self, items: list[PrefillItem]) -> list[PrefillOutput]:
        return self.prefill_start(items).result()

    def prefill_start(self, items: list[PrefillItem]) -> StartedCall:
        """Queues the prefill forwards (and the first-token sampling); the first tokens reach the
        host in `.result()`."""
        if not items:
            return Finished([])
        for stream in self.wait_for:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        target_runs = [TokenRun(i.token_ids, i.start_pos, i.target_kv.block_ids) for i in items]
        logits = self.target.forward(target_runs, "last")
        assert logits is not None  # forward(..., "last") returns the last positions' logits
        draft = self.draft
        if isinstance(draft, EagleRunner):  # a feature draft: the rows the target's features complete
            # (items without draft KV: the head's rows lag, e.g. after a prefix-cache hit; its first
            # draft call catches up from the target's features)
            heads = [feature_run(i.token_ids, i.start_pos, i.draft_kv, i.target_kv) for i in items if i.draft_kv]
            if heads:
                draft.prefill(heads)
        elif draft is not None:  # None with a pool-less draft lane (prompt lookup): no draft KV
            runs = [TokenRun(i.token_ids, i.start_pos, i.draft_kv.block_ids) for i in items if i.draft_kv is not None]
            if runs:  # items without draft KV: the router skipped it while nobody drafts
                draft.forward(runs, None)
        rows = [n for n, i in enumerate(items) if i.sample_first]
        if rows:
            chosen = [items[n] for n in rows]
            samplings = [i.sampling for i in chosen]
            mode = sampler.choice_mode(samplings)
            params: _ChoiceParams = (None, None, None, None)  # greedy: none read
            # nor positions: on CUDA each is a pinned allocation and a queued copy, host time on every
            # greedy prefill's way to its first token
            positions = None
            if mode != sampler.GREEDY:
                temp, top_k, top_p, seeds = sampler.params_tensor(samplings, logits.device)
                params = (temp, top_k, top_p, seeds)
                positions = sampler.small_tensor([i.start_pos + len(i.token_ids) for i in chosen], logits.device)
            # Not logits[rows]: a Python list as an index is copied to the device from pageable memory,
            # which waits for the stream's queued work, this whole prefill (~1 ms of the embedded
            # model's GPU time at batch 1, H200: prefill_start took ~1.2 ms with a 0.13 ms forward).
            picked = (
                logits if len(rows) == len(items) else logits.index_select(0, sampler.small_tensor(rows, logits.device))
            )
            if not all(plain_item(i) for i in chosen):  # sampling controls, logprobs or a mask: their own path
                return self._first_processed(items, rows, chosen, picked)
            tokens = sampler.choose(picked, mode, *params, positions)

            def outputs(host: list[int]) -> list[PrefillOutput]:
                first = dict(zip(rows, host))
                return [PrefillOutput(i.request_id, first.get(n)) for n, i in enumerate(items)]

            # Every item samples: its first tokens stay on the device for a verify call to read
            # (engine.overlap: the request decodes in the next step, launched before these reach
            # the host). Clamped as a verify call's next_tokens are (NO_TOKEN: refused at commit).
            feed = tokens.to(torch.long).clamp(min=0) if len(rows) == len(items) else None
            return HostCopy(tokens, outputs, next_tokens=feed)
        return Finished([PrefillOutput(i.request_id, None) for i in items])

    @staticmethod
    def _first_processed(items: list[PrefillItem], rows: list[int], chosen: list[PrefillItem], picked) -> HostCopy:
        """First tokens of a batch where some item has sampling controls, logprobs or a structured-output
        mask: the controls on the last logits (model.logits_controls), the masks (model.token_mask),
        then the same choice as `sampler.choose`. Leaves no tokens on the device to feed (a chain of
        plain steps needs the host's history current)."""
        samplings = [i.sampling for i in chosen]
        raw = picked[:, None, :]  # [R, 1, V]
        processed = logits_controls.apply(raw, samplings, [i.controls for i in chosen])
        # the mask seam (domain.sampling_controls step 5): after the controls, before temperature / top-k / top-p
        processed = apply_masks(processed, [i.token_mask for i in chosen], fallback=raw)
        tokens = logits_controls.choose(processed, samplings, [i.start_pos + len(i.token_ids) for i in chosen])
        top_n = max(s.top_logprobs for s in samplings)
        table = logits_controls.logprob_table(raw, tokens, top_n) if any(s.logprobs for s in samplings) else None

        def outputs(host: list[list[int]], lp: list | None = None) -> list[PrefillOutput]:
            first = {row: (n, cell[0]) for n, (row, cell) in enumerate(zip(rows, host, strict=True))}
            result = []
            for n, item in enumerate(items):
                if n not in first:
                    result.append(PrefillOutput(item.request_id, None))
                    continue
                m, token = first[n]
                logprobs = (
                    logits_controls.logprobs_of(lp[m], [token], item.sampling.top_logprobs)
                    if (lp is not None and item.sampling.logprobs)
                    else None
                )
                result.append(PrefillOutput(item.request_id, token, logprobs))
            return result

        return HostCopy(tokens, outputs, extra=table)


class LocalDraftLane:
    def __init__(self, draft: ModelRunner | EagleRunner, info: LaneInfo):
        self.runner, self.info = draft, info
        self.stream = lane_stream(draft.device, DRAFT_STREAM_PRIORITY)
        self.serial = interpreted(draft)
        # the stream draft_after last ran on (a verify lane's); only set where this lane has a stream
        self._after_stream: torch.cuda.Stream | None = None

    def describe(self) -> LaneInfo:
        return self.info

    @property
    def drafts_after_verdict(self) -> bool:
        """Takes `draft_after` (a feature draft: engine.draft_after)."""
        return isinstance(self.runner, EagleRunner)

    def draft(self, items: list[DraftItem]) -> list[DraftOutput]:
        if not items:
            return []
        if any(i.k < 1 for i in items):
            raise ValueError("draft items need k >= 1")
        if self._after_stream is not None and self.stream is not None:  # a draft_after call may still
            self.stream.wait_stream(self._after_stream)  # write the head's KV there
        return self._draft(items, self.stream)

    def draft_after(
        self, items: list[DraftItem], started: StartedCall, verify_rows: list[int], verify_ks: list[int]
    ) -> list[DraftOutput]:
        """Drafts launched right after a verify call (`started`, its StartedCall), before its verdict
        reaches the host (engine.draft_after): item i's input ends in verify row verify_rows[i]'s
        verify_ks[i] + 1 tokens as placeholders, fitted to the verdict on the device. Runs on the
        verify call's stream, so both the verdict it reads and the next verify call are ordered with it."""
        if not items:
            return []
        if not isinstance(started, HostCopy):
            raise TypeError(f"draft_after reads an in-process verify call's verdict; got a {type(started).__name__}")
        stream = started.stream
        if self.stream is not None:
            self._after_stream = stream
        return self._draft(items, stream, (started.verdict, verify_rows, verify_ks))

    def _draft(
        self, items: list[DraftItem], stream: torch.cuda.Stream | None, after: tuple | None = None
    ) -> list[DraftOutput]:
        runner = self.runner
        feature_runs: list[FeatureRun] = []
        token_runs: list[TokenRun] = []
        if isinstance(runner, EagleRunner):
            feature_runs = [feature_run(i.input_tokens, i.start_pos, i.draft_kv, i.target_kv) for i in items]
        elif after is not None:
            raise TypeError("draft_after needs a feature draft (drafts_after_verdict)")
        else:
            token_runs = [TokenRun(i.input_tokens, i.start_pos, _draft_blocks(i.draft_kv)) for i in items]
        ks, samplings = [i.k for i in items], [i.sampling for i in items]
        with on_stream(stream, self.serial):
            tokens = (
                runner.draft(feature_runs, ks, samplings, after)
                if isinstance(runner, EagleRunner)
                else runner.draft(token_runs, ks, samplings)
            )
            # No host sync: the tokens stay on the device for the verify lane (a copy, since the
            # runner's buffers are reused by its next call).
            tokens = tokens.clone()
            ready = None
            if stream is not None:  # the verify stream waits on this before reading them
                ready = torch.cuda.Event()
                ready.record(stream)
        batch = DraftBatch(tokens, ready)
        # No draft probabilities: coupled acceptance (sampler.accept_raced) needs none.
        return [DraftOutput(i.request_id, DeviceDraftTokens(batch, n, i.k), None) for n, i in enumerate(items)]


def _draft_blocks(draft_kv: KvHandle | None) -> tuple[int, ...]:
    if draft_kv is None:
        raise ValueError("a draft lane with a pool needs every item's draft_kv (the blocks it writes)")
    return draft_kv.block_ids


def feature_run(
    tokens: Sequence[int], start_pos: int, draft_kv: KvHandle | None, target_kv: KvHandle | None
) -> FeatureRun:
    if target_kv is None:
        raise ValueError("a feature draft's items need target_kv (the blocks holding the target's features)")
    return FeatureRun(list(tokens), start_pos, _draft_blocks(draft_kv), target_block_ids=target_kv.block_ids)

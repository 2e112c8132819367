"""The in-process verify lane (lanes.local: the transport, its streams and host syncs): the target's
forward over each item's pending token and drafts, greedy or raced acceptance on the device, and
the verdicts handed on as device values (lanes.device_values) until the router asks for them."""

from __future__ import annotations

import zlib
from typing import TypedDict

import numpy as np
import torch

from verifypd.domain.lanes import (
    Finished,
    HostTokens,
    LaneInfo,
    StartedCall,
    TokenFeed,
    VerdictFit,
    VerifyItem,
    VerifyOutput,
    plain_item,
)
from verifypd.lanes.device_values import (
    DraftBatch,
    HostCopy,
    device_drafts,
    verdict_outputs,
    wait_for_drafts,
)
from verifypd.lanes.local import VERIFY_STREAM_PRIORITY, interpreted, lane_stream, on_stream
from verifypd.model import logits_controls, sampler
from verifypd.model.runner import ModelRunner, TokenRun
from verifypd.model.token_mask import apply_masks


class _Fed(TypedDict, total=False):
    """What a verify call passes on to the runner's score() / verify_greedy() only when it has it
    (a tensor-parallel runner takes neither: it never feeds tokens or fits verdicts)."""

    first_ids: torch.Tensor
    fit: tuple


class LocalVerifyLane:
    def __init__(self, target: ModelRunner, info: LaneInfo, simulated_acceptance: float | None = None):
        """`simulated_acceptance` (benchmarks only; no RPC reaches it, only `verifypd serve` / `verifypd lane
        verify --simulated-acceptance`, which warn at start-up): do the real verify
        forward, then keep each draft token with this probability (seeded Bernoulli), so random-weight
        models can stand in for a trained draft. Output is then NOT the target's distribution."""
        self.target, self.info = target, info
        self.simulated_acceptance = simulated_acceptance
        self.stream = lane_stream(target.device, VERIFY_STREAM_PRIORITY)
        self.serial = interpreted(target)

    def describe(self) -> LaneInfo:
        return self.info

    @property
    def applies_controls(self) -> bool:
        """Sampling controls, logprobs (model.logits_controls) and structured output's token masks
        (model.token_mask); not under simulated acceptance."""
        return self.simulated_acceptance is None

    @property
    def starts_async(self) -> bool:
        return self.stream is not None

    @property
    def feeds_tokens(self) -> bool:
        """Takes `verify_start(items, feed=...)` (overlapped plain decoding, engine.overlap)."""
        return getattr(self.target, "feeds_first_ids", False)

    @property
    def feeds_host_tokens(self) -> bool:
        """A feed's sources may end with HostTokens (the split topology's verify lane server)."""
        return self.feeds_tokens

    @property
    def fits_verdict(self) -> bool:
        """Takes `verify_start(items, fit=...)` of greedy items (engine.spec_ahead, model.verify_fit)."""
        return (
            self.simulated_acceptance is None
            and getattr(self.target, "fits_verdict", False)
            and getattr(self.target, "verifies_greedy", False)
        )

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        return self.verify_start(items).result()

    def verify_start(
        self, items: list[VerifyItem], feed: TokenFeed | None = None, fit: VerdictFit | None = None
    ) -> StartedCall:
        """Queues the verify forward and the acceptance on the verify stream; the results reach the
        host in `.result()` (the call's one host sync). `feed`: the items' pending tokens are rows
        of a previous call's `next_tokens`, read on the device (stream-ordered after that call).
        `fit`: the items are laid out for the longest outcome of an earlier call of this lane, fitted
        to its verdict on the device (stream-ordered after it)."""
        if not items:
            return Finished([])
        with on_stream(self.stream, self.serial):
            if self.stream is not None:
                wait_for_drafts(items, self.stream)
            return self._verify(items, feed, fit)

    def _verify(
        self, items: list[VerifyItem], feed: TokenFeed | None = None, fit: VerdictFit | None = None
    ) -> StartedCall:
        ks = [len(i.draft_tokens) for i in items]
        first_ids: torch.Tensor | None = None
        device = self.target.device
        if feed is not None:
            rows = list(feed.rows)
            if len(rows) != len(items):
                raise ValueError(f"a token feed needs one row per item: {len(rows)} rows, {len(items)} items")
            if self.stream is not None:  # a prefill's tokens come from another stream: keep their memory
                for source in feed.sources[1:]:  # from reuse there until this stream has read them (the
                    if not isinstance(source, HostTokens):  # first source is this stream's own last call's)
                        source.record_stream(self.stream)
            sources = [  # host tokens (split: a remote prefill's first tokens) reach the device on this stream
                sampler.small_tensor(list(s), device) if isinstance(s, HostTokens) else s for s in feed.sources
            ]
            source = sources[0] if len(sources) == 1 else torch.cat(sources)
            first_ids = (
                source if rows == list(range(source.shape[0])) else source[sampler.small_tensor(rows, source.device)]
            )
        on_device = device_drafts(items)
        # With drafts on the device, runs carry placeholders and the runner writes the real ids.
        runs = [
            TokenRun(
                [i.pending_token] + ([0] * k if on_device else list(i.draft_tokens)), i.start_pos, i.target_kv.block_ids
            )
            for i, k in zip(items, ks)
        ]
        R, K = len(items), max(ks)
        fed: _Fed = {} if first_ids is None else {"first_ids": first_ids}
        if not all(plain_item(i) for i in items):  # sampling controls, logprobs or structured output
            if self.simulated_acceptance is not None:
                raise ValueError(
                    "sampling controls, logprobs and token masks cannot run on a simulated-acceptance lane"
                )
            if fit is not None or first_ids is not None:
                raise ValueError("verify items with sampling controls, logprobs or a token mask take no feed or fit")
            return self._verify_processed(items, runs, ks, on_device)
        if (
            K > 0
            and self.simulated_acceptance is None
            and all(i.sampling.greedy for i in items)
            and getattr(self.target, "verifies_greedy", False)
        ):  # forward + acceptance: one replay
            if fit is not None:
                fed["fit"] = (fit.started.verdict, fit.rows, fit.ks)
            verdict = self.target.verify_greedy(runs, ks, on_device.gather(items, K) if on_device else None, **fed)
            return HostCopy(verdict, verdict_outputs(items), verdict=verdict)
        if fit is not None:
            raise ValueError("a verify call fitted to an earlier verdict must be greedy, with drafts (fits_verdict)")
        if on_device is not None:
            drafts = on_device.gather(items, K)  # [R, K] on the device
            logits = self.target.score(runs, drafts, **fed)  # [R, K+1, V], padded
        else:
            drafts_np = np.zeros((R, K), dtype=np.int64)
            for n, item in enumerate(items):
                drafts_np[n, : ks[n]] = list(item.draft_tokens)
            drafts = torch.from_numpy(drafts_np).to(device, non_blocking=True)
            logits = self.target.score(runs, **fed)
        if K == 0 and all(i.sampling.greedy for i in items):  # plain greedy decoding: nothing to accept
            finals = logits[:, 0].argmax(-1)
            return HostCopy(
                finals,
                lambda host: [VerifyOutput(i.request_id, 0, [f]) for i, f in zip(items, host)],
                next_tokens=finals,
            )
        k = sampler.small_tensor(ks, device)
        if self.simulated_acceptance is not None:
            accepted, final = self._accept_simulated(items, logits.argmax(-1), k)
        elif all(i.sampling.greedy for i in items):
            accepted, final = sampler.accept_greedy(logits.argmax(-1), drafts, k)
        else:
            accepted, final = self._accept_sampled(items, logits, drafts, k)
        # What the host needs of a draft + verify step: counts, target tokens and the drafts.
        verdict = torch.cat((accepted[:, None], final[:, None], drafts), dim=1)
        return HostCopy(
            verdict,
            verdict_outputs(items),
            verdict=verdict if K > 0 else None,
            # clamped: a NO_TOKEN row (a NaN distribution) must not index the next step's
            # embedding on the device; the router refuses it when this step's tokens arrive
            next_tokens=final.to(torch.long).clamp(min=0) if K == 0 else None,
        )

    def _verify_processed(
        self, items: list[VerifyItem], runs: list[TokenRun], ks: list[int], on_device: DraftBatch | None
    ) -> HostCopy:
        """A verify call where some item has sampling controls, logprobs or a structured-output mask:
        score, the controls at every position (model.logits_controls: the drafts before a position
        count as its history), the masks (model.token_mask: row j of an item's mask is its position
        j's, made by the router from the same history), the target's choice at each position, then
        the greedy rule over those choices (the coupled acceptance of `sampler.accept_raced`, on the
        processed distributions). Eager; leaves no tokens on the device to feed (overlapped chains
        need plain items)."""
        R, K = len(items), max(ks)
        device = self.target.device
        if on_device is not None:
            drafts = on_device.gather(items, K)
            logits = self.target.score(runs, drafts)
        else:
            drafts_np = np.zeros((R, K), dtype=np.int64)
            for n, item in enumerate(items):
                drafts_np[n, : ks[n]] = list(item.draft_tokens)
            drafts = torch.from_numpy(drafts_np).to(device, non_blocking=True)
            logits = self.target.score(runs)
        samplings = [i.sampling for i in items]
        processed = logits_controls.apply(logits, samplings, [i.controls for i in items], drafts if K else None)
        # the mask seam (domain.sampling_controls step 5): row r position p masked under the same
        # history as the controls, before temperature / top-k / top-p in `choose`
        processed = apply_masks(processed, [i.token_mask for i in items], fallback=logits)
        tokens = logits_controls.choose(processed, samplings, [i.start_pos + 1 for i in items])  # [R, K + 1]
        accepted, final = sampler.accept_greedy(tokens, drafts, sampler.small_tensor(ks, device))
        verdict = torch.cat((accepted[:, None], final[:, None], drafts), dim=1)
        top_n = max(s.top_logprobs for s in samplings)
        table = logits_controls.logprob_table(logits, tokens, top_n) if any(s.logprobs for s in samplings) else None
        rows_of = verdict_outputs(items)

        def outputs(host: list[list[int]], lp: list | None = None) -> list[VerifyOutput]:
            result = rows_of(host)
            if lp is not None:
                for n, (item, out) in enumerate(zip(items, result, strict=True)):
                    if item.sampling.logprobs:
                        out.logprobs = logits_controls.logprobs_of(lp[n], out.new_tokens, item.sampling.top_logprobs)
            return result

        return HostCopy(verdict, outputs, verdict=verdict if K > 0 else None, extra=table)

    def _accept_sampled(self, items, logits, drafts, k):
        """Coupled acceptance (sampler module doc): items' draft probabilities, if any came (an
        older draft lane over gRPC), are not needed and not read."""
        R, K1, V = logits.shape
        samplings = [i.sampling for i in items]
        temp, top_k, top_p, seeds = sampler.params_tensor(samplings, logits.device)
        mode = sampler.choice_mode(samplings)
        p = sampler.probabilities(
            logits.reshape(R * K1, V).float(),
            temp.repeat_interleave(K1),
            top_k.repeat_interleave(K1),
            top_p.repeat_interleave(K1),
            truncate=mode == sampler.SAMPLE_TRUNCATED,
        ).view(R, K1, V)
        start = sampler.small_tensor([i.start_pos for i in items], logits.device)
        return sampler.accept_raced(p, drafts, k, seeds, start)

    def _accept_simulated(self, items, target_argmax, k):
        R, K1 = target_argmax.shape
        seeds = sampler.seed_tensor([zlib.crc32(i.request_id.encode()) for i in items], target_argmax.device)
        start = sampler.small_tensor([i.start_pos for i in items], target_argmax.device)
        pos = start[:, None] + 1 + torch.arange(K1 - 1, device=target_argmax.device)[None, :]
        u = sampler.uniforms(seeds[:, None].expand_as(pos), pos, sampler.STREAM_ACCEPT)
        valid = torch.arange(K1 - 1, device=k.device)[None, :] < k[:, None]
        accepted = ((u < self.simulated_acceptance) & valid).long().cumprod(-1).sum(-1)
        return accepted, target_argmax.gather(1, accepted[:, None]).squeeze(1)

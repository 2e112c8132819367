"""The router's prefill calls and their commits (a mixin of Router, split out of router.py to keep it
under 500 lines). Torch-free."""

from __future__ import annotations

from concurrent.futures import Future

from verifypd.domain.lanes import PrefillItem
from verifypd.domain.requests import RequestOutput
from verifypd.router.router_calls import StartedPrefill
from verifypd.router.scheduler import PrefillChunk
from verifypd.router.sequence import SeqStatus


class PrefillCalls:
    def _prefill_items(self, chunks: list[PrefillChunk]) -> list[PrefillItem]:
        return [
            PrefillItem(
                request_id=c.seq.request_id,
                token_ids=c.seq.ids(c.start, c.end),
                start_pos=c.start,
                target_kv=self._handle(self.target_pool, c.seq.target_blocks, c.start, c.seq.target_computed),
                draft_kv=self._draft_handle(c.seq, c.start, c.seq.draft_computed) if c.with_draft else None,
                sample_first=c.sample_first,
                sampling=c.seq.spec.sampling,
            )
            for c in chunks
        ]

    def _start_prefill(self, chunks: list[PrefillChunk]) -> StartedPrefill:
        t0 = self._clock()
        started = self.prefill_lane.prefill_start(self._prefill_items(chunks))
        return StartedPrefill(started, self._clock() - t0, self._clock)

    def _call_prefill(self, items: list[PrefillItem]) -> tuple[list, float]:
        t0 = self._clock()
        results = self.prefill_lane.prefill(items)
        return results, self._clock() - t0

    def _run_prefill(
        self, chunks: list[PrefillChunk], pending: Future | StartedPrefill | None = None
    ) -> list[RequestOutput]:
        """Prefills `chunks` (or takes the results of their call already in flight) and commits them."""
        if not chunks:
            return []
        results, seconds = pending.result() if pending is not None else self._call_prefill(self._prefill_items(chunks))
        self.observer.on_lane_step("prefill", seconds, len(chunks))
        return self._commit_prefill(chunks, results)

    def _commit_prefill(self, chunks: list[PrefillChunk], results) -> list[RequestOutput]:
        outputs = []
        for c, res in zip(chunks, results):
            seq = c.seq
            seq.target_computed = c.end
            # A pool-less lane gets the prompt with its first draft call, and so does a model draft
            # whose KV this chunk skipped (draft_computed lags; the draft call catches up).
            if self.draft_pool is not None and c.with_draft:
                seq.draft_computed = c.end
            if c.end == seq.prefill_target:
                seq.status = SeqStatus.DECODING
            if c.sample_first:
                assert res.first_token is not None, "prefill lane returned no first token"
                outputs += self._emit(seq, [res.first_token], applied_k=0)
        return outputs

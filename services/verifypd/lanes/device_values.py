"""Values one in-process lane hands to the next or to the host while they stay on the device: a
draft call's proposals (`DraftBatch`, one [B, K] tensor; `DeviceDraftTokens`, one request's row of
it, read on the host only if someone iterates it), and a lane call's results on their way to the
host (`HostCopy`: one pinned copy and an event, waited for only when asked). Torch, no lanes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verifypd.domain.lanes import VerifyItem, VerifyOutput
from verifypd.model import sampler


def verdict_outputs(items: list[VerifyItem]):
    """Host rows [accepted, final token, drafts ...] (one per item) -> the items' VerifyOutputs."""
    return lambda host: [
        VerifyOutput(i.request_id, row[0], row[2 : 2 + row[0]] + [row[1]]) for i, row in zip(items, host)
    ]


class HostCopy:
    """A device tensor on its way to the host: an asynchronous copy into pinned memory on the current
    stream, then an event. `result()` waits for the event (releasing the GIL) and converts the
    values; on the CPU the values are there already. `next_tokens`: a verify call of k = 0 items
    leaves each row's chosen token here, on the device, for the next step to read (engine.overlap).
    `verdict`: a speculative verify call's [R, K + 2] rows (accepted, final token, drafts) on the
    device, read by drafts launched before they reach the host (engine.draft_after) on `stream`."""

    def __init__(
        self,
        tensor: torch.Tensor,
        convert,
        next_tokens: torch.Tensor | None = None,
        verdict: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
    ):
        """`extra`: a second tensor copied alongside (logprobs); `convert` then takes both lists."""
        self._convert, self._event, self.next_tokens, self.verdict = convert, None, next_tokens, verdict
        # (the stream is looked up only where a verdict is kept: current_stream costs host time every step)
        self.stream = torch.cuda.current_stream(tensor.device) if verdict is not None and tensor.is_cuda else None
        self._host = self._snapshot(tensor)
        self._extra = None if extra is None else self._snapshot(extra)
        if tensor.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @staticmethod
    def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            return host
        # a snapshot, as the copy is on CUDA: a graph's static buffer is rewritten by the next
        return tensor.clone()  # call, which may be launched before this one's result() (spec_ahead)

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        if self._extra is not None:
            return self._convert(self._host.tolist(), self._extra.tolist())
        return self._convert(self._host.tolist())


def wait_for_drafts(items: list[VerifyItem], stream) -> None:
    """Orders the drafts' producer (the draft stream) before `stream`, and keeps their memory from
    being reused by the draft stream's allocator while `stream` may still read it."""
    batches = {}
    for item in items:
        if isinstance(item.draft_tokens, DeviceDraftTokens):
            batches[id(item.draft_tokens.batch)] = item.draft_tokens.batch
    for batch in batches.values():
        if batch.ready is not None:
            stream.wait_event(batch.ready)
        if batch.tokens.is_cuda:
            batch.tokens.record_stream(stream)


class DraftBatch:
    """The proposals of one in-process draft call, [B, K] on the device; copied to the host at most
    once, and only if someone iterates them (e.g. a gRPC verify lane)."""

    def __init__(self, tokens: torch.Tensor, ready: torch.cuda.Event | None = None):
        self.tokens = tokens
        self.ready = ready  # recorded on the draft stream after the tokens were written (CUDA)
        self._host: list[list[int]] | None = None

    def host(self) -> list[list[int]]:
        if self._host is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._host = self.tokens.tolist()
        return self._host

    def gather(self, items: list[VerifyItem], K: int) -> torch.Tensor:
        """[len(items), K] drafts of the verify items, in their order (zeros where k = 0). Items whose
        drafts are host lists (prompt lookup's, engine.lookup_mix) are written in by one small copy,
        without waiting for this batch's values."""
        rows = [
            i.draft_tokens.row if isinstance(i.draft_tokens, DeviceDraftTokens) and len(i.draft_tokens) else -1
            for i in items
        ]
        width = min(K, self.tokens.shape[1])
        if rows == list(range(len(items))) and self.tokens.shape[0] >= len(items):
            return self.tokens[: len(items), :K] if width == K else _pad(self.tokens[: len(items), :width], K)
        out = torch.zeros(len(items), K, dtype=self.tokens.dtype, device=self.tokens.device)
        src = [(n, r) for n, r in enumerate(rows) if r >= 0]
        if src:
            dst_idx = sampler.small_tensor([n for n, _ in src], out.device)
            src_idx = sampler.small_tensor([r for _, r in src], out.device)
            out[dst_idx, :width] = self.tokens[src_idx, :width]
        hosted = [(n, list(i.draft_tokens)) for n, i in enumerate(items) if rows[n] < 0 and len(i.draft_tokens)]
        if hosted:  # small_tensor: pinned, queued (a pageable copy would wait for the draft call's work)
            values = sampler.small_tensor(
                [t for _, tokens in hosted for t in tokens + [0] * (K - len(tokens))], out.device, out.dtype
            )
            out[sampler.small_tensor([n for n, _ in hosted], out.device)] = values.view(len(hosted), K)
        return out


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


class DeviceDraftTokens(Sequence[int]):
    """Row `row` of a DraftBatch: a sequence of `k` ints whose values stay on the device unless read."""

    def __init__(self, batch: DraftBatch, row: int, k: int):
        self.batch, self.row, self.k = batch, row, k

    def __len__(self) -> int:
        return self.k

    def _values(self) -> list[int]:
        return self.batch.host()[self.row][: self.k]

    def __getitem__(self, index):
        return self._values()[index]

    def __iter__(self):
        return iter(self._values())


def device_drafts(items: list[VerifyItem]) -> DraftBatch | None:
    """The one DraftBatch the device-backed drafts come from (others may be host lists: DraftBatch.gather
    writes those in), or None (no device drafts, or several batches)."""
    batch = None
    for item in items:
        if not isinstance(item.draft_tokens, DeviceDraftTokens) or not len(item.draft_tokens):
            continue
        if batch is None:
            batch = item.draft_tokens.batch
        elif item.draft_tokens.batch is not batch:
            return None
    return batch

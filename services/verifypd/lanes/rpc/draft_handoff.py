"""Draft tokens from a draft lane to a co-located verify lane on the device (lanes.proto
`DraftHandoff`): the split topology's replacement for the in-process lanes' shared tensor.

Without it, a split step is serial on the host: the draft lane waits for its GPU work to copy the
proposals out, the router forwards them, and only then does the verify lane start preparing its
forward, while the GPU idles. With it the draft lane replies as soon as its work is enqueued and
the verify lane's preparation overlaps the draft's GPU time; the device orders the two through
the slot's interprocess event (IPC shares memory, not ordering).

    DraftHandoffBuffer (draft lane)     owns the buffer and events; write(slot, tokens) after a draft
    OpenedHandoff (verify lane)         opened once at wiring; drafts(slot) waits and returns a DraftBatch
"""

from __future__ import annotations

import torch

from verifypd.domain.requests import MAX_K
from verifypd.lanes.device_values import DraftBatch
from verifypd.lanes.rpc import cuda_ipc
from verifypd.lanes.rpc.kv_transport import host_boot_id
from verifypd.v1 import lanes_pb2

SLOTS = 2
ROWS = 1024  # items per handed-off draft call (larger calls take the host path)


class DraftHandoffBuffer:
    def __init__(self, device: torch.device, rows: int = ROWS, cols: int = MAX_K):
        self.tokens = torch.zeros(SLOTS, rows, cols, dtype=torch.long, device=device)
        self.events = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]
        for event in self.events:  # an event must be recorded once before its handle is taken
            event.record()
        self.device = device

    def describe(self) -> lanes_pb2.DraftHandoff:
        return lanes_pb2.DraftHandoff(
            buffer=cuda_ipc.share(self.tokens),
            device_uuid=cuda_ipc.device_uuid(self.device),
            host_boot_id=host_boot_id(),
            rows=self.tokens.shape[1],
            cols=self.tokens.shape[2],
            slot_events=[bytes(e.ipc_handle()) for e in self.events],
        )

    def write(self, slot: int, drafts: DraftBatch) -> None:
        """The proposals of one draft call (row n = item n) into `slot` (1-based), then its event.
        Runs on the current stream, after the draft stream's write of the proposals (`ready`)."""
        tokens = drafts.tokens
        stream = torch.cuda.current_stream(self.device)
        if drafts.ready is not None:
            stream.wait_event(drafts.ready)
        rows, cols = min(tokens.shape[0], self.tokens.shape[1]), min(tokens.shape[1], self.tokens.shape[2])
        self.tokens[slot - 1, :rows, :cols].copy_(tokens[:rows, :cols], non_blocking=True)
        tokens.record_stream(stream)  # allocated on the draft stream, read here
        self.events[slot - 1].record(stream)


class OpenedHandoff:
    """A verify lane's view of the draft lane's buffer."""

    def __init__(self, d: lanes_pb2.DraftHandoff, device: torch.device):
        if d.device_uuid != cuda_ipc.device_uuid(device) or d.host_boot_id != host_boot_id():
            raise ValueError("the draft lane's handoff buffer is on another device or host")
        if len(d.slot_events) != SLOTS or not (1 <= d.rows <= 1 << 16 and 1 <= d.cols <= MAX_K):
            raise ValueError(f"need {SLOTS} slot events, rows in [1, 65536] and cols in [1, {MAX_K}]")
        self.rows, self.cols = d.rows, d.cols
        self.tokens = cuda_ipc.open_tensor(d.buffer, d.device_uuid, (SLOTS, d.rows, d.cols), torch.long)
        self.events = [torch.cuda.Event.from_ipc_handle(self.tokens.device, h) for h in d.slot_events]

    def drafts(self, slot: int) -> DraftBatch:
        """The slot's proposals as a DraftBatch, ordered after the draft lane's write."""
        torch.cuda.current_stream(self.tokens.device).wait_event(self.events[slot - 1])
        return DraftBatch(self.tokens[slot - 1])

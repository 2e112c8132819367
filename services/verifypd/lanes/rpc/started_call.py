"""A work call written to a lane's call channel whose reply is read later (`StartedLaneCall`, the lane
clients' StartedCall). Torch-free. Replies come in call order: reading one first reads those of the
calls written before it, which the lane client that wrote them (its `CallOwner` side) keeps in order.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from verifypd.domain.lanes import LaneError
from verifypd.lanes.rpc.call_channel import CallClient, ChannelClosed
from verifypd.lanes.rpc.call_pipeline import ChannelTokens
from verifypd.lanes.rpc.lane_spans import end_call_span


class CallOwner(Protocol):
    """What a started call uses of the lane client that wrote it (lane_client.py)."""

    lane: str
    addr: str

    def first_pending(self, call: StartedLaneCall) -> bool: ...

    def finish_started(self, call: StartedLaneCall) -> None: ...

    def count_channel_call(self, client: CallClient) -> None: ...


class StartedLaneCall:
    """A work call written to a lane's call channel, its reply not read yet (a StartedCall)."""

    def __init__(self, lane: CallOwner, client: CallClient, call_id: int, items, decode, name: str, span=None):
        self.lane, self.client, self.call_id = lane, client, call_id
        self.items, self.decode, self.name = items, decode, name
        self.span = span  # the call's trace span (lane_spans.py), ended with its reply; None: untraced
        self.done = False
        self.next_tokens: ChannelTokens | None = None  # a plain verify call's tokens, on the lane's device
        self.value: list | None = None
        self.error: LaneError | None = None

    def ready(self) -> bool:
        return self.done or self.lane.first_pending(self) and self.client.reply_waiting()

    def result(self) -> list:
        if not self.done:
            self.lane.finish_started(self)
        if self.error is not None:
            raise self.error
        if self.value is None:  # complete() raised while decoding (the first result() call raised it)
            raise LaneError(f"{self.lane.lane} lane at {self.lane.addr}: {self.name}: its reply was not decoded")
        return self.value

    def complete(self) -> None:
        """Reads and decodes the reply (once); a failure is kept for `result()` to raise."""
        if self.done:
            return
        self.done = True
        try:
            self._complete()
        finally:
            end_call_span(self.span, str(self.error) if self.error is not None else None)

    def _complete(self) -> None:
        lane, client, where = self.lane, self.client, f"{self.lane.lane} lane at {self.lane.addr}: {self.name}"
        try:
            reply = client.receive(self.call_id)
        except (OSError, ChannelClosed) as exc:
            self.error = LaneError(f"{where} failed: UNAVAILABLE: {exc}")
            return
        if reply.status_code:
            code = next((c.name for c in grpc.StatusCode if c.value[0] == reply.status_code), reply.status_code)
            self.error = LaneError(f"{where} failed: {code}: {reply.error}")
            return
        try:
            self.value = self.decode(self.items, reply)
        except (IndexError, ValueError) as exc:
            client.close()
            self.error = LaneError(f"{where}: malformed reply: {exc}")
            return
        lane.count_channel_call(client)

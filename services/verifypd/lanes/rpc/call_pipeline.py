"""Pipelined verify calls on the call channel: a chain of plain decoding steps over the lane RPC,
as the in-process lanes run it (router/steps/overlapped.py). Torch-free.

The router sends verify call N + 1 before N's reply has come back; N + 1's pending tokens are
N's chosen tokens, which never left the verify lane's device: the call names N (`feed_call`)
and, per item, its row in N (`feed_rows_u32`), instead of carrying the tokens. So the lane can
launch N + 1 right behind N on its stream, and its GPU does not idle through the round trip,
the router's commit of N and the encoding of N + 1.

    router side   ChannelTokens      a started call's `next_tokens`: a reference (connection,
                                     call id, rows), never values
                  feed_fields        a TokenFeed of one ChannelTokens -> (feed_call, feed_rows_u32)
    lane side     FedTokens          per connection: the last verify call's id and its next_tokens
                                     (the device tensor the local lane left); `feed` turns a call's
                                     feed_call / feed_rows_u32 into the local lane's TokenFeed
                  DeferredReply      a verify call launched, its reply built later (after the next
                                     call was launched) by the connection's ReplyWriter
                  ReplyWriter        the thread that finishes and writes a connection's replies in
                                     call order, while the connection's reader decodes and launches

At most MAX_IN_FLIGHT calls are in flight on one connection (the call the router waits for, and
the next one), as colocated chains hold at most one step ahead. Only the previous call's tokens
can feed: the lane keeps no older ones (a CUDA graph's static output is rewritten by the next
replay), and refuses any other `feed_call` (FAILED_PRECONDITION).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from verifypd.domain.lanes import HostTokens, TokenFeed
from verifypd.lanes.rpc import lane_validate as lv
from verifypd.v1 import lanes_pb2

log = logging.getLogger("verifypd.call_channel")
MAX_IN_FLIGHT = 2  # calls on one connection whose replies are not read yet
HOST_ROW = 0xFFFFFFFF  # a feed_rows_u32 entry: this item's pending token is in pending_u32 (call_codec.NONE_U32)


class ChannelTokens:
    """Router side: the chosen tokens of verify call `call_id` on connection `client`, left on the
    verify lane's device (`rows` items, in item order). Opaque: the router only passes it back in a
    TokenFeed."""

    def __init__(self, client: object, call_id: int, rows: int):
        self.client, self.call_id, self.rows = client, call_id, rows


def feed_fields(feed: TokenFeed, client: object, last_call: int, items: int) -> tuple[int, bytes, list[int] | None]:
    """(feed_call, feed_rows_u32, pending tokens or None) of a verify call fed by `feed`: rows of the
    previous call's tokens, and after them, with a HostTokens source, tokens the host has (sent in
    pending_u32, their rows NONE_U32). ValueError where the feed is not the previous verify call's
    tokens on this same connection (a reconnect, an in-process prefill's tokens)."""
    from verifypd.lanes.rpc.call_codec import NONE_U32, u32

    host = feed.sources[1] if len(feed.sources) == 2 and isinstance(feed.sources[1], HostTokens) else None
    source = feed.sources[0]
    if len(feed.sources) != 1 + (host is not None) or not isinstance(source, ChannelTokens):
        raise ValueError("a remote verify lane is fed only by its own previous call's tokens (and host tokens)")
    if source.client is not client or source.call_id != last_call:
        raise ValueError(
            f"the token feed names call {source.call_id}, not the previous verify call on this connection ({last_call})"
        )
    limit = source.rows + (len(host) if host is not None else 0)
    if len(feed.rows) != items or any(not 0 <= r < limit for r in feed.rows):
        raise ValueError(f"a token feed needs one row in [0, {limit}) per item; got {len(feed.rows)} rows")
    if host is None:
        return source.call_id, u32(feed.rows), None
    rows = [r if r < source.rows else NONE_U32 for r in feed.rows]
    pending = [0 if r < source.rows else host[r - source.rows] for r in feed.rows]
    return source.call_id, u32(rows), pending


class FedTokens:
    """Lane side, one per connection: the last verify call's id and the tokens it left."""

    def __init__(self) -> None:
        self.call_id = 0
        self.tokens: Any = None  # the local lane's StartedCall.next_tokens (None: it left none)
        self.rows = 0

    def keep(self, call_id: int, tokens: Any, rows: int) -> None:
        self.call_id, self.tokens, self.rows = call_id, tokens, rows

    def feed(self, batch: lanes_pb2.PackedBatch, items: int) -> TokenFeed | None:
        """The TokenFeed of a verify call (None: its pending tokens came in pending_u32): rows of the
        last call's tokens, then (rows NONE_U32) HostTokens of pending_u32. Raises LaneInvalid
        naming the field."""
        if not batch.feed_call:
            if batch.feed_rows_u32:
                raise lv.LaneInvalid("batch.feed_rows_u32: given without batch.feed_call")
            return None
        if batch.feed_call != self.call_id or self.tokens is None:
            raise lv.LaneInvalid(
                f"batch.feed_call: {batch.feed_call} is not the previous verify call on this connection "
                f"with tokens left on the device (that is {self.call_id or 'none'})",
                lv.grpc.StatusCode.FAILED_PRECONDITION,
            )
        data = batch.feed_rows_u32
        if len(data) != 4 * items:
            raise lv.LaneInvalid(f"batch.feed_rows_u32: {len(data)} bytes, expected {4 * items} (uint32 per item)")
        rows = [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
        fed = [r for r in rows if r != HOST_ROW]
        if fed and max(fed) >= self.rows:
            raise lv.LaneInvalid(f"batch.feed_rows_u32: row {max(fed)} is outside call {self.call_id}'s {self.rows}")
        if len(fed) == len(rows):
            return TokenFeed((self.tokens,), tuple(rows))
        if len(batch.pending_u32) != 4 * items:
            raise lv.LaneInvalid(f"batch.pending_u32: {len(batch.pending_u32)} bytes, expected {4 * items}")
        pending = batch.pending_u32
        host, at = [], []
        for i, r in enumerate(rows):
            if r == HOST_ROW:  # the item's own pending token, after the last call's rows
                at.append(i)
                host.append(int.from_bytes(pending[4 * i : 4 * i + 4], "little"))
        for j, i in enumerate(at):
            rows[i] = self.rows + j
        return TokenFeed((self.tokens, HostTokens(host)), tuple(rows))


class DeferredReply:
    """A call whose work is launched; `finish()` waits for its results and builds the reply (an
    INTERNAL one if that fails). `finish` runs on the connection's ReplyWriter thread."""

    def __init__(self, finish: Callable[[], lanes_pb2.LaneReply]):
        self._finish = finish

    def finish(self) -> lanes_pb2.LaneReply:
        return self._finish()


class ReplyWriter:
    """Writes one connection's replies in call order on its own thread; a DeferredReply is finished
    there, so the reader can decode and launch the next call meanwhile. After an error reply (or a
    failed write) it shuts the connection down, which ends the reader too."""

    def __init__(self, conn, write: Callable[[Any, bytes], None], shutdown: Callable[[Any], None]):
        self.conn, self._write, self._shutdown = conn, write, shutdown
        # Bounded: a reader never runs further ahead than the router may send.
        self.replies: queue.Queue = queue.Queue(maxsize=MAX_IN_FLIGHT)
        self.failed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="call-replies", daemon=True)
        self.thread.start()

    def put(self, call_id: int, reply: lanes_pb2.LaneReply | DeferredReply) -> bool:
        """Queues a reply; False once the connection failed (the reader stops)."""
        while not self.failed.is_set():
            try:
                self.replies.put((call_id, reply), timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """The reader is done: write what is queued, then stop."""
        self.put(0, None)  # type: ignore[arg-type]
        self.thread.join()

    def _run(self) -> None:
        while True:
            call_id, reply = self.replies.get()
            if reply is None:
                return
            if isinstance(reply, DeferredReply):
                reply = reply.finish()
            reply.call_id = call_id
            try:
                self._write(self.conn, reply.SerializeToString())
            except OSError:
                reply = lanes_pb2.LaneReply(status_code=1)  # the client is gone: stop as after an error
            if reply.status_code:
                self.failed.set()
                self._shutdown(self.conn)
                return

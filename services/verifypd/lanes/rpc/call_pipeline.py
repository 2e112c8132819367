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

from verifypd.domain.lanes import TokenFeed
from verifypd.lanes.rpc import lane_validate as lv
from verifypd.v1 import lanes_pb2

log = logging.getLogger("verifypd.call_channel")
MAX_IN_FLIGHT = 2  # calls on one connection whose replies are not read yet


class ChannelTokens:
    """Router side: the chosen tokens of verify call `call_id` on connection `client`, left on the
    verify lane's device (`rows` items, in item order). Opaque: the router only passes it back in a
    TokenFeed."""

    def __init__(self, client: object, call_id: int, rows: int):
        self.client, self.call_id, self.rows = client, call_id, rows


def feed_fields(feed: TokenFeed, client: object, last_call: int, items: int) -> tuple[int, bytes]:
    """(feed_call, feed_rows_u32) of a verify call fed by `feed`; ValueError where the feed is not
    the previous verify call's tokens on this same connection (a reconnect, a prefill's tokens)."""
    from verifypd.lanes.rpc.call_codec import u32

    if len(feed.sources) != 1 or not isinstance(feed.sources[0], ChannelTokens):
        raise ValueError("a remote verify lane is fed only by its own previous call's tokens")
    source = feed.sources[0]
    if source.client is not client or source.call_id != last_call:
        raise ValueError(
            f"the token feed names call {source.call_id}, not the previous verify call on this connection ({last_call})"
        )
    if len(feed.rows) != items or any(not 0 <= r < source.rows for r in feed.rows):
        raise ValueError(f"a token feed needs one row in [0, {source.rows}) per item; got {len(feed.rows)} rows")
    return source.call_id, u32(feed.rows)


class FedTokens:
    """Lane side, one per connection: the last verify call's id and the tokens it left."""

    def __init__(self) -> None:
        self.call_id = 0
        self.tokens: Any = None  # the local lane's StartedCall.next_tokens (None: it left none)
        self.rows = 0

    def keep(self, call_id: int, tokens: Any, rows: int) -> None:
        self.call_id, self.tokens, self.rows = call_id, tokens, rows

    def feed(self, batch: lanes_pb2.PackedBatch, items: int) -> TokenFeed | None:
        """The TokenFeed of a verify call (None: its pending tokens came in pending_u32). Raises
        LaneInvalid naming the field."""
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
        rows = tuple(int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4))
        if rows and max(rows) >= self.rows:
            raise lv.LaneInvalid(f"batch.feed_rows_u32: row {max(rows)} is outside call {self.call_id}'s {self.rows}")
        return TokenFeed((self.tokens,), rows)


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

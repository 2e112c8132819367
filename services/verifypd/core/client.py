"""The gateway's side of the engine core: submit, cancel and control over the core channel,
on the gateway's event loop (no thread per request). Torch-free.

One reader task takes the core's messages: a `step` message (one per engine step, every request
that got tokens) is split into per-request `Chunk`s; detokenization and stop strings happen here,
in the gateway process, so the engine's steps never pay for them. A stop string ends the stream
with STOP at once and cancels the request in the core (the core may have run one more step for it:
those tokens are dropped, as vLLM's front end does).

If the core process dies (the channel closes), every request in flight ends with UNAVAILABLE at
once, nothing hangs, and `failed` says why. While the core lives but takes no request (a step stuck
on a slow or hung lane: its heartbeat says `stalled`; or no heartbeat for CORE_SILENCE_S),
`admitting` is False and `on_state` tells the gateway (health NOT_SERVING); a request submitted
meanwhile waits to be added rather than fail, as long as the core's heartbeat goes on.
`on_failure(message, exited)` is told when the engine
fails for good (health goes NOT_SERVING) and whether its process is gone (`verifypd serve` then
exits, so that its supervisor, Kubernetes, restarts the pod).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from verifypd.core.channel import (
    USAGE_KEYS,
    AsyncChannel,
    ChannelClosed,
    b64,
    finish_from_wire,
    logprobs_from_wire,
    spec_to_wire,
    unb64,
)
from verifypd.core.loop import Draining, Overloaded, Unavailable
from verifypd.core.tracing import GatewaySpan, GatewaySpans
from verifypd.domain.requests import FinishReason, InvalidRequest, RequestSpec, TokenLogprob
from verifypd.router.detokenize import IncrementalDetokenizer
from verifypd.v1 import control_pb2, generate_pb2

log = logging.getLogger("verifypd.gateway")
access_log = logging.getLogger("verifypd.access")
READY_TIMEOUT_S = 3600.0  # a large model loads and captures graphs before the core is ready
# The core sends a heartbeat every second (core_server.HEARTBEAT_S) from a thread of its own. Silent
# this long: the process is stopped or wedged; requests waiting to be added fail, health NOT_SERVING.
CORE_SILENCE_S = 30.0


@dataclass(slots=True)
class Chunk:
    """One streamed piece of a request: the tokens of one engine step, or of several in a row
    (`merge_chunks`). `usage`: the cumulative counts in USAGE_KEYS order (`usage_dict`)."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    usage: list[int]
    applied_k: int  # the draft length of the last step whose tokens this chunk carries
    ttft_s: float | None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked

    def usage_dict(self) -> dict[str, int]:
        return dict(zip(USAGE_KEYS, self.usage, strict=False))


@dataclass(slots=True)
class Failure:
    code: grpc.StatusCode
    message: str


def merge_chunks(items: list) -> list:
    """Runs of consecutive Chunks merged into one each (tokens and text in order; finish, usage
    and k of the run's last; TTFT of its first); anything else (Failure, a front end's marker)
    stays where it was. A consumer that fell behind the engine by several steps sends one message
    for them instead of one per step: the gateway's cost per token falls as its load rises."""
    out: list = []
    for item in items:
        last = out[-1] if out else None
        if isinstance(item, Chunk) and isinstance(last, Chunk) and not last.finished:
            out[-1] = Chunk(
                last.token_ids + item.token_ids,
                last.text + item.text,
                item.finished,
                item.finish_reason,
                item.usage,
                item.applied_k,
                last.ttft_s if last.ttft_s is not None else item.ttft_s,
                None if last.logprobs is None or item.logprobs is None else last.logprobs + item.logprobs,
            )
        else:
            out.append(item)
    return out


class StreamBox:
    """A request's pending items for its one consumer task (the gRPC handler or the HTTP response):
    `put` from the reader task never blocks; `take` waits for at least one item and returns all of
    them, consecutive chunks merged. Lighter than an asyncio.Queue: no getter deque, one future
    only while the consumer waits."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self._items = self._items, []
        return merge_chunks(items) if len(items) > 1 else items


class RequestStream:
    """A request in flight: `box` yields Chunk | Failure (and whatever else a front end puts in)."""

    def __init__(
        self, request_id: str, rid: int, detok: IncrementalDetokenizer, stop_ids: frozenset[int] = frozenset()
    ):
        # request_id: the client's id, a label only (echoed, logged); rid: the gateway's own key
        self.request_id, self.rid, self.detok = request_id, rid, detok
        self.stop_ids = stop_ids  # the request's stop_token_ids
        self.api, self.t0, self.prompt_tokens = "grpc", 0.0, 0  # for the access log line
        self.span: GatewaySpan | None = None  # the gateway's trace span of this request (core/tracing.py), when traced
        self.box = StreamBox()
        self.added: asyncio.Future = asyncio.get_running_loop().create_future()


_REFUSALS = {"INVALID_ARGUMENT": InvalidRequest, "RESOURCE_EXHAUSTED": Overloaded}


class CoreClient:
    def __init__(
        self,
        channel: AsyncChannel,
        codec,
        *,
        on_failure: Callable[[str, bool], None] | None = None,
        on_state: Callable[[], None] | None = None,
    ):
        self.channel, self.codec, self.on_failure, self.on_state = channel, codec, on_failure, on_state
        self.info: generate_pb2.ServerInfo | None = None
        self.eos: frozenset[int] = frozenset()
        self.prefix_cache = False  # the core caches prefixes (its ready message says)
        self.failed: str | None = None
        self.draining = False
        self.access_log = False  # `serve --access-log`: one verifypd.access line per request
        self.spans: GatewaySpans | None = None  # the requests' trace spans when OTLP traces are on (core/tracing.py)
        self.stopping = False  # stop() sent: the core's exit is a shutdown, not a failure
        self.stalled: str | None = None  # why the core takes no request now (its heartbeat says)
        self.last_heard = time.monotonic()  # any message from the core
        self._silent = False
        self._ids = itertools.count(1)
        self._cids = itertools.count(1)
        # Keyed by the gateway's own ids only. A client's `request_id` is a label: two callers (or
        # two loadgen processes) may send the same one at once, and none can reach or cancel another's
        # request by naming its id (cancel is the caller's own stream ending).
        self._streams: dict[int, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())
        self._silence_watch = asyncio.create_task(self._watch_silence())

    @property
    def admitting(self) -> bool:
        """The core takes requests now: alive, heard from lately, no step stuck past its limit."""
        return self.failed is None and self.stalled is None and not self._silent

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            silent = time.monotonic() - self.last_heard > CORE_SILENCE_S
            if silent != self._silent:
                self._silent = silent
                if silent:
                    log.warning("the engine core has sent nothing for %.0f s (stopped?): not serving", CORE_SILENCE_S)
                else:
                    log.info("the engine core answers again")
                self._state_changed()

    def _state_changed(self) -> None:
        if self.on_state is not None:
            self.on_state()

    async def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)

    def in_flight(self) -> int:
        return len(self._streams)

    # -- requests ------------------------------------------------------------------------------
    async def submit(self, spec: RequestSpec, trace_carrier=None, api: str = "grpc") -> RequestStream:
        """Raises InvalidRequest, Overloaded, Draining or Unavailable (as the in-process loop did).
        `trace_carrier`: the call's headers or gRPC metadata, read for a W3C `traceparent` when
        tracing is on; `api`: grpc | http, a span attribute."""
        if self.failed:
            raise Unavailable(self.failed)
        if self.draining:
            raise Draining("server is draining (shutting down); retry on another replica")
        client_id = spec.request_id or uuid.uuid4().hex
        rid = next(self._ids)
        stream = RequestStream(
            client_id,
            rid,
            IncrementalDetokenizer(self.codec.decode, spec.prompt_ids, spec.stop),
            frozenset(spec.sampling.stop_token_ids),
        )
        self._streams[rid] = stream
        msg = {"t": "add", "id": rid, "spec": spec_to_wire(spec)}
        if self.access_log:
            stream.api, stream.t0, stream.prompt_tokens = api, time.monotonic(), len(spec.prompt_ids)
        if self.spans is not None:
            stream.span = self.spans.start(trace_carrier, api, client_id, len(spec.prompt_ids))
            if stream.span is not None:
                msg["tp"] = stream.span.traceparent
        try:
            self.channel.send(msg)
            # The core's answer: added, refused, or the channel closed. A core whose step is stuck on a
            # lane (it is killed and restarted after --lane-timeout) takes it afterwards: wait while
            # its heartbeat goes on; a silent core (stopped) fails the request instead of hanging it.
            while not stream.added.done():
                try:
                    await asyncio.wait_for(asyncio.shield(stream.added), 1.0)
                except TimeoutError:
                    if time.monotonic() - self.last_heard > CORE_SILENCE_S:
                        raise Unavailable(
                            f"the engine core has not answered for {CORE_SILENCE_S:.0f} s; the request was not taken"
                        ) from None
            stream.added.result()
        except BaseException:
            # Refused or lost: already forgotten. Still known: the caller gave up while waiting, so
            # the core (which handles add before cancel) must drop it.
            if self._forget(rid) is not None:
                self._send_quietly({"t": "cancel", "id": rid})
            raise
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Client cancel / deadline / disconnect: the core frees its blocks before its next step."""
        if self._forget(stream.rid) is not None:
            self._send_quietly({"t": "cancel", "id": stream.rid})

    def _forget(self, rid: int, outcome: str = "abort", chunk: Chunk | None = None) -> RequestStream | None:
        """Drops a request; ends its trace span with `outcome` (a finish reason, abort or error)."""
        stream = self._streams.pop(rid, None)
        if stream is None:
            return None
        if self.access_log:
            self._log_access(stream, outcome, chunk)
        if stream.span is not None and self.spans is not None:
            self.spans.end(stream.span, outcome, chunk.usage_dict() if chunk is not None else None)
        return stream

    def _log_access(self, stream: RequestStream, outcome: str, chunk: Chunk | None) -> None:
        trace_id = None
        if stream.span is not None:
            trace_id = format(stream.span.trace_id, "032x")
        fields = {
            "api": stream.api,
            "request_id": stream.request_id,
            "trace_id": trace_id,
            "outcome": outcome,
            "prompt_tokens": stream.prompt_tokens,
            "output_tokens": chunk.usage[1] if chunk is not None else None,
            "duration_ms": round((time.monotonic() - stream.t0) * 1e3, 1),
        }
        access_log.info(
            "%s %s %s %s tokens %s ms", fields["api"], stream.request_id, outcome, fields["output_tokens"],
            fields["duration_ms"], extra=fields,
        )  # fmt: skip

    def _send_quietly(self, msg: dict) -> None:
        try:
            self.channel.send(msg)
        except (ChannelClosed, OSError):
            pass

    # -- control -------------------------------------------------------------------------------
    async def call(self, op: str, arg=None, timeout_s: float = 60.0):
        if self.failed and op != "metrics":
            raise Unavailable(self.failed)
        cid = next(self._cids)
        future = self._calls[cid] = asyncio.get_running_loop().create_future()
        try:
            self.channel.send({"t": "call", "cid": cid, "op": op, "arg": arg})
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(cid, None)

    async def get_config(self) -> control_pb2.RuntimeConfig:
        return control_pb2.RuntimeConfig.FromString(unb64(await self.call("get_config")))

    async def update_config(
        self, config: control_pb2.RuntimeConfig, requested_by: str = "", reason: str = ""
    ) -> control_pb2.RuntimeConfig:
        arg = {"config": b64(config.SerializeToString()), "requested_by": requested_by, "reason": reason}
        return control_pb2.RuntimeConfig.FromString(unb64(await self.call("update_config", arg)))

    def stop(self) -> None:
        self.stopping = True
        self._send_quietly({"t": "stop"})

    # -- the reader task -----------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            while True:
                msg = await self.channel.receive()
                self.last_heard = time.monotonic()
                kind = msg["t"]
                if kind == "beat":
                    was, self.stalled = self.stalled, msg["stalled"]  # the latest reason (its age grows)
                    if (was is None) != (self.stalled is None):
                        if self.stalled:
                            log.warning("not taking requests: %s", self.stalled)
                        else:
                            log.info("the engine core takes requests again")
                        self._state_changed()
                elif kind == "step":
                    self._on_step(msg["out"])
                elif kind == "added":
                    self._resolve_add(msg["id"], None)
                elif kind == "refused":
                    self._resolve_add(msg["id"], _REFUSALS.get(msg["code"], Unavailable)(msg["message"]))
                elif kind == "fail":
                    self._on_fail(msg)
                elif kind == "reply":
                    self._on_reply(msg)
                elif kind == "ready":
                    self._on_ready(msg)
        except ChannelClosed as exc:
            self._lost(f"the engine-core process exited ({exc})", quiet=self.stopping)
        except asyncio.CancelledError:
            self._lost("the gateway is stopping", quiet=True)
            raise
        except Exception as exc:  # a malformed message: the core cannot be trusted any more
            log.exception("engine-core channel failed")
            self._lost(f"engine-core channel error: {exc}")

    def _on_ready(self, msg: dict) -> None:
        i = msg["info"]
        self.info = generate_pb2.ServerInfo(
            target_model=i["target_model"],
            draft_model=i["draft_model"],
            topology=i["topology"],
            max_context=i["max_context"],
            version=i["version"],
            sliding_window=i["sliding_window"],
            sliding_window_kv=i["sliding_window_kv"],
        )
        self.eos = frozenset(msg["eos"])
        self.prefix_cache = bool(msg.get("prefix_cache", False))
        if not self._ready.done():
            self._ready.set_result(None)

    def _resolve_add(self, rid: int, exc: BaseException | None) -> None:
        stream = self._streams.get(rid)
        if stream is None or stream.added.done():
            return
        if exc is None:
            stream.added.set_result(None)
        else:
            self._forget(rid, "error")
            stream.added.set_exception(exc)

    def _on_step(self, rows: list) -> None:
        eos = self.eos
        for rid, ids, finish, usage, applied_k, ttft, logprobs in rows:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            reason = finish_from_wire(finish)
            hidden = stream.stop_ids  # stop_token_ids end the request and, as EOS, are not text
            text, stop_hit = stream.detok.add([t for t in ids if t not in eos and t not in hidden])
            if stop_hit:
                reason = FinishReason.STOP
            elif reason is not None:
                text += stream.detok.flush()
            chunk = Chunk(ids, text, reason is not None, reason, usage, applied_k, ttft, logprobs_from_wire(logprobs))
            if stream.span is not None and ttft is not None:
                stream.span.first_token_ns = time.time_ns()
            if stop_hit:
                if self._forget(rid, "stop", chunk) is not None:
                    self._send_quietly({"t": "cancel", "id": rid})
            elif reason is not None:
                self._forget(rid, "length" if reason is FinishReason.LENGTH else "stop", chunk)
            stream.box.put(chunk)

    def _on_fail(self, msg: dict) -> None:
        code = getattr(grpc.StatusCode, msg["code"], grpc.StatusCode.UNKNOWN)
        if msg.get("fatal") and self.failed is None:
            self.failed = msg["message"]
            if self.on_failure is not None:
                self.on_failure(self.failed, False)
        for rid in msg["ids"]:
            stream = self._forget(rid, "error")
            if stream is not None:
                stream.box.put(Failure(code, msg["message"]))

    def _on_reply(self, msg: dict) -> None:
        future = self._calls.get(msg["cid"])
        if future is None or future.done():
            return
        if "error" in msg:
            code, message = msg["error"]
            future.set_exception(InvalidRequest(message) if code == "INVALID_ARGUMENT" else Unavailable(message))
        else:
            future.set_result(msg["ok"])

    def end_all(self, message: str) -> None:
        """Ends every request in flight with UNAVAILABLE and cancels it in the core (drain timeout)."""
        for stream in list(self._streams.values()):
            self.cancel(stream)
            stream.box.put(Failure(grpc.StatusCode.UNAVAILABLE, message))

    def _lost(self, message: str, quiet: bool = False) -> None:
        """The core is gone: fail everything in flight (UNAVAILABLE), pending adds and calls too."""
        if self.failed is None:
            self.failed = message
            if quiet:  # a shutdown: the core exits because it was told to
                log.info("engine core stopped: %s", message)
            else:
                log.error("not serving any more: %s", message)
        for stream in list(self._streams.values()):
            self._forget(stream.rid, "error")
            if not stream.added.done():
                stream.added.set_exception(Unavailable(message))
            else:
                stream.box.put(Failure(grpc.StatusCode.UNAVAILABLE, message))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(Unavailable(message))
        if not self._ready.done():
            self._ready.set_exception(Unavailable(message))
        if self.on_failure is not None:
            self.on_failure(message, True)

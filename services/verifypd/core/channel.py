"""The engine-core channel: gateway process <-> engine-core process. Torch-free.

One local stream socket (a socketpair whose child end the engine-core process inherits, or two
threads of one process in tests) carrying length-prefixed JSON objects, each with a type `t`:

    gateway -> core
      add     {id, spec}            a request (spec: `spec_to_wire`); answered `added` or `refused`
      cancel  {id}                  abort before the next step (no answer; unknown ids are ignored)
      call    {cid, op, arg}        get_config | update_config (arg: base64 control_pb2.RuntimeConfig)
                                    | metrics | stats; answered `reply`
      stop    {}                    finish: the core stops its loop and exits
    core -> gateway
      ready   {info, eos}           once, when the router serves (server info, EOS token ids)
      added   {id} / refused {id, code, message}
      step    {out: [[id, token_ids, finish, usage, applied_k, ttft, logprobs], ...]}   ONE per engine step,
                                    every request that got tokens in it (finish: null or a FinishReason value;
                                    usage: the six `RequestStats.usage()` numbers in USAGE_KEYS order;
                                    logprobs: null, or `logprobs_to_wire`'s rows)
      fail    {ids, code, message, fatal}   these requests end with a gRPC status name; fatal: the engine is gone
      reply   {cid, ok} / {cid, error: [code, message]}
      beat    {stalled}             every second from a thread of its own: alive; stalled: null, or why no
                                    request is taken now (a step past --stall-timeout)

Why JSON over a socketpair (measured, bench/core_channel_codec.py on the dev CPU): a step message for
128 requests encodes in ~0.1 ms and decodes in ~0.1 ms with the C json module, against a ~15 ms
engine step at that batch; pickle is out (no pickle on any channel), and ZMQ/msgpack would add
dependencies for no measurable gain at one message per step. Internal request ids are integers the
gateway assigns, never the client's `request_id`, so a client id reused right after a cancel can
never receive the old request's last chunk.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct

from verifypd.domain.requests import Constraint, FinishReason, RequestSpec, SamplingParams, TokenLogprob

MAX_FRAME = 64 << 20
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens", "verify_steps", "cached_tokens")
_LEN = struct.Struct("<I")
_FINISH_BY_VALUE = {r.value: r for r in FinishReason}


class ChannelClosed(ConnectionError):
    """The other process closed the channel (exited or crashed), or sent something that is no frame."""


def encode(msg: dict) -> bytes:
    payload = json.dumps(msg, separators=(",", ":")).encode()
    return _LEN.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> dict:
    try:
        msg = json.loads(payload)
    except ValueError as exc:
        raise ChannelClosed(f"not a channel message: {exc}") from None
    if not isinstance(msg, dict) or "t" not in msg:
        raise ChannelClosed("not a channel message: no type")
    return msg


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


# -- request specs and outputs -----------------------------------------------------------------
def spec_to_wire(spec: RequestSpec) -> dict:
    s, c = spec.sampling, spec.constraint
    wire = {
        "prompt_ids": list(spec.prompt_ids),
        "max_tokens": spec.max_tokens,
        "sampling": [s.temperature, s.top_p, s.top_k, s.seed],
        "stop": list(spec.stop),
        "stop_at_eos": spec.stop_at_eos,
        "max_k": spec.max_k,
        "priority": spec.priority,
    }
    controls = {name: getattr(s, name) for name in CONTROL_FIELDS if getattr(s, name) != _PLAIN[name]}
    if controls:  # only where set: a plain request's message is as before
        wire["controls"] = controls
    if c is not None:  # structured output (domain.grammar): [kind, text, field]
        wire["constraint"] = [c.kind, c.text, c.field]
    return wire


# SamplingParams fields beyond the four above (domain.sampling_controls), sent by name where set.
CONTROL_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
)
_PLAIN = {name: getattr(SamplingParams(), name) for name in CONTROL_FIELDS}


def _controls_from_wire(d: dict) -> dict:
    out = {name: d[name] for name in CONTROL_FIELDS if name in d}
    for name in ("logit_bias", "stop_token_ids"):  # JSON lists -> the tuples SamplingParams holds
        if name in out:
            out[name] = tuple(tuple(v) if isinstance(v, list) else v for v in out[name])
    return out


def spec_from_wire(d: dict, request_id: str) -> RequestSpec:
    temperature, top_p, top_k, seed = d["sampling"]
    return RequestSpec(
        tuple(d["prompt_ids"]),
        max_tokens=d["max_tokens"],
        sampling=SamplingParams(temperature, top_p, top_k, seed, **_controls_from_wire(d.get("controls", {}))),
        stop=tuple(d["stop"]),
        stop_at_eos=d["stop_at_eos"],
        max_k=d["max_k"],
        priority=d["priority"],
        request_id=request_id,
        constraint=Constraint(*d["constraint"]) if d.get("constraint") else None,
    )


def output_to_wire(out) -> list:
    """A RequestOutput as one row of a `step` message."""
    stats = out.stats
    return [
        int(out.request_id),
        out.token_ids,
        out.finish_reason.value if out.finish_reason else None,
        [
            stats.prompt_tokens,
            stats.completion_tokens,
            stats.draft_tokens,
            stats.accepted_tokens,
            stats.verify_steps,
            stats.cached_tokens,
        ],
        out.applied_k,
        stats.ttft,
        logprobs_to_wire(out.logprobs),
    ]


def logprobs_to_wire(logprobs: list[TokenLogprob] | None) -> list | None:
    """[[token, logprob, [[token, logprob], ...]], ...] or None."""
    if logprobs is None:
        return None
    return [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in logprobs]


def logprobs_from_wire(rows: list | None) -> list[TokenLogprob] | None:
    if rows is None:
        return None
    return [TokenLogprob(token, value, tuple((t, v) for t, v in top)) for token, value, top in rows]


def finish_from_wire(value: str | None) -> FinishReason | None:
    return None if value is None else _FINISH_BY_VALUE[value]


# -- the core side: blocking socket ------------------------------------------------------------
class BlockingChannel:
    """The engine core's end. `send` may be called from any thread (one lock); `receive` from one."""

    def __init__(self, sock: socket.socket):
        import threading

        self.sock = sock
        self._file = sock.makefile("rb")
        self._lock = threading.Lock()

    def send(self, msg: dict) -> None:
        frame = encode(msg)
        with self._lock:
            self.sock.sendall(frame)

    def receive(self) -> dict:
        head = self._file.read(4)
        if len(head) != 4:
            raise ChannelClosed("the gateway closed the channel")
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise ChannelClosed(f"frame of {n} bytes exceeds {MAX_FRAME}")
        payload = self._file.read(n)
        if len(payload) != n:
            raise ChannelClosed("the gateway closed the channel mid-frame")
        return decode_payload(payload)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._file.close()  # the file holds a reference: the socket closes only with it
        self.sock.close()


# -- the gateway side: asyncio streams ---------------------------------------------------------
class AsyncChannel:
    """The gateway's end, on its event loop. Writes are buffered by asyncio (never block the loop)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, sock: socket.socket) -> AsyncChannel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_FRAME)
        return cls(reader, writer)

    def send(self, msg: dict) -> None:
        if self.writer.is_closing():
            raise ChannelClosed("the engine-core channel is closed")
        self.writer.write(encode(msg))

    async def receive(self) -> dict:
        try:
            head = await self.reader.readexactly(4)
            (n,) = _LEN.unpack(head)
            if n > MAX_FRAME:
                raise ChannelClosed(f"frame of {n} bytes exceeds {MAX_FRAME}")
            return decode_payload(await self.reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ChannelClosed(f"the engine-core process closed the channel ({exc.__class__.__name__})") from None

    def close(self) -> None:
        self.writer.close()

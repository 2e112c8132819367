"""GenerateResponse bytes for the streamed Generate RPC, without building a protobuf message per
chunk. Torch-free.

At k = 0 every engine step sends one message per stream, so at c = 128 the gateway's one event
loop builds ~10k GenerateResponses a second. The fields that never change within a request (the
request id) are encoded once; per chunk only the token ids (packed varints), the text, the finish
reason, the usage sub-message, k and the elapsed time are, straight into the wire format of
proto/verifypd/v1/generate.proto (proto3: a field equal to its default is left out, as the
protobuf runtime does). The Generate handler is registered with no response serializer, so these
bytes go out as they are (`add_generation_service`). Tests compare against the protobuf runtime's
parse of every field (tests/gateway/test_gateway_response_wire.py).
"""

from __future__ import annotations

import struct

import grpc

from verifypd.domain.convert import FINISH_CODES, logprobs_to_pb
from verifypd.domain.requests import TokenLogprob
from verifypd.v1 import generate_pb2

_DOUBLE = struct.Struct("<d")
_SMALL = [bytes([n]) for n in range(0x80)]  # one-byte varints
_MASK64 = (1 << 64) - 1


def varint(n: int) -> bytes:
    """Base-128 varint of a non-negative int (a negative int32 enum: its 64-bit two's complement)."""
    if 0 <= n < 0x80:
        return _SMALL[n]
    n &= _MASK64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _length_delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + varint(len(payload)) + payload


# Field keys: (field number << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited).
_REQUEST_ID, _TOKEN_IDS, _TEXT, _FINISH_REASON, _USAGE, _APPLIED_K, _ELAPSED = (
    b"\x0a",
    b"\x12",
    b"\x1a",
    b"\x20",
    b"\x2a",
    b"\x30",
    b"\x39",
)
_LOGPROBS = b"\x42"  # field 8, length-delimited (repeated TokenLogprob)
_CHOICE_INDEX = b"\x48"  # field 9, varint
_USAGE_KEYS = (b"\x08", b"\x10", b"\x18", b"\x20", b"\x28", b"\x30")  # Usage fields 1..6, varint
_FINISH_WIRE = {reason: varint(value) for reason, value in FINISH_CODES.items()}


class ResponseEncoder:
    """One request's GenerateResponse messages as wire bytes."""

    __slots__ = ("_head",)

    def __init__(self, request_id: str, choice_index: int = 0):
        """`choice_index`: the sample of GenerateRequest.n (fields may come in any order on the wire:
        it travels with the request id, in every message)."""
        self._head = _length_delimited(_REQUEST_ID, request_id.encode()) if request_id else b""
        if choice_index:
            self._head += _CHOICE_INDEX + varint(choice_index)

    def encode(
        self,
        token_ids: list[int],
        text: str,
        finish,
        usage: list[int],
        applied_k: int,
        elapsed_s: float,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bytes:
        """`finish`: a FinishReason or None; `usage`: the counts in USAGE_KEYS order;
        `logprobs` (requests that ask): encoded by the protobuf runtime, one message per token."""
        parts = [self._head]
        if token_ids:
            parts.append(_length_delimited(_TOKEN_IDS, b"".join([varint(t) for t in token_ids])))
        if text:
            parts.append(_length_delimited(_TEXT, text.encode()))
        if finish is not None:
            parts += (_FINISH_REASON, _FINISH_WIRE[finish])
        # Usage is always present (an empty sub-message when every count is 0).
        parts.append(_length_delimited(_USAGE, b"".join([key + varint(n) for key, n in zip(_USAGE_KEYS, usage) if n])))
        if applied_k:
            parts += (_APPLIED_K, varint(applied_k))
        if elapsed_s != 0.0:
            parts += (_ELAPSED, _DOUBLE.pack(elapsed_s))
        if logprobs:
            parts += [_length_delimited(_LOGPROBS, m.SerializeToString()) for m in logprobs_to_pb(logprobs)]
        return b"".join(parts)


def add_generation_service(servicer, server) -> None:
    """The Generation service on `server`, as generate_pb2_grpc registers it except that Generate
    yields wire bytes (ResponseEncoder) and so has no response serializer."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=generate_pb2.GenerateRequest.FromString, response_serializer=None
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo,
            request_deserializer=generate_pb2.ServerInfoRequest.FromString,
            response_serializer=generate_pb2.ServerInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("verifypd.v1.Generation", handlers),))
    server.add_registered_method_handlers("verifypd.v1.Generation", handlers)

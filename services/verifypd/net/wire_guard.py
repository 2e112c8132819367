"""Undecodable messages are the caller's error: INVALID_ARGUMENT and one short log line.

Left to itself, gRPC Python answers a request message its deserializer cannot parse with UNKNOWN
("Unexpected DecodeError", grpc.aio) or INTERNAL (the sync server) and logs a full traceback per
message: four random bytes cost ~700 bytes of ERROR log, and a flood of them fills the disk. The
interceptors here swap each method's request deserializer for one that turns a parse failure into an
`Undecodable` marker, and wrap the method so that the marker aborts the call with INVALID_ARGUMENT
before any servicer code runs, logging one line through a rate-limited logger (domain/logs.py).
"""

from __future__ import annotations

import logging

import grpc

from verifypd.domain.logs import rate_limited

log = rate_limited(logging.getLogger("verifypd.wire"))


class Undecodable:
    """What a guarded deserializer returns for bytes its message type cannot parse."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def _tolerant(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or any parse failure of the protobuf runtime
            return Undecodable(f"{type(exc).__name__}: {str(exc)[:120]}")

    return parse


def _message(method: str, bad: Undecodable) -> str:
    return f"{method}: the request message cannot be decoded ({bad.error})"


def _note(method: str, bad: Undecodable) -> None:
    log.warning("refused an undecodable %s message (INVALID_ARGUMENT): %s", method, bad.error)


def _guard_sync(handler, method: str):
    if handler is None or handler.request_deserializer is None:
        return handler

    def check(request, context) -> None:
        if isinstance(request, Undecodable):
            _note(method, request)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request))

    def checked_iter(requests, context):
        for request in requests:
            check(request, context)
            yield request

    deserializer = _tolerant(handler.request_deserializer)
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        def unary_unary(request, context):
            check(request, context)
            return inner_uu(request, context)

        return handler._replace(request_deserializer=deserializer, unary_unary=unary_unary)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        def unary_stream(request, context):
            check(request, context)
            yield from inner_us(request, context)

        return handler._replace(request_deserializer=deserializer, unary_stream=unary_stream)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary
        return handler._replace(
            request_deserializer=deserializer,
            stream_unary=lambda requests, context: inner_su(checked_iter(requests, context), context),
        )
    inner_ss = handler.stream_stream
    return handler._replace(
        request_deserializer=deserializer,
        stream_stream=lambda requests, context: inner_ss(checked_iter(requests, context), context),
    )


class WireGuard(grpc.ServerInterceptor):
    """For a sync `grpc.server` (the lanes)."""

    def intercept_service(self, continuation, handler_call_details):
        return _guard_sync(continuation(handler_call_details), handler_call_details.method)


def _guard_async(handler, method: str):
    """The grpc.aio version: behaviours are coroutines or async generators (unary requests only are
    guarded; the gateway has no client-streaming method of ours, and reflection's stream is left
    to gRPC)."""
    if handler is None or handler.request_deserializer is None or handler.request_streaming:
        return handler
    deserializer = _tolerant(handler.request_deserializer)

    async def refuse(request, context) -> None:
        _note(method, request)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request))

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, Undecodable):
                await refuse(request, context)
            return await inner_uu(request, context)

        return handler._replace(request_deserializer=deserializer, unary_unary=unary_unary)
    inner_us = handler.unary_stream

    async def unary_stream(request, context):
        if isinstance(request, Undecodable):
            await refuse(request, context)
        result = inner_us(request, context)
        if hasattr(result, "__aiter__"):  # an async generator servicer (Generate)
            async for item in result:
                yield item
        else:  # a coroutine that writes with context.write
            await result

    return handler._replace(request_deserializer=deserializer, unary_stream=unary_stream)


class AsyncWireGuard(grpc.aio.ServerInterceptor):
    """For the grpc.aio gateway."""

    async def intercept_service(self, continuation, handler_call_details):
        return _guard_async(await continuation(handler_call_details), handler_call_details.method)

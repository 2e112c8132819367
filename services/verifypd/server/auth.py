"""Who may call what: the lane secret and the gateway's optional API key.

* Lanes are internal: only the gateway (and the prefill lane pushing KV to an owner) may call
  them. Every lane RPC must carry the shared secret in metadata `x-verifypd-lane-secret`; a server
  interceptor answers UNAUTHENTICATED otherwise, before any handler runs. `verifypd serve`
  generates one secret per run and hands it to the lanes it starts through the environment
  (never argv: /proc/PID/cmdline is world-readable). Lanes started by hand read it from
  `--secret-file` or `VERIFYPD_LANE_SECRET` (in Kubernetes: a Secret mounted as a file or env).
* The gateway optionally requires `authorization: Bearer <key>` on Generation and Control
  (`--api-key` / `VERIFYPD_API_KEY`).

Health checking stays open on both: probes (kubelet, load balancers) carry no credentials, and
health reveals nothing but SERVING / NOT_SERVING. Secrets are compared in constant time.
"""
from __future__ import annotations

import collections
import hmac
import os
import secrets

import grpc

LANE_SECRET_ENV = "VERIFYPD_LANE_SECRET"
LANE_SECRET_HEADER = "x-verifypd-lane-secret"
API_KEY_ENV = "VERIFYPD_API_KEY"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
MIN_SECRET_LEN = 16


def new_secret() -> str:
    return secrets.token_hex(32)


def load_secret(path: str | None, env: str = LANE_SECRET_ENV, what: str = "lane secret") -> str | None:
    """The secret from a file (first line, stripped) or the environment; None when neither is set."""
    if path:
        with open(path, encoding="utf-8") as f:
            value = f.readline().strip()
        if not value:
            raise ValueError(f"{what} file {path} is empty")
    else:
        value = os.environ.get(env, "").strip()
        if not value:
            return None
    if len(value) < MIN_SECRET_LEN:
        raise ValueError(f"{what} is too short: use at least {MIN_SECRET_LEN} characters")
    return value


def lane_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    return ((LANE_SECRET_HEADER, secret),) if secret else ()


def _deny(message: str):
    def abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return abort


class _Check(grpc.ServerInterceptor):
    """Rejects calls whose metadata `header` does not hold `expected` (after `prefix`)."""

    def __init__(self, header: str, expected: str, prefix: str, message: str, methods_prefixes=None):
        self._header, self._prefix, self._message = header, prefix, message
        self._expected = (prefix + expected).encode()
        self._only = methods_prefixes  # None: every method except health

    def intercept_service(self, continuation, details):
        method = details.method or ""
        if method.startswith(OPEN_PREFIXES) or (self._only is not None and not method.startswith(self._only)):
            return continuation(details)
        got = dict(details.invocation_metadata or ()).get(self._header, "")
        got = got.encode() if isinstance(got, str) else got
        if hmac.compare_digest(got, self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        # Same handler kind as the real one, so streaming methods fail cleanly too.
        deny = _deny(self._message)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def lane_interceptor(secret: str) -> grpc.ServerInterceptor:
    return _Check(LANE_SECRET_HEADER, secret, "",
                  "lane RPCs are internal: missing or wrong lane secret (only the gateway may call lanes)")


def api_key_interceptor(api_key: str) -> grpc.ServerInterceptor:
    return _Check("authorization", api_key, "Bearer ",
                  "missing or wrong API key: send metadata `authorization: Bearer <key>`",
                  methods_prefixes=("/verifypd.v1.Generation/", "/verifypd.v1.Control/"))


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                    "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client side: adds `authorization: Bearer <key>` to every call."""

    def __init__(self, key: str):
        self._pair = ("authorization", f"Bearer {key}")

    def _details(self, d):
        return _Details(d.method, d.timeout, (*(d.metadata or ()), self._pair), d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def bearer_interceptor(key: str) -> _Bearer:
    return _Bearer(key)


class _AsyncCheck(grpc.aio.ServerInterceptor):
    """`_Check` for the grpc.aio gateway: same rule, handlers that abort from the event loop."""

    def __init__(self, check: _Check):
        self._check = check

    async def intercept_service(self, continuation, details):
        c, method = self._check, details.method or ""
        if method.startswith(OPEN_PREFIXES) or (c._only is not None and not method.startswith(c._only)):
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get(c._header, "")
        got = got.encode() if isinstance(got, str) else got
        if hmac.compare_digest(got, c._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, c._message)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def async_api_key_interceptor(api_key: str) -> grpc.aio.ServerInterceptor:
    return _AsyncCheck(api_key_interceptor(api_key))

"""Who may call what: the lane secret and the gateway's optional API key.

* Lanes are internal: only the gateway (and the prefill lane pushing KV to an owner) may call
  them. Every lane RPC must carry the shared secret in metadata `x-verifypd-lane-secret`; a server
  interceptor answers UNAUTHENTICATED otherwise, before any handler runs. `verifypd serve`
  generates one secret per run and hands it to the lanes it starts through the environment
  (never argv: /proc/PID/cmdline is world-readable). Lanes started by hand read it from
  `--secret-file` or `VERIFYPD_LANE_SECRET` (in Kubernetes: a Secret mounted as a file or env).
* The gateway optionally requires `authorization: Bearer <key>` on Generation and GetConfig
  (`--api-key` / `VERIFYPD_API_KEY`).
* Control is an admin API: changing the runtime config needs the admin key
  (`--admin-key-file` / `VERIFYPD_ADMIN_KEY`), whether or not Generate has an API key; without one
  configured, nobody may change it. `gateway_access` is the rule, transport-agnostic.

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
ADMIN_KEY_ENV = "VERIFYPD_ADMIN_KEY"
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

    def __init__(self, header: str, expected: str, prefix: str, message: str):
        self._header, self._prefix, self._message = header, prefix, message
        self._expected = (prefix + expected).encode()

    def intercept_service(self, continuation, details):
        method = details.method or ""
        if method.startswith(OPEN_PREFIXES):
            return continuation(details)
        got = dict(details.invocation_metadata or ()).get(self._header, "")
        got = got.encode() if isinstance(got, str) else got
        if hmac.compare_digest(got, self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        return handler_like(handler, _deny(self._message))


def handler_like(handler, behavior):
    """A refusing method handler with `handler`'s response kind (so streaming methods fail cleanly
    too) whose request side is always a stream that `behavior` never reads: gRPC then aborts the
    call without receiving the request message. A unary handler would have the whole message
    buffered (up to the port's receive limit) before the refusal: twelve 400 MB messages without
    the lane secret took a lane from 0.5 to 3 GB."""
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior)
    return grpc.stream_unary_rpc_method_handler(behavior)


def lane_interceptor(secret: str) -> grpc.ServerInterceptor:
    return _Check(
        LANE_SECRET_HEADER,
        secret,
        "",
        "lane RPCs are internal: missing or wrong lane secret (only the gateway may call lanes)",
    )


class _Details(
    collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client side: adds `authorization: Bearer <key>` to every call."""

    def __init__(self, key: str):
        self._pair = ("authorization", f"Bearer {key}")

    def _details(self, d):
        return _Details(
            d.method,
            d.timeout,
            (*(d.metadata or ()), self._pair),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def bearer_interceptor(key: str) -> _Bearer:
    return _Bearer(key)


# --- the gateway: Generate callers and the admin (Control) --------------------------------------
GENERATION_PREFIX = "/verifypd.v1.Generation/"
CONTROL_PREFIX = "/verifypd.v1.Control/"
READ_CONFIG = "/verifypd.v1.Control/GetConfig"
NO_ADMIN_KEY = (
    f"runtime config changes are disabled: this server was started without an admin key "
    f"(verifypd serve --admin-key-file PATH, or env {ADMIN_KEY_ENV})"
)
Denial = tuple[grpc.StatusCode, str]


def _bearer(metadata) -> bytes | None:
    """The token of `authorization: Bearer <token>` (None when missing or of another scheme)."""
    value = dict(metadata or ()).get("authorization", "")
    value = value.encode() if isinstance(value, str) else bytes(value)
    return value[len(b"Bearer ") :] if value.startswith(b"Bearer ") else None


def _same(token: bytes | None, key: str | None) -> bool:
    # Constant time; evaluated for both keys on every call, so timing does not tell which matched.
    if not key:
        return False
    return hmac.compare_digest(token or b"", key.encode())


def gateway_access(method: str, metadata, *, api_key: str | None, admin_key: str | None) -> Denial | None:
    """Who may call `method` on the gateway; None = allowed, else (status code, message). Pure:
    the transport's interceptor (sync or grpc.aio) only turns a denial into an abort.

    * Control, except GetConfig (today: UpdateConfig): the admin key only (`authorization: Bearer
      <admin key>`, the operator's client sends it). Without an admin key configured nobody may
      change the runtime config (PERMISSION_DENIED); a caller with the API key is authenticated but
      not allowed (PERMISSION_DENIED); any other caller UNAUTHENTICATED.
    * Generation and Control/GetConfig: open when no API key is set, else the API key or the admin key.
    * Everything else (health, reflection): open.
    """
    if not method.startswith((GENERATION_PREFIX, CONTROL_PREFIX)):
        return None
    token = _bearer(metadata)
    is_admin, is_user = _same(token, admin_key), _same(token, api_key)
    if method.startswith(CONTROL_PREFIX) and method != READ_CONFIG:
        if not admin_key:
            return grpc.StatusCode.PERMISSION_DENIED, NO_ADMIN_KEY
        if is_admin:
            return None
        if is_user:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                "the API key may call Generate, not Control: changing the runtime config needs the admin key",
            )
        return (
            grpc.StatusCode.UNAUTHENTICATED,
            "Control is an admin API: missing or wrong admin key (send metadata `authorization: Bearer <admin key>`)",
        )
    if not api_key or is_user or is_admin:
        return None
    return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send metadata `authorization: Bearer <key>`"


def check_gateway_keys(api_key: str | None, admin_key: str | None) -> None:
    """One key for both would make every Generate caller an admin."""
    if api_key and admin_key and hmac.compare_digest(api_key.encode(), admin_key.encode()):
        raise ValueError("the admin key must differ from the API key (else every Generate caller is an admin)")


class _AsyncGatewayAccess(grpc.aio.ServerInterceptor):
    """`gateway_access` on the grpc.aio gateway: a denied call gets a handler of the same kind that
    aborts with the denial (so streaming methods fail cleanly too), before any servicer code runs."""

    def __init__(self, api_key: str | None, admin_key: str | None):
        check_gateway_keys(api_key, admin_key)
        self._keys = dict(api_key=api_key, admin_key=admin_key)

    async def intercept_service(self, continuation, details):
        denial = gateway_access(details.method or "", details.invocation_metadata, **self._keys)
        if denial is None:
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        code, message = denial

        async def deny(request, context):
            await context.abort(code, message)

        return handler_like(handler, deny)


def gateway_interceptor(api_key: str | None = None, admin_key: str | None = None) -> grpc.aio.ServerInterceptor:
    return _AsyncGatewayAccess(api_key, admin_key)

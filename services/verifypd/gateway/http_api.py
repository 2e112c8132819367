"""The OpenAI-compatible HTTP API of the gateway (Starlette, served by uvicorn: http_server.py).

    POST /v1/chat/completions, POST /v1/completions   (JSON or server-sent events)
    GET  /v1/models, GET /health, GET /metrics          (Prometheus text)

Same request path as gRPC `Generate`, on the same event loop as the grpc.aio server: body ->
`GenerateRequest` (openai_convert) -> `convert.request_spec_from_pb` -> `CoreClient.submit`; the
client's reader task puts each request's chunks into its stream's queue (no thread per request).
A client that disconnects is noticed by a task waiting on ASGI `receive()`; the request is then
aborted in the engine core before its next step (its KV blocks are free), as for a gRPC cancel.
"""

from __future__ import annotations

import json
import logging
import uuid

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from verifypd.core.loop import Overloaded, Unavailable
from verifypd.domain import convert
from verifypd.domain.requests import InvalidRequest, RequestSpec
from verifypd.gateway import openai_convert as oc
from verifypd.gateway import samples, tool_render
from verifypd.gateway.errors import ApiError, bad
from verifypd.gateway.http_completion import Completion, error_response

log = logging.getLogger("verifypd.http")
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class HttpApi:
    """Routes over a started `Gateway` (its engine loop, codec, info and health)."""

    def __init__(
        self,
        gateway,
        *,
        model_name: str | None = None,
        metrics_registry=None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        api_key: str | None = None,
        tool_parser: str = "auto",
    ):
        self.gateway, self.client, self.info = gateway, gateway.client, gateway.info
        # With --api-key the /v1 routes need `Authorization: Bearer KEY` (what OpenAI clients send),
        # as gRPC Generate does; /health and /metrics stay open (probes and scrapers).
        self._bearer = f"Bearer {api_key}".encode() if api_key else None
        self.model_name = model_name or gateway.info.target_model
        self.registry, self.max_body_bytes = metrics_registry, max_body_bytes
        self.fingerprint = f"verifypd-{gateway.info.version}"
        self.tool_parser = tool_parser  # tools.PARSERS: the tool-call format (docs/structured_output.md)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed, 500: self._internal},
        )
        if self._bearer is not None:
            self.app = self._require_key(self.app)

    def _require_key(self, app):
        import hmac

        denied = ApiError(
            401,
            "missing or wrong API key: send `Authorization: Bearer <key>`",
            None,
            "invalid_api_key",
            "invalid_request_error",
        )

        async def guarded(scope, receive, send):
            if scope["type"] == "http" and scope["path"].startswith("/v1/"):
                got = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(got, self._bearer):
                    await error_response(denied)(scope, receive, send)
                    return
            await app(scope, receive, send)

        return guarded

    # -- errors --------------------------------------------------------------------------------
    async def _not_found(self, request, exc):
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", None, "not_found"))

    async def _not_allowed(self, request, exc):
        return error_response(
            ApiError(405, f"method {request.method} not allowed on {request.url.path}", None, "method_not_allowed")
        )

    async def _internal(self, request, exc):
        log.exception("HTTP handler failed", exc_info=exc)
        return error_response(ApiError(500, f"internal error: {exc}", None, "internal", "server_error"))

    # -- generation ----------------------------------------------------------------------------
    async def chat(self, request: Request):
        return self._counted(await self._generate(request, oc.CHAT, "chatcmpl-"))

    async def completions(self, request: Request):
        return self._counted(await self._generate(request, oc.COMPLETION, "cmpl-"))

    def _counted(self, response):
        """A refusal before the stream began: counted in verifypd_request_errors_total."""
        if isinstance(response, JSONResponse) and response.status_code >= 400:
            reason = json.loads(response.body).get("error", {}).get("code") or "error"
            self.gateway.errors.add("http", str(response.status_code), reason)
        return response

    async def _read_json(self, request: Request):
        too_big = ApiError(413, f"request body is larger than {self.max_body_bytes} bytes", None, "request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise too_big
        body = bytearray()
        try:
            async for piece in request.stream():
                body += piece
                if len(body) > self.max_body_bytes:  # chunked bodies have no content-length
                    raise too_big
        except ClientDisconnect:  # gone before its body arrived: nobody to answer
            raise ApiError(400, "client disconnected while sending the body") from None
        return oc.decode_body(body)

    async def _generate(self, request: Request, kind: str, id_prefix: str):
        try:  # reading and parsing the body raise ApiError only
            parsed = oc.parse_request(await self._read_json(request), kind, request_id=id_prefix + uuid.uuid4().hex)
        except ApiError as err:
            return error_response(err)
        try:
            if parsed.model != self.model_name:
                raise ApiError(
                    404,
                    f"the model {parsed.model!r} does not exist; this server serves {self.model_name!r}",
                    "model",
                    "model_not_found",
                )
            if parsed.tools is not None:  # the prompt with its tools, rendered here (tool_render.render)
                tool_render.render(parsed.tools, self.gateway.codec, parsed.pb, self.tool_parser)
            spec = convert.request_spec_from_pb(
                parsed.pb,
                self.gateway.codec,
                max_context=self.info.max_context,
                default_max_tokens=self.gateway.default_max_tokens,
            )
            streams = await self._submit(spec, parsed.samples.best_of, request.headers)
        except ApiError as err:
            return error_response(err)
        except InvalidRequest as exc:
            param, message = oc.openai_param(str(exc), parsed)
            return error_response(bad(param, message))
        except Overloaded as exc:
            return error_response(ApiError(429, str(exc), None, "queue_full", "rate_limit_error"))
        except (Unavailable, TimeoutError) as exc:
            return error_response(ApiError(503, f"server is not serving: {exc}", None, "not_serving", "server_error"))
        return Completion(self, parsed, streams)

    async def _submit(self, spec: RequestSpec, count: int, headers=None) -> list:
        """`count` samples of `spec` (n / best_of): gateway.samples."""
        return await samples.submit_samples(self.client, spec, count, headers, "http", self.gateway.share_prefix)

    # -- info ----------------------------------------------------------------------------------
    async def models(self, request: Request):
        info = self.info
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "verifypd",
                        "root": info.target_model,
                        "max_model_len": info.max_context,
                        "verifypd": {
                            "target_model": info.target_model,
                            "draft_model": info.draft_model,
                            "topology": info.topology,
                            "max_context": info.max_context,
                            "version": info.version,
                            # ServerInfo's doc: the window (0: none) and whether KV behind it is freed or kept
                            "sliding_window": info.sliding_window,
                            "sliding_window_kv": info.sliding_window_kv,
                        },
                    }
                ],
            }
        )

    def serving(self) -> tuple[bool, str]:
        if self.client.failed:
            return False, self.client.failed
        if not self.gateway.health.serving:
            return False, self.client.stalled or "not serving (starting, draining or stopped)"
        return True, "serving"

    async def health(self, request: Request):
        ok, reason = self.serving()
        return JSONResponse(
            {"status": "serving" if ok else "not_serving", "reason": reason}, status_code=200 if ok else 503
        )

    async def metrics(self, request: Request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.registry is not None:  # the instruments live in this process
            text = generate_latest(self.registry).decode()
        else:  # they live in the engine-core process (verifypd serve)
            try:
                text = await self.client.call("metrics", timeout_s=10)
            except (TimeoutError, Unavailable) as exc:
                return error_response(ApiError(503, f"metrics unavailable: {exc}", None, "not_serving", "server_error"))
        text += generate_latest(self.gateway.errors.registry).decode()  # the gateway's own series
        return Response(text, media_type=CONTENT_TYPE_LATEST)

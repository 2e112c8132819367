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

import asyncio
import json
import logging
import uuid

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from verifypd.core.client import Chunk, Failure
from verifypd.core.loop import Overloaded, Unavailable
from verifypd.domain import convert
from verifypd.domain.requests import InvalidRequest
from verifypd.gateway import openai_convert as oc

log = logging.getLogger("verifypd.http")
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_DISCONNECTED = object()  # put into a stream's queue when the client went away


async def _receive_elsewhere() -> Message:
    """The `receive` given to a response sent while the disconnect watcher reads the request's
    messages (Completion.__call__): starlette's Response sends only, it never calls this."""
    raise RuntimeError("this request's ASGI messages are read by its disconnect watcher")


def error_response(err: oc.ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _failure_error(item: Failure) -> oc.ApiError:
    import grpc

    status = 503 if item.code == grpc.StatusCode.UNAVAILABLE else 500
    return oc.ApiError(status, item.message, None, item.code.name.lower(), "server_error")


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class ChunkEvents:
    """The SSE event of each streamed chunk, byte for byte what `_sse(Completion._envelope(...))`
    gives, without building and encoding the envelope's dicts per chunk: the fields that never
    change within a request are encoded once; per chunk only the text (json's C string encoder),
    the finish reason, the token ids and k are. At 128 streams this is one event per stream per
    engine step on the gateway's one event loop (the gateway's CPU per token)."""

    def __init__(self, envelope: dict, chat: bool, include_usage: bool):
        head = json.dumps(envelope, separators=(",", ":"))
        assert head.endswith("}") and "choices" not in envelope
        self._head = (
            "data: "
            + head[:-1]
            + (',"choices":[{"index":0,"delta":{"content":' if chat else ',"choices":[{"index":0,"text":')
        )
        self._middle = '},"logprobs":null,"finish_reason":' if chat else ',"logprobs":null,"finish_reason":'
        self._tail = "}]" + (',"usage":null' if include_usage else "") + ',"verifypd":{"token_ids":['

    def event(self, text: str, reason: str | None, token_ids: list[int], applied_k: int) -> bytes:
        return (
            f"{self._head}{json.dumps(text)}{self._middle}{'null' if reason is None else json.dumps(reason)}"
            f'{self._tail}{",".join(map(str, token_ids))}],"applied_k":{applied_k}}}}}\n\n'
        ).encode()


class Completion:
    """The ASGI response of one submitted request: streams SSE events or answers one JSON body."""

    def __init__(self, api: HttpApi, parsed: oc.ParsedRequest, stream):
        self.api, self.parsed, self.stream = api, parsed, stream
        self.id = parsed.pb.request_id
        self.created = oc.now()
        chat = parsed.kind == oc.CHAT
        self.object = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and parsed.stream else "")

    def _choice(self, text: str, reason, delta: bool) -> dict:
        if self.parsed.kind == oc.COMPLETION:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        key = "delta" if delta else "message"
        body = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, key: body, "logprobs": None, "finish_reason": reason}

    def _envelope_head(self) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.parsed.model,
            "system_fingerprint": self.api.fingerprint,
        }

    def _envelope(self, choices: list, **extra) -> dict:
        return {**self._envelope_head(), "choices": choices, **extra}

    async def __call__(self, scope, receive, send) -> None:
        async def watch_disconnect():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.stream.box.put(_DISCONNECTED)

        watcher = asyncio.create_task(watch_disconnect())
        finished = False
        try:
            if self.parsed.stream:
                finished = await self._stream(send)
            else:
                finished = await self._collect(scope, send)
        except OSError:  # the connection broke while sending
            pass
        finally:
            watcher.cancel()
            if not finished:  # disconnect, server shutdown (task cancelled) or a send error: free the KV
                self.api.client.cancel(self.stream)

    async def _collect(self, scope, send) -> bool:
        texts, ids, last = [], [], None
        while last is None or not last.finished:
            for item in await self.stream.box.take():
                if item is _DISCONNECTED:
                    return False
                if isinstance(item, Failure):
                    err = _failure_error(item)
                    self.api.gateway.errors.add("http", str(err.status), err.code)
                    await error_response(err)(scope, _receive_elsewhere, send)
                    return True
                texts.append(item.text)
                ids += item.token_ids
                last = item
        body = self._envelope(
            [self._choice("".join(texts), oc.finish_reason(last.finish_reason), False)],
            usage=oc.usage_json(last.usage_dict()),
            verifypd={"token_ids": ids},
        )
        await JSONResponse(body)(scope, _receive_elsewhere, send)
        return True

    async def _stream(self, send) -> bool:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-request-id", self.id.encode()),
                ],
            }
        )

        async def event(obj) -> None:
            await send({"type": "http.response.body", "body": _sse(obj), "more_body": True})

        usage_null = {"usage": None} if self.parsed.include_usage else {}
        if self.parsed.kind == oc.CHAT:  # OpenAI's first chunk: the role, no content yet
            await event(
                self._envelope(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **usage_null,
                )
            )
        chunks = ChunkEvents(self._envelope_head(), self.parsed.kind == oc.CHAT, self.parsed.include_usage)
        done = False
        while not done:
            # Everything since the last event: one event for several steps when behind.
            for item in await self.stream.box.take():
                if item is _DISCONNECTED:
                    return False
                if isinstance(item, Failure):  # headers are sent: the error travels as an event
                    err = _failure_error(item)
                    self.api.gateway.errors.add("http", "stream", err.code)
                    await event(err.body())
                    done = True
                    break
                assert isinstance(item, Chunk)
                reason = oc.finish_reason(item.finish_reason) if item.finished else None
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": chunks.event(item.text, reason, item.token_ids, item.applied_k),
                    }
                )
                if item.finished:
                    if self.parsed.include_usage:
                        await event(self._envelope([], usage=oc.usage_json(item.usage_dict())))
                    done = True
                    break
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return True


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
    ):
        self.gateway, self.client, self.info = gateway, gateway.client, gateway.info
        # With --api-key the /v1 routes need `Authorization: Bearer KEY` (what OpenAI clients send),
        # as gRPC Generate does; /health and /metrics stay open (probes and scrapers).
        self._bearer = f"Bearer {api_key}".encode() if api_key else None
        self.model_name = model_name or gateway.info.target_model
        self.registry, self.max_body_bytes = metrics_registry, max_body_bytes
        self.fingerprint = f"verifypd-{gateway.info.version}"
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

        denied = oc.ApiError(
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
        return error_response(oc.ApiError(404, f"no route {request.method} {request.url.path}", None, "not_found"))

    async def _not_allowed(self, request, exc):
        return error_response(
            oc.ApiError(405, f"method {request.method} not allowed on {request.url.path}", None, "method_not_allowed")
        )

    async def _internal(self, request, exc):
        log.exception("HTTP handler failed", exc_info=exc)
        return error_response(oc.ApiError(500, f"internal error: {exc}", None, "internal", "server_error"))

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
        too_big = oc.ApiError(
            413, f"request body is larger than {self.max_body_bytes} bytes", None, "request_too_large"
        )
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
            raise oc.ApiError(400, "client disconnected while sending the body") from None
        return oc.decode_body(body)

    async def _generate(self, request: Request, kind: str, id_prefix: str):
        try:  # reading and parsing the body raise ApiError only
            parsed = oc.parse_request(await self._read_json(request), kind, request_id=id_prefix + uuid.uuid4().hex)
        except oc.ApiError as err:
            return error_response(err)
        try:
            if parsed.model != self.model_name:
                raise oc.ApiError(
                    404,
                    f"the model {parsed.model!r} does not exist; this server serves {self.model_name!r}",
                    "model",
                    "model_not_found",
                )
            spec = convert.request_spec_from_pb(
                parsed.pb,
                self.gateway.codec,
                max_context=self.info.max_context,
                default_max_tokens=self.gateway.default_max_tokens,
            )
            stream = await self.client.submit(spec, request.headers, "http")
        except oc.ApiError as err:
            return error_response(err)
        except InvalidRequest as exc:
            param, message = oc.openai_param(str(exc), parsed)
            return error_response(oc.bad(param, message))
        except Overloaded as exc:
            return error_response(oc.ApiError(429, str(exc), None, "queue_full", "rate_limit_error"))
        except (Unavailable, TimeoutError) as exc:
            return error_response(
                oc.ApiError(503, f"server is not serving: {exc}", None, "not_serving", "server_error")
            )
        return Completion(self, parsed, stream)

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
                        },
                    }
                ],
            }
        )

    def serving(self) -> tuple[bool, str]:
        if self.client.failed:
            return False, self.client.failed
        if not self.gateway.health.serving:
            return False, "not serving (starting, draining or stopped)"
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
                return error_response(
                    oc.ApiError(503, f"metrics unavailable: {exc}", None, "not_serving", "server_error")
                )
        text += generate_latest(self.gateway.errors.registry).decode()  # the gateway's own series
        return Response(text, media_type=CONTENT_TYPE_LATEST)

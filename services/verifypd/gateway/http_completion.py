"""The response of one OpenAI request (http_api.py): one JSON body or server-sent events, over the
request's streams in the engine core (one per sample: n / best_of, openai_sampling). Torch-free.

A plain request (n = 1, no logprobs) streams through `ChunkEvents`, its bytes encoded without
building the envelope per chunk; `SampledResponse` builds the choices of several samples (index i:
sample i; streamed interleaved as their chunks arrive) and their logprobs objects.
"""

from __future__ import annotations

import asyncio
import json

from starlette.responses import JSONResponse
from starlette.types import Message

from verifypd.core.client import Chunk, Failure
from verifypd.gateway import openai_convert as oc
from verifypd.gateway import openai_sampling as osm
from verifypd.gateway import tool_stream
from verifypd.gateway.errors import ApiError

DISCONNECTED = object()  # put into a stream's queue when the client went away


async def receive_elsewhere() -> Message:
    """The `receive` given to a response sent while the disconnect watcher reads the request's
    messages (Completion.__call__): starlette's Response sends only, it never calls this."""
    raise RuntimeError("this request's ASGI messages are read by its disconnect watcher")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def counted_failure(api, item: Failure, where: str | None = None) -> ApiError:
    """failure_error, counted in the gateway's verifypd_request_errors_total (`where`: "stream" once
    the headers are sent, else the HTTP status)."""
    err = failure_error(item)
    api.gateway.errors.add("http", where or str(err.status), err.code)
    return err


def failure_error(item: Failure) -> ApiError:
    import grpc

    status = 503 if item.code == grpc.StatusCode.UNAVAILABLE else 500
    return ApiError(status, item.message, None, item.code.name.lower(), "server_error")


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def start_events(send, request_id: str):
    """Starts a server-sent-events response; returns the coroutine that sends one event (a dict)."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-request-id", request_id.encode()),
            ],
        }
    )

    async def event(obj) -> None:
        await send({"type": "http.response.body", "body": sse(obj), "more_body": True})

    return event


class ChunkEvents:
    """The SSE event of each streamed chunk, byte for byte what `sse(Completion._envelope(...))`
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

    def __init__(self, api, parsed: oc.ParsedRequest, streams: list):
        """`api`: the HttpApi; `streams`: the request's samples (best_of of them), sample i seeded
        `sample_seed(seed, i)` (openai_sampling)."""
        self.api, self.parsed, self.streams = api, parsed, streams
        self.stream = streams[0]
        samples = parsed.samples
        # n > 1, best_of or logprobs: the choices are built per sample (SampledResponse); else the
        # one stream's chunks go out through ChunkEvents, the fast path.
        self.sampled = len(streams) > 1 or samples.report_logprobs
        self.id = parsed.pb.request_id
        self.created = oc.now()
        chat = parsed.kind == oc.CHAT
        self.object = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and parsed.stream else "")

    def choice(self, text: str, reason, delta: bool, index: int = 0, logprobs: dict | None = None) -> dict:
        if self.parsed.kind == oc.COMPLETION:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        key = "delta" if delta else "message"
        body = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": index, key: body, "logprobs": logprobs, "finish_reason": reason}

    def envelope_head(self) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.parsed.model,
            "system_fingerprint": self.api.fingerprint,
        }

    def envelope(self, choices: list, **extra) -> dict:
        return {**self.envelope_head(), "choices": choices, **extra}

    async def __call__(self, scope, receive, send) -> None:
        async def watch_disconnect():
            while (await receive())["type"] != "http.disconnect":
                pass
            for stream in self.streams:
                stream.box.put(DISCONNECTED)

        watcher = asyncio.create_task(watch_disconnect())
        finished = False
        try:
            if self.sampled:
                sampled = SampledResponse(self)
                finished = await (sampled.stream(send) if self.parsed.stream else sampled.collect(scope, send))
            elif self.parsed.stream:
                finished = await self._stream(send)
            else:
                finished = await self._collect(scope, send)
        except OSError:  # the connection broke while sending
            pass
        finally:
            watcher.cancel()
            # disconnect, server shutdown (task cancelled) or a send error: free the KV (a
            # finished sample is forgotten already: cancelling it sends nothing)
            for stream in self.streams if not finished or self.sampled else ():
                self.api.client.cancel(stream)

    async def _collect(self, scope, send) -> bool:
        texts, ids, last = [], [], None
        while last is None or not last.finished:
            for item in await self.stream.box.take():
                if item is DISCONNECTED:
                    return False
                if isinstance(item, Failure):
                    await error_response(counted_failure(self.api, item))(scope, receive_elsewhere, send)
                    return True
                texts.append(item.text)
                ids += item.token_ids
                last = item
        text, reason = "".join(texts), oc.finish_reason(last.finish_reason)
        parsed_tools = self.parsed.tools
        if parsed_tools is not None and parsed_tools.parses:
            choice = tool_stream.chat_choice(parsed_tools, text, reason)
        else:
            choice = self.choice(text, reason, False)
        body = self.envelope(
            [choice],
            usage=oc.usage_json(last.usage_dict()),
            verifypd={"token_ids": ids},
        )
        await JSONResponse(body)(scope, receive_elsewhere, send)
        return True

    async def _stream(self, send) -> bool:
        event = await start_events(send, self.id)

        usage_null = {"usage": None} if self.parsed.include_usage else {}
        if self.parsed.kind == oc.CHAT:  # OpenAI's first chunk: the role, no content yet
            await event(
                self.envelope(
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
        chunks = ChunkEvents(self.envelope_head(), self.parsed.kind == oc.CHAT, self.parsed.include_usage)
        tool_deltas = None
        if self.parsed.tools is not None and self.parsed.tools.parses:
            tool_deltas = tool_stream.StreamDeltas(self.parsed.tools)
        done = False
        while not done:
            # Everything since the last event: one event for several steps when behind.
            for item in await self.stream.box.take():
                if item is DISCONNECTED:
                    return False
                if isinstance(item, Failure):  # headers are sent: the error travels as an event
                    await event(counted_failure(self.api, item, "stream").body())
                    done = True
                    break
                assert isinstance(item, Chunk)
                reason = oc.finish_reason(item.finish_reason) if item.finished else None
                if tool_deltas is not None:  # content and tool_calls deltas, held back where undecided
                    for choice in tool_deltas.choices(item.text, item.finished, reason):
                        await event(self.envelope([choice], **usage_null))
                else:
                    await send(
                        {
                            "type": "http.response.body",
                            "more_body": True,
                            "body": chunks.event(item.text, reason, item.token_ids, item.applied_k),
                        }
                    )
                if item.finished:
                    if self.parsed.include_usage:
                        await event(self.envelope([], usage=oc.usage_json(item.usage_dict())))
                    done = True
                    break
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return True


class Sample:
    """What one sample streamed so far."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list = []
        self.last: Chunk | None = None
        self.offset = 0  # characters of its logprobs' tokens so far (legacy text_offset)

    def add(self, item: Chunk) -> None:
        self.texts.append(item.text)
        self.ids += item.token_ids
        self.logprobs += item.logprobs or []
        self.last = item

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished


def summed_usage(samples: list[Sample]) -> dict:
    """One prompt, every sample's generated tokens (those best_of dropped included, as vLLM counts).
    The prompt's counts are sample 0's: its tokens, and of them those the prefix cache served."""
    usages = [s.last.usage_dict() for s in samples if s.last is not None]
    total = {key: sum(u[key] for u in usages) for key in usages[0]}
    for key in ("prompt_tokens", "cached_tokens"):
        if key in usages[0]:
            total[key] = usages[0][key]
    return total


class SampledResponse:
    """The choices of a request with n > 1, best_of or logprobs (Completion.sampled)."""

    def __init__(self, completion: Completion):
        self.c = completion
        self.samples = [Sample() for _ in completion.streams]
        self.text_of = completion.api.gateway.codec.token_text
        self.chat = completion.parsed.kind == oc.CHAT

    def logprobs_json(self, sample: Sample, logprobs: list) -> dict | None:
        wanted = self.c.parsed.samples
        if not wanted.report_logprobs:
            return None
        if self.chat:
            return osm.chat_logprobs(logprobs, self.text_of)
        out = osm.completion_logprobs(logprobs, self.text_of, sample.offset, wanted.top_logprobs)
        sample.offset += sum(len(t) for t in out["tokens"])
        return out

    async def collect(self, scope, send) -> bool:
        for stream, sample in zip(self.c.streams, self.samples, strict=True):
            while not sample.finished:
                for item in await stream.box.take():
                    if item is DISCONNECTED:
                        return False
                    if isinstance(item, Failure):
                        await error_response(counted_failure(self.c.api, item))(scope, receive_elsewhere, send)
                        return True
                    sample.add(item)
        wanted = self.c.parsed.samples
        order = osm.best([s.logprobs for s in self.samples], wanted.n) if wanted.best_of > wanted.n else range(wanted.n)
        choices, ids = [], []
        for index, j in enumerate(order):
            s = self.samples[j]
            assert s.last is not None
            reason = oc.finish_reason(s.last.finish_reason)
            choices.append(self.c.choice("".join(s.texts), reason, False, index, self.logprobs_json(s, s.logprobs)))
            ids.append(s.ids)
        body = self.c.envelope(
            choices,
            usage=oc.usage_json(summed_usage(self.samples)),
            verifypd={"token_ids": ids[0] if len(ids) == 1 else ids},
        )
        await JSONResponse(body)(scope, receive_elsewhere, send)
        return True

    async def stream(self, send) -> bool:
        """Events of every sample as their chunks arrive (best_of > n is refused for streams)."""
        c = self.c
        event = await start_events(send, c.id)

        usage_null = {"usage": None} if c.parsed.include_usage else {}
        if self.chat:  # OpenAI's first chunk of each choice: the role, no content yet
            for index in range(len(c.streams)):
                delta = {"role": "assistant", "content": ""}
                await event(
                    c.envelope(
                        [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}], **usage_null
                    )
                )
        inbox: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            while True:
                items = await stream.box.take()
                inbox.put_nowait((index, items))
                if any(i is DISCONNECTED or isinstance(i, Failure) or i.finished for i in items):
                    return

        pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(c.streams)]
        try:
            while not all(s.finished for s in self.samples):
                index, items = await inbox.get()
                sample = self.samples[index]
                for item in items:
                    if item is DISCONNECTED:
                        return False
                    if isinstance(item, Failure):  # headers are sent: the error travels as an event
                        await event(counted_failure(self.c.api, item, "stream").body())
                        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
                        return True
                    sample.add(item)
                    reason = oc.finish_reason(item.finish_reason) if item.finished else None
                    logprobs = self.logprobs_json(sample, item.logprobs or [])
                    choice = c.choice(item.text, reason, True, index, logprobs)
                    await event(
                        c.envelope(
                            [choice],
                            **usage_null,
                            verifypd={"token_ids": item.token_ids, "applied_k": item.applied_k},
                        )
                    )
        finally:
            for task in pumps:
                task.cancel()
        if c.parsed.include_usage:
            await event(c.envelope([], usage=oc.usage_json(summed_usage(self.samples))))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return True

"""`--backend openai`: the same load against any OpenAI-compatible server (streaming
`/v1/completions` or `/v1/chat/completions`, server-sent events over loadgen's own
asyncio-streams client, `sse_client`).

What each request sends: token-id and text prompts go to /completions (`prompt`), chat prompts
to /chat/completions (`messages`); `--openai-api chat` sends text prompts as one user message.
Always `stream: true` with `stream_options.include_usage`. Beyond OpenAI's own parameters it
sends `ignore_eos: true` where loadgen needs exact output lengths (synthetic prompts,
`--ignore-eos`; vLLM, SGLang and verifypd accept it) and `priority` when not 0.

Timing follows the gRPC backend (docs/loadgen.md): a chunk is token-bearing when it has
non-empty text, or token ids in verifypd's `verifypd.token_ids` extension. Tokens per chunk come
from that extension where the server sends it, else 1 per chunk (as vLLM's `bench serve`
assumes); the request's output tokens are `usage.completion_tokens` when reported. Speculation
comes from `usage.completion_tokens_details` (accepted / rejected prediction tokens).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from verifypd_loadgen import schema
from verifypd_loadgen.errors import Unreachable
from verifypd_loadgen.runner import INCOMPLETE, RequestRecord
from verifypd_loadgen.sse_client import HttpError, SsePool
from verifypd_loadgen.workload import RequestSpec

if TYPE_CHECKING:
    from verifypd.net.tls import ClientTls

TIMEOUT, CONNECTION, STREAM_ERROR = "TIMEOUT", "CONNECTION_ERROR", "STREAM_ERROR"  # error names besides HTTP_<code>


class OpenAIBackend:
    def __init__(self, client: SsePool, url: str, model: str, api: str = "auto"):
        self.client, self.url, self.model, self.api = client, url.rstrip("/"), model, api

    def request(self, spec: RequestSpec) -> tuple[str, dict]:
        """(path, JSON body) of one request."""
        p = spec.prompt
        body: dict = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if p.chat is not None or (self.api == "chat" and p.text is not None):
            path = "/chat/completions"
            chat = p.chat if p.chat is not None else [("user", p.text)]
            body["messages"] = [{"role": role, "content": content} for role, content in chat]
        else:
            path = "/completions"
            body["prompt"] = p.token_ids if p.token_ids is not None else p.text
        if spec.temperature > 0:
            body["temperature"] = spec.temperature
            if spec.seed is not None:
                body["seed"] = spec.seed
        else:
            body["temperature"] = 0.0
        if spec.stop_at_eos is False:
            body["ignore_eos"] = True
        if spec.priority:
            body["priority"] = spec.priority
        return path, body


def _record_chunk(rec: RequestRecord, obj: dict, now: float) -> None:
    choices = obj.get("choices") or []
    ext = obj.get("verifypd") or {}
    if choices:
        choice = choices[0]
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        ids = ext.get("token_ids")
        if text or ids:
            rec.chunk_times.append(now)
            rec.chunk_tokens.append(len(ids) if ids is not None else 1)
            rec.applied_k.append(int(ext.get("applied_k", 0)))
        if choice.get("finish_reason"):
            rec.finish_reason = str(choice["finish_reason"])
    usage = obj.get("usage")
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.reported_output_tokens = usage.get("completion_tokens")
        details = usage.get("completion_tokens_details") or {}
        accepted = int(details.get("accepted_prediction_tokens") or 0)
        rec.accepted_tokens = accepted
        rec.draft_tokens = accepted + int(details.get("rejected_prediction_tokens") or 0)
        rec.verify_steps = int((usage.get("verifypd") or {}).get("verify_steps") or 0)


def _error_text(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


_JSON = {"Content-Type": "application/json", "Accept": "text/event-stream"}


async def execute(backend: OpenAIBackend, spec: RequestSpec, rec: RequestRecord, timeout: float) -> None:
    """Sends one request and fills `rec` (the gRPC backend's `runner.execute`, over HTTP)."""
    path, body = backend.request(spec)
    payload = json.dumps(body).encode()
    done = False

    def on_data(data: bytes) -> bool:
        # One `data:` payload. Read on to the body's end after [DONE] (here: the terminating
        # chunk follows), so the connection is reused, as OpenAI's own client does.
        nonlocal done
        if data == b"[DONE]":
            done = True
            return False
        obj = json.loads(data)
        if "error" in obj:
            rec.error, rec.error_detail = STREAM_ERROR, str(obj["error"].get("message", obj["error"]))
            return True
        _record_chunk(rec, obj, time.perf_counter())
        return False

    rec.start = time.perf_counter()
    resp = None
    try:
        async with asyncio.timeout(timeout):
            headers = {**_JSON, "traceparent": rec.traceparent} if rec.traceparent else _JSON
            resp = await backend.client.request("POST", path, payload, headers)
            if resp.status != 200:
                rec.error, rec.error_detail = f"HTTP_{resp.status}", _error_text(await resp.read())
                return
            await resp.events(on_data)
        if rec.error is None and not rec.finish_reason:
            rec.error, rec.error_detail = INCOMPLETE, "stream ended without finish_reason"
    except TimeoutError:
        rec.error, rec.error_detail = TIMEOUT, f"no complete answer within {timeout} s"
    except (HttpError, asyncio.IncompleteReadError, OSError) as e:
        rec.error, rec.error_detail = CONNECTION, f"{type(e).__name__}: {e}"
    except ValueError as e:  # not JSON, a bad chunk size
        rec.error, rec.error_detail = STREAM_ERROR, str(e)
    except asyncio.CancelledError:
        rec.cancelled = True  # the connection is closed below: the server aborts the request
        raise
    finally:
        if resp is not None:
            resp.close()  # a no-op once the body was read to its end
        rec.end = time.perf_counter()


async def probe(client: SsePool, url: str, model: str, timeout: float) -> dict:
    """GET /models: reachability check and the server_info block (verifypd's extension fills
    draft model and topology; other servers give the model id and max_model_len if they have it)."""
    try:
        async with asyncio.timeout(timeout):
            resp = await client.request("GET", "/models")
            raw = await resp.read()
    except (HttpError, OSError, asyncio.IncompleteReadError, TimeoutError) as e:
        raise Unreachable(f"cannot reach the OpenAI-compatible server at {url} ({type(e).__name__}: {e})") from None
    if resp.status != 200:
        return schema.server_info_block(None, f"HTTP_{resp.status}")
    try:
        entries = {m.get("id"): m for m in json.loads(raw).get("data", [])}
    except (ValueError, AttributeError):
        return schema.server_info_block(None, "BAD_RESPONSE")
    entry = entries.get(model)
    if entry is None:
        return schema.server_info_block({"target_model": model}, "MODEL_NOT_LISTED")
    ext = entry.get("verifypd") or {}
    return schema.server_info_block(
        {
            "target_model": model,
            "draft_model": ext.get("draft_model"),
            "topology": ext.get("topology"),
            "max_context": entry.get("max_model_len") or ext.get("max_context"),
            "version": ext.get("version"),
        },
        "OK",
    )


def new_client(url: str, tls: ClientTls | None = None, connect_timeout: float = 10.0) -> SsePool:
    """`tls`: a verifypd.net.tls.ClientTls: https:// URLs are verified against its CA (and present its
    client certificate); None: the system's CAs. No connection cap: loadgen's concurrency decides
    how many requests are in flight."""
    return SsePool(url, tls.ssl_context() if tls else None, connect_timeout)

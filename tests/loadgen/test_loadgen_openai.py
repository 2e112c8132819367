"""`--backend openai` against a minimal in-test OpenAI-compatible server (no verifypd extensions):
what loadgen sends, how it times and counts the stream, HTTP errors, raw records, compare CDFs."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = "fake-model"


class FakeOpenAI:
    """Streams `max_tokens` chunks of one word each, `itl_s` apart; prompts containing "overload"
    get 429, "broken" an error event mid-stream. Keeps every request body it got."""

    def __init__(self, itl_s: float = 0.002):
        self.itl_s, self.bodies, self.peers = itl_s, [], []
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.gen, methods=["POST"]),
                Route("/v1/chat/completions", self.gen, methods=["POST"]),
            ]
        )

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 2048}]})

    async def gen(self, request):
        body = await request.json()
        self.bodies.append((request.url.path, body))
        self.peers.append(tuple(request.client))  # (host, port): one per TCP connection
        chat = request.url.path.endswith("chat/completions")
        prompt = json.dumps(body.get("messages") if chat else body.get("prompt"))
        if "overload" in prompt:
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit_error"}}, status_code=429)
        n = body["max_tokens"]

        async def events():
            def chunk(text, reason=None):
                choice = {"index": 0, "finish_reason": reason}
                choice.update({"delta": {"content": text}} if chat else {"text": text})
                return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

            if chat:
                yield (
                    "data: "
                    + json.dumps({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                    + "\n\n"
                )
            for i in range(n):
                await asyncio.sleep(self.itl_s)
                if "broken" in prompt and i == 2:
                    yield 'data: {"error": {"message": "engine died"}}\n\n'
                    return
                yield chunk(f" t{i}", "length" if i == n - 1 else None)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "id": "x",
                            "choices": [],
                            "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7},
                        }
                    )
                    + "\n\n"
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def fake_openai():
    from verifypd.gateway.http_server import HttpServer

    fake = FakeOpenAI()
    server = HttpServer(fake.app, "127.0.0.1", 0, grace_s=0.5).start()
    fake.url = server.url + "/v1"
    yield fake
    server.stop()


def _load(path):
    return json.loads(path.read_text())


def test_synthetic_completions_timing_and_records(fake_openai, loadgen, tmp_path):
    out = tmp_path / "r.json"
    rc, stdout, err = loadgen(
        "--backend",
        "openai",
        "--url",
        fake_openai.url,
        "--model",
        MODEL,
        "--requests",
        6,
        "--concurrency",
        "1,2",
        "--input-len",
        5,
        "--output-len",
        5,
        "--vocab-size",
        96,
        "--raw-records",
        "--out",
        out,
        "--label",
        "fake",
    )
    assert rc == 0, err
    doc = _load(out)
    assert doc["config"]["backend"] == "openai" and doc["config"]["url"] == fake_openai.url
    assert doc["server_info"]["status"] == "OK" and doc["server_info"]["max_context"] == 2048
    for run in doc["runs"]:
        s = run["summary"]
        assert s["requests"] == {"sent": 6, "completed": 6, "failed": 0, "cancelled": 0}
        assert s["tokens"]["output_total"] == 30 and s["tokens"]["input_total"] == 6 * 7  # from usage
        lat = s["latency_ms"]
        assert lat["ttft"]["count"] == 6 and lat["itl_chunk"]["count"] == 6 * 4 and lat["tpot"]["count"] == 6
        assert lat["itl_chunk"]["p50"] >= 1.0  # the fake waits 2 ms between chunks
        assert s["speculation"]["acceptance_rate"] is None  # the fake reports no prediction tokens
        recs = run["records"]
        assert len(recs) == 6 and all(r["ok"] and r["chunk_tokens"] == [1] * 5 for r in recs)
        assert all(len(r["itl_chunk_ms"]) == 4 and r["ttft_ms"] > 0 for r in recs)
    path, body = fake_openai.bodies[-1]
    assert path == "/v1/completions" and body["model"] == MODEL and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 5 and body["max_tokens"] == 5


def test_sequential_requests_reuse_one_connection(fake_openai, loadgen, tmp_path):
    """A closed loop must not pay a new TCP connection per request: the stream is read to its end
    after [DONE], so the client keeps the connection (leaving the body unread made httpx close it,
    and each request of a served benchmark paid a connect and the server's accept)."""
    rc, _, err = loadgen(
        "--backend",
        "openai",
        "--url",
        fake_openai.url,
        "--model",
        MODEL,
        "--requests",
        5,
        "--concurrency",
        "1",
        "--input-len",
        3,
        "--output-len",
        3,
        "--vocab-size",
        96,
        "--out",
        tmp_path / "r.json",
    )
    assert rc == 0, err
    assert len(fake_openai.bodies) == 5
    assert len(set(fake_openai.peers)) == 1, fake_openai.peers


def test_chat_prompts_errors_and_compare(fake_openai, loadgen, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
                {"messages": [{"role": "user", "content": "overload me"}], "max_tokens": 4},
                {"prompt": "broken stream", "max_tokens": 4},
            ]
        )
        + "\n"
    )
    out = tmp_path / "chat.json"
    rc, stdout, err = loadgen(
        "--backend",
        "openai",
        "--url",
        fake_openai.url,
        "--model",
        MODEL,
        "--dataset",
        data,
        "--requests",
        9,
        "--raw-records",
        "--out",
        out,
        "--label",
        "chat",
    )
    assert rc == 0, err
    s = _load(out)["runs"][0]["summary"]
    assert s["errors"] == {"HTTP_429": 3, "STREAM_ERROR": 3} and s["requests"]["completed"] == 3
    assert "HTTP_429" in stdout
    paths = {p for p, _ in fake_openai.bodies}
    assert paths == {"/v1/chat/completions", "/v1/completions"}
    chat_body = next(b for p, b in fake_openai.bodies if p.endswith("chat/completions"))
    assert chat_body["messages"][0]["role"] == "user" and "ignore_eos" not in chat_body
    # compare draws CDFs from the raw records of both files
    rc, _, err = loadgen(
        "--backend",
        "openai",
        "--url",
        fake_openai.url,
        "--model",
        MODEL,
        "--requests",
        3,
        "--output-len",
        3,
        "--input-len",
        2,
        "--raw-records",
        "--out",
        tmp_path / "b.json",
    )
    assert rc == 0, err
    rc, stdout, err = loadgen("compare", tmp_path / "b.json", out, "--plot", tmp_path / "cmp")
    assert rc == 0, err
    assert all(
        (tmp_path / "cmp" / n).stat().st_size > 1000
        for n in ("compare_cdf_ttft.png", "compare_cdf_itl_chunk.png", "compare_cdf_e2e.png")
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--backend", "openai", "--model", MODEL], "--url"),
        (["--backend", "openai", "--url", "http://127.0.0.1:1/v1"], "--model"),
        (["--backend", "openai", "--url", "ftp://x", "--model", MODEL], "URL"),
        (["--url", "http://127.0.0.1:1/v1", "--model", MODEL], "--server"),
    ],
)
def test_backend_flags_are_checked(loadgen, argv, message):
    rc, _, err = loadgen(*argv)
    assert rc == 2 and message in err


def test_unreachable_openai_server_exits_2(loadgen):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = loadgen(
        "--backend",
        "openai",
        "--url",
        f"http://127.0.0.1:{port}/v1",
        "--model",
        MODEL,
        "--requests",
        1,
        "--connect-timeout",
        2,
    )
    assert rc == 2 and "cannot reach the OpenAI-compatible server" in err and len(err.strip().splitlines()) == 1

"""A fake OpenAI-compatible streaming server cheap enough that a load generator, not it, is what
runs out of CPU: raw asyncio streams, several processes on one port (SO_REUSEPORT), SSE chunks
shaped like verifypd's (`choices[0].text`, `verifypd.token_ids`, usage last), pre-encoded.

Each stream sends `max_tokens` tokens, `--tokens-per-chunk` per event, one event every `--itl-ms`
(per stream), so the offered rate is concurrency * tokens-per-chunk / itl. Used by
bench/serving/loadgen_ceiling.py and bench/serving/sse_client_cost.py.

    python bench/serving/fake_sse_server.py --port 8100 --procs 4 --itl-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import time

MODELS = json.dumps({"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": 1 << 20}]}).encode()


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(obj: dict) -> bytes:
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _events(n_tokens: int, per_chunk: int) -> tuple[list[bytes], bytes]:
    """(events of the tokens, the usage + [DONE] + end-of-body tail)."""
    out = []
    sent = 0
    while sent < n_tokens:
        ids = list(range(100 + sent, 100 + min(n_tokens, sent + per_chunk)))
        sent += len(ids)
        last = sent >= n_tokens
        choice = {"index": 0, "text": " tok" * len(ids), "logprobs": None, "finish_reason": "length" if last else None}
        out.append(
            _event(
                {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "created": 0,
                    "model": "fake",
                    "choices": [choice],
                    "usage": None,
                    "verifypd": {"token_ids": ids, "applied_k": 0},
                }
            )
        )
    usage = {"prompt_tokens": 16, "completion_tokens": n_tokens, "total_tokens": n_tokens + 16}
    tail = _event({"id": "cmpl-fake", "object": "text_completion", "choices": [], "usage": usage})
    return out, tail + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class Handler:
    def __init__(self, itl_s: float, per_chunk: int):
        self.itl_s, self.per_chunk = itl_s, per_chunk
        self.cache: dict[int, tuple[list[bytes], bytes]] = {}

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path = line.split()[:2]
                length = 0
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    if h[:15].lower() == b"content-length:":
                        length = int(h[15:])
                body = await reader.readexactly(length) if length else b""
                if method == b"GET":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(MODELS), MODELS)
                    )
                    continue
                n = int(json.loads(body).get("max_tokens", 16))
                if n not in self.cache:
                    self.cache[n] = _events(n, self.per_chunk)
                events, tail = self.cache[n]
                writer.write(STREAM_HEAD)
                due = time.perf_counter()
                for ev in events:
                    due += self.itl_s
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    writer.write(ev)
                writer.write(tail)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()


def _serve(sock: socket.socket, itl_s: float, per_chunk: int) -> None:
    async def main():
        server = await asyncio.start_server(Handler(itl_s, per_chunk), sock=sock, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    return sock


def start(host: str = "127.0.0.1", port: int = 0, procs: int = 1, itl_s: float = 0.005, per_chunk: int = 1):
    """Starts `procs` server processes sharing one listening socket; returns (processes, port)."""
    sock = listening_socket(host, port)
    ctx = multiprocessing.get_context("fork")  # no torch here: a fork of this small process is safe
    workers = [ctx.Process(target=_serve, args=(sock, itl_s, per_chunk), daemon=True) for _ in range(procs)]
    for w in workers:
        w.start()
    port = sock.getsockname()[1]
    sock.close()
    return workers, port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    a = p.parse_args()
    workers, port = start(a.host, a.port, a.procs, a.itl_ms / 1e3, a.tokens_per_chunk)
    print(f"fake SSE server on {a.host}:{port} ({a.procs} processes)", flush=True)
    for w in workers:
        w.join()


if __name__ == "__main__":
    main()

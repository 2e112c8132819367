"""CPU cost per streamed SSE event of three asyncio HTTP clients reading the same streams: httpx
(`aiter_lines`, what loadgen used), aiohttp (if installed) and loadgen's own asyncio-streams client
(`verifypd_loadgen.sse_client`). Each parses every event with json.loads, as loadgen does. The
server is bench/serving/fake_sse_server.py in other processes; the figure is this process's CPU
seconds (user + sys) per event, so a busy shared machine changes it little.

    python bench/serving/sse_client_cost.py --concurrency 64 --requests 256 --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("../loadgen", "../services", ".", "serving"):
    path = os.path.join(HERE, "..", sub)
    if path not in sys.path:
        sys.path.insert(0, path)

import fake_sse_server  # noqa: E402
from bench_meta import metadata, write_result  # noqa: E402

BODY = {"model": "fake", "prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}}


async def with_httpx(url: str, c: int, n: int, tokens: int) -> int:
    import httpx

    events = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def one():
            nonlocal events
            async with client.stream("POST", url + "/completions", json=dict(BODY, max_tokens=tokens)) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
                        json.loads(data)
                        events += 1

        await _closed_loop(one, c, n)
    return events


async def with_aiohttp(url: str, c: int, n: int, tokens: int) -> int:
    import aiohttp

    events = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one():
            nonlocal events
            async with session.post(url + "/completions", json=dict(BODY, max_tokens=tokens)) as resp:
                async for line in resp.content:
                    if line.startswith(b"data:") and (data := line[5:].strip()) != b"[DONE]":
                        json.loads(data)
                        events += 1

        await _closed_loop(one, c, n)
    return events


async def with_loadgen_client(url: str, c: int, n: int, tokens: int) -> int:
    from verifypd_loadgen.sse_client import SsePool

    events = 0
    pool = SsePool(url)

    def on_data(data: bytes) -> bool:
        nonlocal events
        if data != b"[DONE]":
            json.loads(data)
            events += 1
        return False

    async def one():
        body = json.dumps(dict(BODY, max_tokens=tokens)).encode()
        resp = await pool.request("POST", "/completions", body, {"Content-Type": "application/json"})
        try:
            await resp.events(on_data)
        finally:
            resp.close()

    await _closed_loop(one, c, n)
    await pool.close()
    return events


async def _closed_loop(one, c: int, n: int) -> None:
    left = n

    async def worker():
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    await asyncio.gather(*(worker() for _ in range(c)))


def measure(name: str, fn, url: str, args) -> dict:
    t0, cpu0 = time.perf_counter(), os.times()
    events = asyncio.run(fn(url, args.concurrency, args.requests, args.tokens))
    wall, cpu1 = time.perf_counter() - t0, os.times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "client": name,
        "events": events,
        "wall_s": round(wall, 3),
        "client_cpu_s": round(cpu, 3),
        "client_cpu_us_per_event": round(cpu / max(events, 1) * 1e6, 2),
        "events_per_s": round(events / wall, 1),
        "client_cpu_util": round(cpu / wall, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256, help="events per stream (one token each)")
    p.add_argument("--itl-ms", type=float, default=2.0)
    p.add_argument("--server-procs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--smoke", action="store_true", help="tiny sizes for a CPU check")
    p.add_argument("--out", help="directory for the JSON result")
    args = p.parse_args()
    if args.smoke:
        args.concurrency, args.requests, args.tokens, args.server_procs = 8, 16, 32, 1
    workers, port = fake_sse_server.start(procs=args.server_procs, itl_s=args.itl_ms / 1e3)
    url = f"http://127.0.0.1:{port}/v1"
    clients = [("httpx", with_httpx), ("loadgen-asyncio-streams", with_loadgen_client)]
    try:
        import aiohttp  # noqa: F401

        clients.insert(1, ("aiohttp", with_aiohttp))
    except ImportError:
        print("aiohttp not installed: skipped")
    rows = []
    try:
        time.sleep(0.3)
        for name, fn in clients:
            rows.append(measure(name, fn, url, args))
            print(json.dumps(rows[-1]))
    finally:
        for w in workers:
            w.terminate()
    result = {
        **metadata(),
        "what": "client CPU per SSE event (json.loads per event), fake server in other processes",
        "concurrency": args.concurrency,
        "requests": args.requests,
        "tokens_per_stream": args.tokens,
        "itl_ms": args.itl_ms,
        "server_procs": args.server_procs,
        "rows": rows,
    }
    write_result(args.out, "sse_client_cost", result)


if __name__ == "__main__":
    main()

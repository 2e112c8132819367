"""The serving path's host ceiling: the real gateway process (grpc.aio Generate on one event loop,
detokenization) and the real engine-core process (router over lanes that do no model work, behind
the core channel), driven by the loadgen library from a third process. Tokens per second here is
the most the host side can stream at that concurrency with a free GPU; the core's time inside
`router.step` against the router alone (bench/engine/router_host_overhead.py) shows what serving costs
the engine, and the gateway's CPU seconds per streamed token what it costs the front end.

    python bench/serving/serving_host_ceiling.py --concurrency 1,16,64,128 --out bench/results

SIMULATED acceptance (seeded Bernoulli, see router_host_overhead.InstantLanes); prompt 128 tokens,
256 output tokens per request, closed loop. Measure on the machine whose CPU serves (the GPU host).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("../services", "../loadgen", ".", "engine", "seed_study", "serving"):
    path = os.path.join(HERE, "..", sub)
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_meta import metadata, write_result  # noqa: E402
from router_host_overhead import BLOCK, InstantLanes  # noqa: E402

PROMPT, OUTPUT = 128, 256


def instant_router(args):
    from verifypd.domain.config import RuntimeConfig
    from verifypd.router.router import Router

    batch = args.serve_batch
    lanes = InstantLanes(batch * ((PROMPT + OUTPUT) // BLOCK + 2) + 16, args.alpha, verify_s=args.verify_ms / 1e3)
    config = RuntimeConfig(
        k_min=args.k,
        k_max=args.k,
        k_initial=args.k,
        adaptive=False,
        schedule=args.schedule,
        pipeline=args.schedule == "pdv",
    )
    return Router(lanes, lanes, lanes, decode=None, eos_token_ids=(), config=config, max_running=batch)


def core(args) -> None:
    """The engine-core process: the router over instant lanes behind the core channel."""
    import socket

    from verifypd.core.assembly import server_info
    from verifypd.core.channel import BlockingChannel
    from verifypd.core.core_server import CoreServer

    channel = BlockingChannel(socket.socket(fileno=args.channel_fd))
    CoreServer(
        instant_router(args),
        channel,
        server_info("instant", "instant", "colocated", 1 << 16),
        max_queue=args.serve_batch,
    ).start(loop_in_thread=False)


def serve(args) -> None:
    """The gateway process: prints its address; stdin "go" starts the measured window, "stop" ends
    it and prints the core's step stats and both processes' CPU time over it; then serves until SIGTERM."""
    from serving_window import cpu_seconds

    from verifypd.core.process import CoreProcess
    from verifypd.domain.tokenizer import TextCodec
    from verifypd.gateway.server import Gateway

    argv = [
        "--serve-batch",
        str(args.serve_batch),
        "--schedule",
        args.schedule,
        "--k",
        str(args.k),
        "--alpha",
        str(args.alpha),
        "--verify-ms",
        str(args.verify_ms),
    ]
    proc = CoreProcess(None, program=[sys.executable, os.path.abspath(__file__), "--core"], program_args=argv)
    gateway = Gateway(proc.sock, TextCodec(None), core_process=proc).start()
    if args.api == "openai":  # the OpenAI HTTP API on the gateway's loop, as `verifypd serve` runs it
        from verifypd.gateway.http_api import HttpApi
        from verifypd.gateway.http_server import HttpServer

        gateway.http = HttpServer(HttpApi(gateway, model_name="instant").app, "127.0.0.1", 0, loop=gateway.loop).start()
        print(gateway.http.url.removeprefix("http://"), os.getpid(), flush=True)
    else:
        print(gateway.address, os.getpid(), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def snapshot() -> tuple:
        stats = gateway._run(gateway.client.call("stats"))
        return stats["step_seconds"], stats["steps"], stats["tokens_out"], time.process_time(), cpu_seconds(proc.pid)

    sys.stdin.readline()  # "go"
    before, t0 = snapshot(), time.perf_counter()
    sys.stdin.readline()  # "stop"
    after, wall = snapshot(), time.perf_counter() - t0
    step_s, steps, tokens, gateway_cpu, core_cpu = (a - b for a, b in zip(after, before, strict=False))
    print(
        json.dumps(
            {
                "wall_s": wall,
                "step_s": step_s,
                "steps": steps,
                "tokens": tokens,
                "gateway_cpu_s": gateway_cpu,
                "core_cpu_s": core_cpu,
            }
        ),
        flush=True,
    )
    stop.wait()
    gateway.stop()


async def drive(address: str, c: int, seconds: float, tell, api: str = "grpc") -> dict:
    import grpc

    from verifypd.v1 import generate_pb2_grpc
    from verifypd_loadgen import metrics
    from verifypd_loadgen import openai_backend as ob
    from verifypd_loadgen.runner import LoadPoint, Runner
    from verifypd_loadgen.workload import Distribution, Workload

    work = Workload(
        input_len=Distribution("fixed", (PROMPT,)),
        output_len=Distribution("fixed", (OUTPUT,)),
        vocab_range=(3, 30000),
        seed=0,
        ignore_eos=True,
    )

    async def go(runner) -> dict:
        await runner.run(LoadPoint("closed", concurrency=c), work.requests(stream=1), c, None, "warmup", 0)
        tell("go")  # the server's window is the measured duration, without the drain after it
        asyncio.get_running_loop().call_later(seconds, tell, "stop")
        res = await runner.run(LoadPoint("closed", concurrency=c), work.requests(stream=1), None, seconds, f"c{c}", 0)
        return metrics.summarize(res)

    if api == "openai":
        client = ob.new_client(f"http://{address}/v1")
        try:
            backend = ob.OpenAIBackend(client, f"http://{address}/v1", "instant", "completions")
            return await go(Runner(backend, 120, 120, execute=ob.execute))
        finally:
            await client.close()
    async with grpc.aio.insecure_channel(address) as channel:
        return await go(Runner(generate_pb2_grpc.GenerationStub(channel), timeout=120, drain_timeout=120))


def point(args, c: int) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--serve",
        "--serve-batch",
        str(c),
        "--schedule",
        args.schedule,
        "--k",
        str(args.k),
        "--alpha",
        str(args.alpha),
        "--verify-ms",
        str(args.verify_ms),
        "--api",
        args.api,
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    spy = None
    try:
        address, gateway_pid = proc.stdout.readline().split()

        def tell(word: str) -> None:
            nonlocal spy
            proc.stdin.write(word + "\n")
            proc.stdin.flush()
            if word == "go" and args.py_spy:  # samples the gateway over the measured window
                spy = subprocess.Popen(
                    [
                        args.py_spy,
                        "record",
                        "--pid",
                        gateway_pid,
                        "--duration",
                        str(max(1, int(args.seconds))),
                        "--rate",
                        "250",
                        "--nonblocking",
                        "--format",
                        "raw",
                        "--output",
                        os.path.join(args.out or ".", f"pyspy_gateway_{args.api}_c{c}.txt"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )

        summary = asyncio.run(drive(address, c, args.seconds, tell, args.api))
        if spy is not None:
            spy.wait()
        server = json.loads(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
    finally:
        proc.kill()
        proc.wait()
    steps = max(server["steps"], 1)
    return {
        "api": args.api,
        "schedule": args.schedule,
        "concurrency": c,
        "k": args.k,
        "client_output_tok_s": round(summary["throughput"]["output_tokens_per_s"], 1),
        "itl_p95_ms": summary["latency_ms"]["itl_token"]["p95"],
        "ttft_p50_ms": summary["latency_ms"]["ttft"]["p50"],  # a step's wait + one step is the floor
        "server_tok_s": round(server["tokens"] / server["wall_s"], 1),
        "steps_per_s": round(server["steps"] / server["wall_s"], 1),
        "router_us_per_step": round(server["step_s"] / steps * 1e6, 1),  # incl. --verify-ms
        "host_us_per_step": round((server["step_s"] / steps - args.verify_ms / 1e3) * 1e6, 1),
        "tokens_per_step": round(server["tokens"] / steps, 1),
        "engine_thread_busy": round(server["step_s"] / server["wall_s"], 3),
        "gateway_cpu_us_per_token": round(server["gateway_cpu_s"] / max(server["tokens"], 1) * 1e6, 1),
        "core_cpu_us_per_token": round(server["core_cpu_s"] / max(server["tokens"], 1) * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,16,64,128")
    ap.add_argument("--schedule", default="pd", choices=("pd", "pdv"))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=0.7, help="SIMULATED per-token acceptance")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per point")
    ap.add_argument(
        "--verify-ms",
        type=float,
        default=0.0,
        help="each verify call sleeps this long (GIL released), standing in for the GPU step",
    )
    ap.add_argument(
        "--api",
        default="grpc",
        choices=("grpc", "openai"),
        help="drive gRPC Generate or the OpenAI HTTP API (/v1/completions, streamed)",
    )
    ap.add_argument("--py-spy", default=None, help="py-spy binary: sample the gateway over each window (--out)")
    ap.add_argument("--out", default=None, help="directory for serving_host_ceiling_<host>.json")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--core", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--channel-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.core:
        return core(args)
    if args.serve:
        return serve(args)
    rows = []
    print(f"verify call: {args.verify_ms} ms of simulated GPU time", flush=True)
    for c in (int(x) for x in args.concurrency.split(",")):
        rows.append(point(args, c))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        **metadata(),
        "label": f"SIMULATED acceptance alpha={args.alpha}; lanes do no work; verify call sleeps {args.verify_ms} ms",
        "verify_ms": args.verify_ms,
        "rows": rows,
    }
    api = "" if args.api == "grpc" else f"_{args.api}"
    write_result(args.out, f"serving_host_ceiling{api}_{args.schedule}_{args.verify_ms:g}ms", result)


if __name__ == "__main__":
    main()

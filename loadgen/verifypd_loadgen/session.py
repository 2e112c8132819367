"""One `verifypd-loadgen` run: probe the server, warm up, run every load point, report."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console

from verifypd.net.tls import ClientTls, grpc_channel
from verifypd.v1 import generate_pb2, generate_pb2_grpc
from verifypd_loadgen import metrics, procs, report, schema
from verifypd_loadgen.errors import Unreachable
from verifypd_loadgen.runner import LoadPoint, PointResult, Runner
from verifypd_loadgen.workload import Workload


@dataclass
class Plan:
    server: str | None  # grpc: HOST:PORT
    loads: list[LoadPoint]
    workload: Workload
    requests: int | None
    duration: float | None
    warmup: int
    timeout: float
    drain_timeout: float
    connect_timeout: float
    slo_ttft_ms: float | None
    slo_itl_ms: float | None
    seed: int
    backend: str = "grpc"  # "grpc" (verifypd Generate) | "openai" (any OpenAI-compatible HTTP server)
    url: str | None = None  # openai: base URL, e.g. http://127.0.0.1:8000/v1
    model: str | None = None  # openai: the model id to ask for
    openai_api: str = "auto"  # openai: auto | chat | completions
    raw_records: bool = False  # per-request records in the results JSON
    tls: ClientTls | None = None  # --tls-ca-file ...: both backends speak TLS
    # Request ids are `{run_tag}-lg{point}-{n}`: a random tag per run and client process, so ids
    # never repeat across processes, runs or loadgens sharing a server.
    run_tag: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    procs: int = 1  # --procs: client processes in all (procs.py); this one is proc_index
    trace_ratio: float = 0.0  # --trace-ratio: the share of requests sent with a sampled traceparent
    trace_slot_s: float | None = None  # --trace-alternate: traced in odd slots of this many seconds
    proc_index: int = 0


async def probe(stub, server: str, timeout: float) -> dict:
    """GetServerInfo, also our reachability check. UNIMPLEMENTED (and other answers) still
    prove the server is there; only UNAVAILABLE / no answer in time mean it is not."""
    try:
        info = await stub.GetServerInfo(generate_pb2.ServerInfoRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise Unreachable(f"cannot reach verifypd at {server} ({e.code().name}: {e.details()})") from None
        return schema.server_info_block(None, e.code().name)
    return schema.server_info_block({k: getattr(info, k) for k in schema.SERVER_INFO_KEYS}, "OK")


def warmup_load(plan: Plan, warmup: int) -> LoadPoint:
    first = procs.share_load(plan.loads[0], plan.procs, plan.proc_index) or plan.loads[0]
    cap = first.concurrency if first.mode == "closed" else (first.max_concurrency or warmup)
    if cap is None:
        raise ValueError("a closed load point needs its concurrency")
    return LoadPoint("closed", concurrency=max(1, min(warmup, cap)))


async def _ticker(progress: report.LiveProgress) -> None:
    while True:  # keeps a duration bar moving while no request finishes
        progress.refresh()
        await asyncio.sleep(0.25)


def plan_runner(plan: Plan, progress: report.LiveProgress, stub, **kwargs) -> Runner:
    """The plan's Runner over `stub` (a Generation stub, or the openai backend with its `execute`)."""
    return Runner(
        stub,
        plan.timeout,
        plan.drain_timeout,
        on_record=progress.on_record,
        on_send=progress.on_send,
        trace_ratio=plan.trace_ratio,
        trace_slot_s=plan.trace_slot_s,
        seed=procs.point_seed(plan.seed, plan.proc_index),
        **kwargs,
    )


async def execute_plan(
    plan: Plan, progress: report.LiveProgress, before_point: Callable[[], None] | None = None
) -> tuple[dict, dict, list[PointResult]]:
    """Returns (server_info block, warm-up counts, one PointResult per load point).
    `before_point`: called (in a thread) before each load point: the barrier of --procs."""
    if plan.backend == "openai":
        from verifypd_loadgen import openai_backend as ob

        if plan.url is None or plan.model is None:
            raise ValueError("the openai backend needs a URL and a model")
        client = ob.new_client(plan.url, plan.tls, plan.connect_timeout)
        try:
            info = await ob.probe(client, plan.url, plan.model, plan.connect_timeout)
            backend = ob.OpenAIBackend(client, plan.url, plan.model, plan.openai_api)
            runner = plan_runner(plan, progress, backend, execute=ob.execute)
            return (info, *await run_points(plan, runner, progress, before_point))
        finally:
            await client.close()
    if plan.server is None:
        raise ValueError("the grpc backend needs a server address")
    async with grpc_channel(plan.server, plan.tls, aio=True) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        info = await probe(stub, plan.server, plan.connect_timeout)
        runner = plan_runner(plan, progress, stub)
        return (info, *await run_points(plan, runner, progress, before_point))


async def run_points(
    plan: Plan, runner: Runner, progress: report.LiveProgress, before_point: Callable[[], None] | None = None
) -> tuple[dict, list[PointResult]]:
    n_procs, me = plan.procs, plan.proc_index
    warmup = procs.share(plan.warmup, n_procs, me)
    warm = {"requests": warmup, "failed": 0}
    if warmup:
        progress.start_point("warm-up", warmup, None)
        # A different request stream from the measured one, so that warm-up prompts do
        # not pre-fill any prefix cache for the measured requests.
        res = await runner.run(
            warmup_load(plan, warmup),
            plan.workload.requests(stream=0),
            warmup,
            None,
            f"{plan.run_tag}-warmup",
            procs.point_seed(plan.seed, me),
        )
        warm["failed"] = sum(not r.ok for r in res.records)
    results = []
    for i, full_load in enumerate(plan.loads):
        load = procs.share_load(full_load, n_procs, me)
        n = None if plan.requests is None else procs.share(plan.requests, n_procs, me)
        if before_point is not None:
            await asyncio.to_thread(before_point)
        if load is None:  # fewer requests in flight than processes: this one sits the point out
            results.append(PointResult(full_load, [], time.perf_counter(), time.perf_counter()))
            continue
        progress.start_point(load.label, n, plan.duration)
        tick = asyncio.create_task(_ticker(progress))
        cpu0, wall0 = procs.cpu_seconds(), time.perf_counter()
        try:
            # stream=1 for every point: each load point sees the same requests
            result = await runner.run(
                load,
                plan.workload.requests(stream=1),
                n,
                plan.duration,
                f"{plan.run_tag}-lg{i}",
                procs.point_seed(plan.seed, me),
            )
        finally:
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick
        cpu, wall = procs.cpu_seconds() - cpu0, time.perf_counter() - wall0
        result.load, result.client_cpu = full_load, [cpu / max(wall, 1e-9)]
        results.append(result)
        progress.refresh()
    return warm, results


def load_block(load: LoadPoint) -> dict:
    return {
        "label": load.label,
        "mode": load.mode,
        "concurrency": load.concurrency,
        "rate": load.rate,
        "arrival": load.arrival if load.mode == "open" else None,
        "burstiness": load.burstiness if load.mode == "open" else None,
        "max_concurrency": load.max_concurrency,
    }


@dataclass
class Outputs:
    out: str | None = None
    csv: str | None = None
    plot: str | None = None
    label: str | None = None
    progress: bool = True


def run_session(
    plan: Plan, config: dict, outputs: Outputs, console: Console, argv: list[str] | None = None, child=None
) -> int:
    """`argv`: the run's command line, which --procs > 1 hands to its client processes, each
    running `child` (cli.client_process)."""
    err = Console(stderr=True)
    try:
        if plan.procs > 1:
            if argv is None or child is None:
                raise ValueError("--procs > 1 needs the run's command line and the client process's entry")
            if outputs.progress and err.is_terminal:
                err.print(f"{plan.procs} client processes; no live progress", markup=False)
            info, warm, results = procs.run_parallel(child, argv, plan.loads, plan.procs)
        else:
            progress = report.LiveProgress(err, outputs.progress and err.is_terminal)
            with progress:
                info, warm, results = asyncio.run(execute_plan(plan, progress))
    except Unreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a client process failed
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs: list[dict[str, Any]] = [
        {
            "load": load_block(r.load),
            "summary": metrics.summarize(r, plan.slo_ttft_ms, plan.slo_itl_ms),
            **({"records": metrics.records(r)} if plan.raw_records else {}),
        }
        for r in results
    ]
    doc = schema.build_results(config, info, warm, runs, outputs.label)
    report.print_summary(console, runs)
    try:
        for path in (outputs.out, outputs.csv):
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
        if outputs.out:
            schema.dump(doc, outputs.out)
            console.print(f"results: {outputs.out}", markup=False)
        if outputs.csv:
            report.write_csv(doc, outputs.csv)
            console.print(f"csv: {outputs.csv}", markup=False)
        if outputs.plot:
            from verifypd_loadgen import plots  # matplotlib only when plotting

            written = plots.plot_results(doc, [metrics.samples(r) for r in results], outputs.plot)
            console.print("plots: " + ", ".join(str(p) for p in written), markup=False)
    except OSError as e:
        print(f"error: cannot write output: {e}", file=sys.stderr)
        return 2
    sent = sum(run["summary"]["requests"]["sent"] for run in runs)
    done = sum(run["summary"]["requests"]["completed"] for run in runs)
    if sent and not done:
        codes: dict[str, int] = {}
        for run in runs:
            for code, n in run["summary"]["errors"].items():
                codes[code] = codes.get(code, 0) + n
        detail = ", ".join(f"{c}: {n}" for c, n in sorted(codes.items()))
        print(f"error: all {sent} requests failed ({detail})", file=sys.stderr)
        return 1
    return 0


def client_process(build_plan, argv: list[str], index: int, procs: int, barrier, conn) -> None:
    """One client process: `build_plan(argv)` -> its Plan; this process's share of it, a barrier
    before each point, JSON results on `conn`. (`cli.client_process` is the spawn target.)"""
    plan = build_plan(argv)
    plan.proc_index, plan.procs = index, procs
    plan.workload.proc = index

    def before_point() -> None:  # blocking: run in a thread so the loop stays free
        barrier.wait()

    try:
        info, warm, results = asyncio.run(
            execute_plan(plan, report.LiveProgress(Console(stderr=True), False), before_point=before_point)
        )
        out = {
            "info": info,
            "warm": warm,
            "points": [
                {
                    "t_start": r.t_start,
                    "t_end": r.t_end,
                    "cpu": r.client_cpu,
                    "records": [dataclasses.asdict(rec) for rec in r.records],
                }
                for r in results
            ],
        }
    except Unreachable as e:
        barrier.abort()
        out = {"unreachable": str(e)}
    except threading.BrokenBarrierError:
        out = {"error": "another client process failed"}
    except BaseException as e:
        barrier.abort()
        out = {"error": f"{type(e).__name__}: {e}"}
    conn.send_bytes(json.dumps(out).encode())
    conn.close()

"""`--procs N`: the run split over N client processes that start each load point together and
merge their requests into one report.

Each process gets its share of the load (concurrency, rate, request count, warm-up, open-loop
concurrency cap), its own workload stream and arrival seed, and its own request-id tag. Processes
connect and warm up on their own, then meet at a barrier before every load point, so their points
start within a millisecond or so of each other. Their records travel back as JSON over a pipe (no
pickle of data). Timestamps are `time.perf_counter()`, CLOCK_MONOTONIC on Linux, one clock for all
processes of the host, so merged records keep their times. Each process measures its own CPU time
(user + sys) per point, and the summary reports CPU / wall per process: a client near 1.0 is
saturated and its latencies and throughput are the client's, not the server's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import time
from collections.abc import Callable

from verifypd_loadgen.errors import Unreachable
from verifypd_loadgen.runner import LoadPoint, PointResult, RequestRecord

CONCURRENCY_PER_PROC = 32  # default --procs: ceil(max concurrency / this), docs/loadgen.md


def default_procs(loads: list[LoadPoint]) -> int:
    """Enough processes for the largest point's concurrency (open loop: its cap, else 1), at most
    the host's cores."""
    top = max((p.concurrency if p.mode == "closed" else (p.max_concurrency or 1)) or 1 for p in loads)
    return max(1, min(os.cpu_count() or 1, math.ceil(top / CONCURRENCY_PER_PROC)))


def share(total: int, procs: int, index: int) -> int:
    """Process `index`'s part of `total` (the first total % procs processes get one more)."""
    return total // procs + (index < total % procs)


def share_load(load: LoadPoint, procs: int, index: int) -> LoadPoint | None:
    """This process's part of a load point; None when it has no part (concurrency < procs)."""
    if load.mode == "closed":
        c = share(load.concurrency or 1, procs, index)
        return dataclasses.replace(load, concurrency=c) if c else None
    cap = share(load.max_concurrency, procs, index) if load.max_concurrency else None
    if load.max_concurrency and not cap:
        return None
    return dataclasses.replace(load, rate=(load.rate or 0.0) / procs, max_concurrency=cap)


def point_seed(seed: int, index: int) -> int:
    return seed if index == 0 else (seed * 1_000_003 + index) & 0x7FFFFFFF


def _record_from(d: dict) -> RequestRecord:
    return RequestRecord(**d)


def run_parallel(
    child: Callable, argv: list[str], loads: list[LoadPoint], procs: int
) -> tuple[dict, dict, list[PointResult]]:
    """Runs `argv` (a `run` command line) in `procs` processes, each `child(argv, index, procs,
    barrier, conn)` (a module-level function: spawn imports it); returns what `execute_plan` does,
    merged: records of all processes per point, the earliest start and latest end, and each
    process's CPU utilisation in `client_cpu`."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds gRPC threads
    barrier = ctx.Barrier(procs)
    pipes, workers = [], []
    for i in range(procs):
        recv, send = ctx.Pipe(duplex=False)
        w = ctx.Process(target=child, args=(argv, i, procs, barrier, send), daemon=True)
        w.start()
        send.close()
        pipes.append(recv)
        workers.append(w)
    outs = []
    try:
        for i, recv in enumerate(pipes):
            try:
                outs.append(json.loads(recv.recv_bytes()))
            except EOFError:
                barrier.abort()
                workers[i].join(5)
                outs.append({"error": f"client process {i} exited (code {workers[i].exitcode})"})
    finally:
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.terminate()
    for out in outs:
        if "unreachable" in out:
            raise Unreachable(out["unreachable"])
    errors = [f"process {i}: {out['error']}" for i, out in enumerate(outs) if "error" in out]
    if errors:
        raise RuntimeError("client processes failed: " + "; ".join(errors))
    warm = {
        "requests": sum(o["warm"]["requests"] for o in outs),
        "failed": sum(o["warm"]["failed"] for o in outs),
    }
    results = []
    for n, load in enumerate(loads):
        parts = [o["points"][n] for o in outs]
        records = [_record_from(d) for p in parts for d in p["records"]]
        started = [p for p in parts if p["records"]] or parts
        results.append(
            PointResult(
                load,
                records,
                min(p["t_start"] for p in started),
                max(p["t_end"] for p in started),
                client_cpu=[c for p in parts for c in p["cpu"]],
            )
        )
    return outs[0]["info"], warm, results


def cpu_seconds() -> float:
    """This process's CPU time, user + sys of all its threads (gRPC's included), ns resolution
    (os.times counts in 10 ms ticks)."""
    return time.process_time()

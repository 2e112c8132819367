"""What request tracing costs the engine core's loop thread, isolated from the rest of serving:
a SIMULATED step loop (no model: each step is `--work-us` of Python bookkeeping, then
`--wait-us` with the GIL released, as a GPU step's host sync) drives the core's real
`RequestTracing` hooks as a closed loop of `--concurrency` requests of `--gen` tokens does
(lane span per step, the finished requests' spans, a new request's `begin` from a second
thread like the channel reader), exporting over OTLP/gRPC to a receiver in another process
(niced: otlp_sink.py).
Reports steps/s, step-time p50/p99/max per mode and the overhead 1 - on/off (median of paired
ratios over `--pairs` off/on segments, order alternating).

    python bench/serving/tracing_core_loop.py --out /tmp/r               (CPU; seconds)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "services"))

sys.path.insert(0, HERE)

from bench_meta import metadata, write_result  # noqa: E402
from otlp_sink import OtlpSink  # noqa: E402


def spin(us: float) -> None:
    """Python work holding the GIL for about `us` microseconds."""
    end = time.perf_counter() + us / 1e6
    x = 0
    while time.perf_counter() < end:
        x += 1


def segment(args, tracing, seconds: float) -> dict:
    """Steps for `seconds`; a step's lane call span, then its finished requests' spans."""
    running = [SimpleNamespace(request_id=str(i)) for i in range(args.concurrency)]
    router = SimpleNamespace(scheduler=SimpleNamespace(running=running))
    next_id = [args.concurrency]
    tp = "00-{:032x}-{:016x}-01"
    if tracing is not None:
        for s in running:
            tracing.begin(s.request_id, tp.format(int(s.request_id) + 1, 1))
    new = []
    lock = threading.Lock()

    def reader(rid: str) -> None:  # the channel reader thread's part: begin a new request's span
        if tracing is not None:
            tracing.begin(rid, tp.format(int(rid) + 1, 1))
        with lock:
            new.append(SimpleNamespace(request_id=rid))

    times, tokens = [], {s.request_id: 0 for s in running}
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        spin(args.work_us)
        time.sleep(args.wait_us / 1e6)  # the GPU: the GIL released
        if tracing is not None:
            tracing.on_lane_step("verify", (args.wait_us) / 1e6, len(running))
        now = time.monotonic()
        finished = []
        for s in running:
            tokens[s.request_id] += 1
            if tokens[s.request_id] >= args.gen:
                finished.append(s)
        for s in finished:
            running.remove(s)
            stats = SimpleNamespace(
                prompt_tokens=128, completion_tokens=args.gen, token_times=[now - 0.2, now], scheduled_time=now - 0.3,
                arrival_time=now - 0.31, preemptions=0, verify_steps=args.gen, draft_tokens=0, accepted_tokens=0,
            )  # fmt: skip
            if tracing is not None:
                tracing.on_request_finished(SimpleNamespace(request_id=s.request_id, stats=stats, finish_reason=None))
            rid = str(next_id[0])
            next_id[0] += 1
            tokens[rid] = 0
            threading.Thread(target=reader, args=(rid,)).start()
        with lock:
            running.extend(new)
            new.clear()
        if tracing is not None:
            tracing.on_step(router)
        times.append(time.perf_counter() - t0)
    times.sort()
    q = statistics.quantiles(times, n=100)
    return {
        "steps_per_s": round(len(times) / seconds, 1),
        "step_p50_ms": round(q[49] * 1e3, 3),
        "step_p99_ms": round(q[98] * 1e3, 3),
        "step_max_ms": round(times[-1] * 1e3, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--work-us", type=float, default=700.0, help="Python work per step (GIL held)")
    p.add_argument("--wait-us", type=float, default=1000.0, help="GIL-released wait per step (the GPU)")
    p.add_argument("--seconds", type=float, default=4.0, help="per segment")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--flush-wait", type=float, default=6.0, help="seconds for the last spans to arrive")
    p.add_argument("--out", help="directory for the JSON result")
    args = p.parse_args()

    sink = OtlpSink()
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{sink.port}"
    os.environ["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
    from verifypd.core.tracing import RequestTracing
    from verifypd.net.trace_context import make_tracing

    tracing = RequestTracing(make_tracing("verifypd-core"))
    segment(args, tracing, 1.0)  # warm-up, not counted: the exporter's start, first connection
    rows, ratios = [], []
    for i in range(args.pairs):
        pair = {}
        for traced in (False, True) if i % 2 == 0 else (True, False):  # order alternating: drift cancels
            pair[traced] = segment(args, tracing if traced else None, args.seconds)
            rows.append({"traced": traced, "pair": i, **pair[traced]})
            print(rows[-1], flush=True)
        ratios.append(pair[True]["steps_per_s"] / pair[False]["steps_per_s"])
    time.sleep(args.flush_wait)  # the exporter's last batches (OTEL_BSP_SCHEDULE_DELAY: 5 s by default)
    spans = sink.spans()
    sink.stop()
    result = {
        **metadata(),
        "what": "SIMULATED engine core loop (Python work + GIL-released wait per step, no model) driving "
        "RequestTracing's hooks; spans over OTLP/gRPC to a receiver process",
        "args": vars(args),
        "rows": rows,
        "spans_received": spans,
        "overhead_median_of_pairs": round(1 - statistics.median(ratios), 4),
        "paired_ratios": [round(r, 4) for r in ratios],
    }
    print({k: result[k] for k in ("spans_received", "overhead_median_of_pairs", "paired_ratios")})
    write_result(args.out, "tracing_core_loop", result)


if __name__ == "__main__":
    main()

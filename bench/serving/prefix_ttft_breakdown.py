"""Where a prefix-cache hit's time to first token goes (bench/serving/prefix_cache.py --breakdown).

Over prefix_cache.py's in-process engine with the prefix cache on (after its rows), after a warm-up and
one request of the prefix (cached already, or cached by it): `--breakdown-requests` requests PREFIX + a new suffix each
(every one a hit on all of PREFIX's full blocks), and per request:
  * TTFT (the engine's stats: arrival to first token);
  * host phases, wall time around the router's calls: add_request (validation, sequence), plan (the
    scheduler: prefix lookup and hashing, admission, chunking), prefill_launch (the prefill lane's
    launch: layout, graph replay or eager forward, first-token sampling, the copy queued; of it,
    prefill_forward: the target runner's forward call alone), first_token_wait (waiting for the
    device and its copy), commit (first token committed, streamed); each summed over the request's
    calls up to its first token (the plan and commit calls of the decode steps after it are not in
    its TTFT), with the calls per phase seen (`host_phase_calls`);
  * on the GPU, one more such request with max_tokens 1 (its prefill only: no decode step's kernels
    in the figures) under torch.profiler (CUDA activity): kernels launched, GPU busy time (union of
    the kernels' intervals), the span from the first to the last kernel, the idle time inside it,
    and time per kernel class (floor_profile.kernel_class).
Then the same requests with split-KV attention off (ModelRunner.split_min_context past the context), so
the A/B of model.split_kv is measured on the same engine, and the bytes floor: the target's GEMM weight
bytes (floor_profile.gemm_bytes: every weight a forward must read; no KV) / the measured device copy
bandwidth, and a graph-captured plain decode step at the same context (runner.last_logits) beside it.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # floor_profile
from floor_profile import copy_bandwidth, gemm_bytes, kernel_class, step_seconds

from verifypd.model.layout import TokenRun

PHASES = ("add_request", "plan", "prefill_launch", "prefill_forward", "first_token_wait", "commit")


class PhaseClock:
    """Wraps the engine's calls on the cached request's path (instance attributes, nothing patched in
    the classes) and sums wall time per phase for the request in flight, up to its first token (the
    prefill's commit): the plan and commit calls of its decode steps after it are no part of its
    TTFT (summed over a request of 4 tokens, `plan` read ~4 plan calls)."""

    def __init__(self, engine):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.counting = False
        router, ctx = engine.router, engine.router.context
        router.add_request = self.timed("add_request", router.add_request)
        commit = self.timed("commit", ctx.commit_prefill)

        def commit_prefill(*args, **kwargs):
            try:
                return commit(*args, **kwargs)
            finally:
                self.counting = False  # the first token is committed (one request in flight)

        ctx.commit_prefill = commit_prefill
        self.ctx = ctx
        lane = engine.prefill_lane
        launch = lane.prefill_start
        lane.target.forward = self.timed("prefill_forward", lane.target.forward)  # (only prefill calls it)

        def prefill_start(items):
            started = self.timed("prefill_launch", launch)(items)
            started.result = self.timed("first_token_wait", started.result)
            return started

        lane.prefill_start = prefill_start

    def timed(self, phase: str, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.counting:
                    self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
                    self.calls[phase] = self.calls.get(phase, 0) + 1

        return call

    def start(self) -> None:
        """Before each request: zeroes the sums; the scheduler is wrapped anew (attach_pools may replace it)."""
        self.seconds, self.calls, self.counting = {}, {}, True
        scheduler = self.ctx.scheduler
        if not getattr(scheduler.plan, "phase_clock", False):
            scheduler.plan = self.timed("plan", scheduler.plan)
            scheduler.plan.phase_clock = True


def gpu_profile(fn, cuda: bool) -> dict:
    """Kernels, GPU busy / span / idle (ms) and ms per kernel class of one call of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    on_device = torch.autograd.DeviceType.CUDA
    kernels = [ev for ev in prof.events() if ev.device_type == on_device and ev.time_range.elapsed_us() > 0]
    if not kernels:
        return {"kernels": 0, "note": "no device kernels recorded (CPU run)"}
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in kernels)
    busy, (cur_start, cur_end) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = spans[-1][1] - spans[0][0]
    by_class: dict[str, float] = {}
    for ev in kernels:
        cls = kernel_class(ev.name)
        by_class[cls] = by_class.get(cls, 0.0) + ev.time_range.elapsed_us()
    top: dict[str, float] = {}
    for ev in kernels:
        top[ev.name[:100]] = top.get(ev.name[:100], 0.0) + ev.time_range.elapsed_us()
    return {
        "kernels": len(kernels),
        "gpu_busy_ms": round(busy / 1e3, 4),
        "kernel_span_ms": round(span / 1e3, 4),
        "gpu_idle_in_span_ms": round((span - busy) / 1e3, 4),
        "gpu_ms_by_class": {c: round(v / 1e3, 4) for c, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: round(v / 1e3, 4) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:10]},
    }


def breakdown(engine, prefix: list[int], new_suffix, requests: int, max_tokens: int) -> dict:
    """See the module doc. `engine`: an in-process Engine with the prefix cache on (its methods are
    wrapped: close it afterwards); `new_suffix()`: a fresh suffix (token ids) per request."""
    from verifypd.domain.requests import RequestSpec

    runner = engine.verify_lane.target  # the target's ModelRunner (the prefill lane's too)
    cuda = runner.device.type == "cuda"
    clock = PhaseClock(engine)
    count = iter(range(1_000_000))

    def one(prompt: list[int], tokens: int = max_tokens) -> tuple[float, int]:
        clock.start()
        name = f"b{next(count)}"
        spec = RequestSpec(tuple(prompt), max_tokens=tokens, stop_at_eos=False, request_id=name)
        done = engine.generate([spec])[name]
        return done.ttft_s, done.usage["cached_tokens"]

    one(new_suffix() * 4)  # warm-up: an unrelated short prompt
    one(prefix + new_suffix())  # the prefix, uncached: its blocks enter the cache

    def measure() -> dict:
        ttfts, cached = [], []
        phases: dict[str, list[float]] = {p: [] for p in PHASES}
        calls: set[tuple] = set()
        for _ in range(requests):
            ttft, hit = one(prefix + new_suffix())
            ttfts.append(ttft)
            cached.append(hit)
            for p in PHASES:
                phases[p].append(clock.seconds.get(p, 0.0))
            calls.add(tuple(clock.calls.get(p, 0) for p in PHASES))
        host = {p: round(statistics.median(v) * 1e3, 4) for p, v in phases.items()}
        return {
            "ttft_ms_median": round(statistics.median(ttfts) * 1e3, 4),
            "ttft_ms": [round(t * 1e3, 4) for t in ttfts],
            "cached_tokens": cached,
            "host_phase_ms_median": host,
            # calls per phase up to the first token, each distinct tuple seen (PHASES order)
            "host_phase_calls": {"phases": list(PHASES), "seen": sorted(calls)},
            "gpu": gpu_profile(lambda: one(prefix + new_suffix(), 1), cuda),  # the prefill's kernels only
        }

    context = len(prefix)
    split_on = measure()
    min_context = runner.split_min_context
    runner.split_min_context = 1 << 30  # split-KV off: the plain graphs
    split_off = measure()
    runner.split_min_context = min_context

    weights = sum(gemm_bytes(runner.model).values())
    result = {
        "requests": requests,
        "prefix_tokens": context,
        "prefill_splits": dict(runner.prefill_splits),
        # split-KV runs in the Triton attention's prefill graphs (CUDA) past split_min_context; elsewhere
        # (the CPU's reference attention, a short prefix) both sides run the same path
        "split_kv_active": bool(runner.prefill_splits) and context >= runner.split_min_context,
        "split_kv_on": split_on,
        "split_kv_off": split_off,
        "weight_bytes": weights,
    }
    if cuda:
        bandwidth = copy_bandwidth(runner.device, 64 * 1024 * 1024)  # 256 MB: the KV pool holds most free memory
        floor_ms = weights / bandwidth * 1e3
        blocks = tuple(range(-(-(context + 8) // runner.block_size)))  # the engine is done with its KV
        decode_ms = step_seconds(runner, [TokenRun([7], context, blocks)], 20, True) * 1e3
        result.update(
            copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
            floor_ms=round(floor_ms, 4),
            floor_note="GEMM weight bytes / measured copy bandwidth: one forward must read every weight once",
            decode_step_ms_at_context=round(decode_ms, 4),
            ttft_over_floor=round(split_on["ttft_ms_median"] / floor_ms, 3),
            ttft_over_floor_split_off=round(split_off["ttft_ms_median"] / floor_ms, 3),
        )
    return result

"""Sending requests and timing their streams (grpc.aio, one event loop).

Timestamps are `time.perf_counter()` (monotonic) taken in the client when each streamed
message is handed to us; everything is measured relative to the moment the call was started.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from verifypd.v1 import generate_pb2, generate_pb2_grpc
from verifypd_loadgen import arrivals
from verifypd_loadgen.workload import RequestSpec

# Client-side failure names, reported next to gRPC status code names in `errors`.
INCOMPLETE = "INCOMPLETE_STREAM"  # stream ended OK but no message had finish_reason set


@dataclass
class RequestRecord:
    request_id: str
    priority: int
    max_tokens: int
    input_len: int | None
    start: float = 0.0  # perf_counter when the call was started
    end: float | None = None  # when the stream finished (OK or not)
    chunk_times: list[float] = field(default_factory=list)  # token-bearing messages only
    chunk_tokens: list[int] = field(default_factory=list)
    applied_k: list[int] = field(default_factory=list)
    error: str | None = None  # gRPC status code name or INCOMPLETE
    error_detail: str = ""
    cancelled: bool = False  # cancelled by loadgen at the end of a duration run
    finish_reason: str = ""
    prompt_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    reported_output_tokens: int | None = None  # openai backend: usage.completion_tokens
    traceparent: str = ""  # the W3C trace context sent with it (`--trace-ratio`); "": none

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled

    @property
    def output_tokens(self) -> int:
        """Token ids received (gRPC); over OpenAI-compatible HTTP, what usage reports if it does."""
        if self.reported_output_tokens is not None:
            return int(self.reported_output_tokens)
        return sum(self.chunk_tokens)


@dataclass
class LoadPoint:
    """One point of a sweep: closed loop at `concurrency`, or open loop at `rate`."""

    mode: str  # "closed" | "open"
    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.mode == "closed":
            return f"c={self.concurrency}"
        rate = "inf" if math.isinf(self.x) else f"{self.x:g}"
        return f"rate={rate}/s"

    @property
    def x(self) -> float:
        """The load value plotted on x axes (concurrency or requests/s)."""
        value = self.concurrency if self.mode == "closed" else self.rate
        if value is None:
            raise ValueError(
                f"a {self.mode} load point without its {'concurrency' if self.mode == 'closed' else 'rate'}"
            )
        return float(value)


@dataclass
class PointResult:
    load: LoadPoint
    records: list[RequestRecord]
    t_start: float
    t_end: float
    # CPU time (user + sys) / wall time of each client process over this point (procs.py)
    client_cpu: list[float] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return max(self.t_end - self.t_start, 1e-9)


async def execute(
    stub: generate_pb2_grpc.GenerationStub, spec: RequestSpec, rec: RequestRecord, timeout: float
) -> None:
    """Sends one request and fills `rec` with what its stream showed."""
    call = None
    rec.start = time.perf_counter()
    try:
        metadata = (("traceparent", rec.traceparent),) if rec.traceparent else None
        call = stub.Generate(spec.to_proto(rec.request_id), timeout=timeout, metadata=metadata)
        async for msg in call:
            now = time.perf_counter()
            if msg.token_ids:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(len(msg.token_ids))
                rec.applied_k.append(msg.applied_k)
            u = msg.usage
            rec.prompt_tokens, rec.draft_tokens = u.prompt_tokens, u.draft_tokens
            rec.accepted_tokens, rec.verify_steps = u.accepted_tokens, u.verify_steps
            if msg.finish_reason:
                rec.finish_reason = generate_pb2.FinishReason.Name(msg.finish_reason)
        if not rec.finish_reason:
            rec.error, rec.error_detail = INCOMPLETE, "stream ended without finish_reason"
    except grpc.aio.AioRpcError as e:
        rec.error, rec.error_detail = e.code().name, e.details() or ""
    except asyncio.CancelledError:
        rec.cancelled = True
        if call is not None:
            call.cancel()
        raise
    finally:
        rec.end = time.perf_counter()


def new_traceparent(rng: random.Random) -> str:
    """A sampled W3C `traceparent` (version 00, flags 01) of a new trace, rooted at the client."""
    return f"00-{rng.getrandbits(128) or 1:032x}-{rng.getrandbits(64) or 1:016x}-01"


class Runner:
    """Runs load points against one Generation stub (or another backend: `execute(stub, spec,
    rec, timeout)` sends one request); `on_record` is called per finished request."""

    def __init__(
        self,
        stub: Any,  # a generate_pb2_grpc.GenerationStub, or the backend object `execute` takes
        timeout: float,
        drain_timeout: float,
        on_record: Callable[[RequestRecord], None] | None = None,
        on_send: Callable[[], None] | None = None,
        execute: Callable[[Any, RequestSpec, RequestRecord, float], Awaitable[None]] = execute,
        trace_ratio: float = 0.0,
        seed: int = 0,
        trace_slot_s: float | None = None,
    ):
        """`trace_ratio`: the share of requests sent with a sampled `traceparent` of a new trace
        (chosen by a generator seeded with `seed`), so the server traces them whatever its own
        sampling ratio; their trace ids are in the raw records. `trace_slot_s`: instead, every
        request started in an odd slot of that many seconds of the host's monotonic clock (shared by
        all client processes, so they switch together) is traced, and none in an even one: an A/B of
        tracing's cost in one run, each traced slot beside untraced ones."""
        self.stub, self.timeout, self.drain_timeout = stub, timeout, drain_timeout
        self.trace_ratio, self._trace_rng = trace_ratio, random.Random(seed)
        self.trace_slot_s = trace_slot_s
        self.execute = execute
        self.on_record = on_record or (lambda rec: None)
        self.on_send = on_send or (lambda: None)

    async def _one(self, spec: RequestSpec, rid: str, records: list[RequestRecord]) -> None:
        rec = RequestRecord(rid, spec.priority, spec.max_tokens, spec.input_len)
        if self.trace_slot_s is not None:
            if int(time.perf_counter() / self.trace_slot_s) % 2:
                rec.traceparent = new_traceparent(self._trace_rng)
        elif self.trace_ratio and self._trace_rng.random() < self.trace_ratio:
            rec.traceparent = new_traceparent(self._trace_rng)
        self.on_send()
        try:
            await self.execute(self.stub, spec, rec, self.timeout)
        finally:  # cancelled requests are recorded too, for the counts
            records.append(rec)
            self.on_record(rec)

    async def run(
        self,
        load: LoadPoint,
        requests: Iterator[RequestSpec],
        n: int | None,
        duration: float | None,
        prefix: str,
        seed: int = 0,
    ) -> PointResult:
        """Sends n requests (or for `duration` seconds) at `load`; waits for them to finish.

        In duration mode, requests still in flight `drain_timeout` seconds after the end are
        cancelled and counted as cancelled, so a run always ends."""
        records: list[RequestRecord] = []
        t0 = time.perf_counter()
        ids = (f"{prefix}-{i}" for i in itertools.count())
        if load.mode == "closed":
            tasks = self._closed(load, requests, n, duration, t0, ids, records)
        else:
            tasks = await self._open(load, requests, n, duration, t0, ids, records, seed)
        if tasks:
            wait = None if duration is None else max(0.0, t0 + duration - time.perf_counter())
            _, pending = await asyncio.wait(tasks, timeout=None if wait is None else wait + self.drain_timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        sent = [r.start for r in records if r.start] or [t0]
        ends = [r.end for r in records if r.end is not None] or [time.perf_counter()]
        return PointResult(load, records, min(sent), max(ends))

    def _closed(self, load, requests, n, duration, t0, ids, records) -> list[asyncio.Task]:
        # Exactly `concurrency` workers, each with at most one request in flight: the client can
        # never exceed the concurrency, and a finished request is replaced immediately.
        issued = itertools.count()

        async def worker():
            while True:
                if n is not None and next(issued) >= n:
                    return
                if duration is not None and time.perf_counter() - t0 >= duration:
                    return
                await self._one(next(requests), next(ids), records)

        return [asyncio.create_task(worker()) for _ in range(load.concurrency)]

    async def _open(self, load, requests, n, duration, t0, ids, records, seed):
        gaps = arrivals.gaps(load.rate, load.arrival, load.burstiness, seed)
        sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        tasks: list[asyncio.Task] = []
        due = t0
        for i in itertools.count():
            if n is not None and i >= n:
                break
            if i:
                due += next(gaps)
            if duration is not None and due - t0 >= duration:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                # A request waiting for a slot is sent late; its latency counts from the send.
                await sem.acquire()
                if duration is not None and time.perf_counter() - t0 >= duration:
                    sem.release()
                    break
            task = asyncio.create_task(self._one(next(requests), next(ids), records))
            if sem is not None:
                task.add_done_callback(lambda _t: sem.release())
            tasks.append(task)
        return tasks

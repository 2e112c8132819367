"""`--trace-ratio`: the loadgen sends a sampled W3C traceparent of a new trace with that share of its
requests (gRPC metadata; the HTTP header on the openai backend), and the raw records carry it."""

from __future__ import annotations

import asyncio
import re

import pytest

from verifypd.v1 import generate_pb2
from verifypd_loadgen import metrics
from verifypd_loadgen.cli import main
from verifypd_loadgen.runner import LoadPoint, Runner
from verifypd_loadgen.workload import Workload

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-01$")


class Stub:
    """A Generation stub that answers every request with one finished message and keeps the
    metadata each call carried."""

    def __init__(self):
        self.metadata: list = []

    def Generate(self, request, timeout=None, metadata=None):
        self.metadata.append(metadata)
        return _Answer(request.request_id)


class _Answer:
    def __init__(self, request_id: str):
        self.sent = False
        self.message = generate_pb2.GenerateResponse(
            request_id=request_id, token_ids=[5], finish_reason=generate_pb2.FinishReason.Value("FINISH_REASON_LENGTH")
        )

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.sent:
            raise StopAsyncIteration
        self.sent = True
        return self.message

    def cancel(self):
        pass


def run(ratio: float, n: int = 200, seed: int = 3):
    stub = Stub()
    runner = Runner(stub, timeout=5.0, drain_timeout=1.0, trace_ratio=ratio, seed=seed)
    workload = Workload(seed=0)
    point = asyncio.run(runner.run(LoadPoint("closed", concurrency=8), workload.requests(stream=1), n, None, "t"))
    return stub, point


def test_a_share_of_requests_carries_a_sampled_traceparent_of_its_own():
    stub, point = run(0.5)
    sent = [dict(m)["traceparent"] for m in stub.metadata if m]
    assert 70 <= len(sent) <= 130, len(sent)  # about half of 200
    assert all(TRACEPARENT.match(t) for t in sent), sent[:3]
    assert len({TRACEPARENT.match(t).group(1) for t in sent}) == len(sent)  # a new trace each
    records = metrics.records(point)
    assert sorted(r["traceparent"] for r in records if r["traceparent"]) == sorted(sent)


def test_no_traceparent_by_default_and_all_at_ratio_one():
    stub, _ = run(0.0)
    assert all(m is None for m in stub.metadata)
    stub, _ = run(1.0, n=50)
    assert all(m and TRACEPARENT.match(dict(m)["traceparent"]) for m in stub.metadata)


def test_trace_ratio_outside_zero_to_one_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--server", "127.0.0.1:1", "--trace-ratio", "1.5"])
    assert exc.value.code == 2
    assert "--trace-ratio" in capsys.readouterr().err


def test_trace_alternate_traces_the_requests_started_in_odd_slots(monkeypatch):
    """`--trace-alternate S`: the slot of the shared monotonic clock a request starts in decides."""
    import verifypd_loadgen.runner as runner_module

    clock = iter(i * 0.25 for i in range(10_000))  # each read a quarter second on: slots of 1 s
    starts: list[float] = []

    def perf_counter() -> float:
        t = next(clock)
        starts.append(t)
        return t

    monkeypatch.setattr(runner_module.time, "perf_counter", perf_counter)
    stub = Stub()
    runner = Runner(stub, timeout=5.0, drain_timeout=1.0, trace_slot_s=1.0)
    point = asyncio.run(
        runner.run(LoadPoint("closed", concurrency=1), Workload(seed=0).requests(stream=1), 40, None, "t")
    )
    traced = [r.traceparent != "" for r in sorted(point.records, key=lambda r: r.start)]
    assert any(traced) and not all(traced)
    # The decision is read at each request's send, before execute stamps its start: its slot's parity.
    decided = [bool(int((r.start - 0.25) / 1.0) % 2) for r in sorted(point.records, key=lambda r: r.start)]
    assert traced == decided


def test_trace_alternate_with_trace_ratio_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--server", "127.0.0.1:1", "--trace-alternate", "2", "--trace-ratio", "0.5"])
    assert exc.value.code == 2
    assert "--trace-alternate" in capsys.readouterr().err

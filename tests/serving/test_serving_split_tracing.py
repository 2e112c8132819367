"""Traces across processes in the `split` topology (CPU, three lane processes): one request's
trace holds the gateway's span, the core's, the router's span of every lane call (CLIENT) and the
lane process's span of the same call (SERVER, its own service), each below the right parent.
The context reaches the lanes with each call (LaneCall.traceparent on the call channel); the
lanes export to the OTLP endpoint they inherit from the environment, as under `serve`."""

from __future__ import annotations

import pytest
from otlp_receiver import start_receiver
from services_helpers import Client, engine_options, greedy_request, wait_until

from verifypd.v1 import generate_pb2

pytestmark = pytest.mark.slow  # lane processes (tests/README.md)

LANES = ("prefill", "draft", "verify")


@pytest.fixture(scope="module")
def traced_split(tiny_models):
    from verifypd.core.telemetry import Telemetry
    from verifypd.core.tracing import RequestTracing, gateway_spans
    from verifypd.gateway.server import build_split
    from verifypd.lanes.processes import LaneProcesses
    from verifypd.net.trace_context import make_tracing

    receiver, server, port = start_receiver()
    env = pytest.MonkeyPatch()
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}")  # the lanes inherit it
    env.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: export soon after a span ends
    procs = LaneProcesses(engine_options(*tiny_models))
    procs.start(timeout_s=120)
    telemetry = Telemetry()
    gw = None
    try:
        gw = build_split(procs.addrs, engine_options(*tiny_models), observer=telemetry, lane_secret=procs.secret)
        # What `verifypd serve --topology split` does in its processes (launch/cli.py, core/process.py).
        gw.client.spans = gateway_spans("verifypd-gateway")
        tracing = RequestTracing(make_tracing("verifypd-core"))
        telemetry.tracing = gw.core.tracing = tracing
        tracing.trace_lane_calls(gw.lanes)
        gw.start()
        yield gw, receiver
    finally:
        if gw is not None:
            gw.stop()
        procs.terminate()
        env.undo()
        server.stop(0)


def test_one_request_traced_through_gateway_core_and_lane_processes(traced_split):
    gw, receiver = traced_split
    trace_id, caller = "5bf92f3577b34da6a3ce929d0e0e4737", "c7ad6b7169203332"
    prompt, max_tokens = [5, 6, 7, 8, 9], 6
    client = Client(gw.address)
    try:
        msgs = list(
            client.gen.Generate(
                generate_pb2.GenerateRequest(**greedy_request(prompt, max_tokens)),
                metadata=(("traceparent", f"00-{trace_id}-{caller}-01"),),
                timeout=60,
            )
        )
    finally:
        client.close()
    assert msgs[-1].finish_reason

    def by(service: str, name: str) -> list[dict]:
        return [s for s in receiver.of_trace(trace_id).get(name, []) if s["service"] == service]

    def complete() -> bool:  # every lane call's span from both sides has arrived
        lanes = [
            (by("verifypd-core", f"verifypd.lane.{n}"), by(f"verifypd-lane-{n}", f"verifypd.lane.{n}")) for n in LANES
        ]
        # each process ships its spans on its own (span_ship: every 200 ms): the gateway's come apart
        return (
            bool(by("verifypd-gateway", "verifypd.generate"))
            and bool(by("verifypd-core", "verifypd.core.request"))
            and all(c and len(c) == len(s) for c, s in lanes)
        )

    assert wait_until(complete, 30), {n: len(v) for n, v in receiver.of_trace(trace_id).items()}
    (gen,) = by("verifypd-gateway", "verifypd.generate")
    (core,) = by("verifypd-core", "verifypd.core.request")
    assert gen["parent"] == caller and core["parent"] == gen["id"]
    slack = 5_000_000  # ns: clocks of processes on one host
    for lane in LANES:
        name = f"verifypd.lane.{lane}"
        calls = {s["id"]: s for s in by("verifypd-core", name)}
        served = by(f"verifypd-lane-{lane}", name)
        assert all(c["parent"] == core["id"] for c in calls.values()), lane  # below the request's core span
        assert sorted(s["parent"] for s in served) == sorted(calls), lane  # one lane span per call, below it
        for s in served:
            c = calls[s["parent"]]
            assert c["start"] - slack <= s["start"] <= s["end"] <= c["end"] + slack, lane
            for key in ("verifypd.batch.size", "verifypd.lane.tokens"):
                assert s["attrs"][key].int_value == c["attrs"][key].int_value >= 1, (lane, key)
    (prefill,) = by("verifypd-lane-prefill", "verifypd.lane.prefill")  # one chunk: the whole prompt
    assert prefill["attrs"]["verifypd.lane.tokens"].int_value == len(prompt)
    verify = by("verifypd-lane-verify", "verifypd.lane.verify")
    assert all(
        s["attrs"]["verifypd.lane.k_max"].int_value >= 1 for s in by("verifypd-lane-draft", "verifypd.lane.draft")
    )
    # Positions verified: each call's drafts + the pending token; together at least the tokens emitted after the first.
    assert sum(s["attrs"]["verifypd.lane.tokens"].int_value for s in verify) >= max_tokens - 1


def test_a_request_without_a_sampled_trace_sends_no_context(traced_split):
    """traceparent with the sampled flag off: no core span, no lane spans, on either side."""
    gw, receiver = traced_split
    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    client = Client(gw.address)
    try:
        list(
            client.gen.Generate(
                generate_pb2.GenerateRequest(**greedy_request([5, 6], 4)),
                metadata=(("traceparent", f"00-{trace_id}-d7ad6b7169203333-00"),),
                timeout=60,
            )
        )
        # A sampled request after it: once its spans are in, the unsampled one's would be too.
        marker = "7bf92f3577b34da6a3ce929d0e0e4739"
        list(
            client.gen.Generate(
                generate_pb2.GenerateRequest(**greedy_request([5, 6], 4)),
                metadata=(("traceparent", f"00-{marker}-e7ad6b7169203334-01"),),
                timeout=60,
            )
        )
    finally:
        client.close()

    def services(trace_id: str) -> set[str]:
        return {s["service"] for spans in receiver.of_trace(trace_id).values() for s in spans}

    assert wait_until(lambda: {f"verifypd-lane-{n}" for n in LANES} <= services(marker), 30)
    assert receiver.of_trace(trace_id) == {}

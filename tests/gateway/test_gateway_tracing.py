"""OpenTelemetry traces of real requests (tiny models, CPU, colocated), exported over OTLP/gRPC
(the SDK's exporter, configured by OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as `verifypd serve` reads it) to
an in-process OTLP TraceService receiver: one request's spans cover the gateway, the engine
core (queue, prefill, decode) and the lane calls, all in the caller's trace (`traceparent` over
HTTP or gRPC metadata), each below the right parent, with times that nest."""

from __future__ import annotations

import httpx
import pytest
from http_helpers import MODEL, HttpGateway
from otlp_receiver import Receiver, start_receiver
from services_helpers import Client, greedy_request, wait_until

from verifypd.v1 import generate_pb2

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(chat_models):
    from verifypd.core.tracing import RequestTracing, gateway_spans
    from verifypd.net.trace_context import make_tracing

    receiver, server, port = start_receiver()
    env = pytest.MonkeyPatch()
    # Traces only: other tests' metric providers in this process must not export here.
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}")
    env.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: export soon after a span ends
    gw = HttpGateway(chat_models)
    # What `verifypd serve` does in its two processes (launch/cli.py, core/process.py).
    gw.gw.client.spans = gateway_spans("verifypd-gateway")
    tracing = RequestTracing(make_tracing("verifypd-core"))
    gw.telemetry.tracing = gw.gw.core.tracing = tracing
    yield gw, receiver
    gw.stop()
    env.undo()
    server.stop(0)


CORE = ("verifypd.core.request", "verifypd.queue", "verifypd.prefill", "verifypd.decode")
LANES = ("verifypd.lane.prefill", "verifypd.lane.draft", "verifypd.lane.verify")


def check_one_trace(receiver: Receiver, trace_id: str, max_tokens: int, parent: str | None) -> None:
    want = ("verifypd.generate", *CORE, *LANES)
    assert wait_until(lambda: all(n in receiver.of_trace(trace_id) for n in want), 30), receiver.of_trace(trace_id)
    spans = receiver.of_trace(trace_id)
    (gen,) = spans["verifypd.generate"]
    (core,) = spans["verifypd.core.request"]
    assert gen["service"] == "verifypd-gateway" and core["service"] == "verifypd-core"
    if parent is not None:
        assert gen["parent"] == parent  # continues the caller's span
    assert core["parent"] == gen["id"]
    for name in CORE[1:]:
        (s,) = spans[name]
        assert s["parent"] == core["id"], name
    for name in LANES:  # the lane calls of the request's steps, below its core span
        assert all(s["parent"] == core["id"] and s["attrs"]["verifypd.batch.size"].int_value >= 1 for s in spans[name])
    decode = spans["verifypd.decode"][0]
    assert decode["attrs"]["verifypd.output_tokens"].int_value == max_tokens
    assert gen["attrs"]["gen_ai.usage.output_tokens"].int_value == max_tokens
    # Times nest (the core's monotonic times converted to epoch ns; 5 ms of slack).
    slack = 5_000_000
    q, p, d = (spans[n][0] for n in ("verifypd.queue", "verifypd.prefill", "verifypd.decode"))
    assert q["start"] <= p["start"] <= d["start"] <= d["end"] <= core["end"] + slack
    assert gen["start"] - slack <= core["start"] and core["end"] <= gen["end"] + slack


def test_http_request_continues_the_callers_trace(traced):
    gw, receiver = traced
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "stream": True}
    r = httpx.post(
        gw.url + "/v1/completions", json=body, headers={"traceparent": f"00-{TRACE}-{PARENT}-01"}, timeout=60
    )
    assert r.status_code == 200
    check_one_trace(receiver, TRACE, 6, PARENT)


def test_grpc_request_continues_the_callers_trace(traced):
    gw, receiver = traced
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    client = Client(gw.gw.address)
    try:
        msgs = list(
            client.gen.Generate(
                generate_pb2.GenerateRequest(**greedy_request([5, 6], 5)),
                metadata=(("traceparent", f"00-{trace_id}-b7ad6b7169203331-01"),),
                timeout=60,
            )
        )
    finally:
        client.close()
    assert msgs[-1].finish_reason
    check_one_trace(receiver, trace_id, 5, "b7ad6b7169203331")


def test_a_request_without_traceparent_gets_a_trace_of_its_own(traced):
    gw, receiver = traced
    before = {s["trace"] for s in receiver.spans}
    body = {"model": MODEL, "prompt": [9, 8], "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(gw.url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert wait_until(
        lambda: any(s["name"] == "verifypd.generate" and s["trace"] not in before for s in receiver.spans), 30
    )
    (new,) = {s["trace"] for s in receiver.spans if s["name"] == "verifypd.generate"} - before
    check_one_trace(receiver, new, 4, None)


def test_access_log_lines_carry_request_and_trace_ids_as_json(traced, caplog):
    """`serve --access-log --log-format json`: one verifypd.access line per request, its fields
    (request id, trace id, outcome, tokens) as JSON keys; off by default."""
    import json
    import logging

    from verifypd.domain.logs import JsonFormatter

    gw, _ = traced
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 3, "ignore_eos": True}
    headers = {"traceparent": f"00-{'ab' * 16}-{PARENT}-01"}
    with caplog.at_level(logging.INFO, logger="verifypd.access"):
        assert httpx.post(gw.url + "/v1/completions", json=body, headers=headers, timeout=60).status_code == 200
        assert not [r for r in caplog.records if r.name == "verifypd.access"]  # off by default
        gw.gw.client.access_log = True
        try:
            r = httpx.post(gw.url + "/v1/completions", json=body, headers=headers, timeout=60)
        finally:
            gw.gw.client.access_log = False
    (record,) = [r for r in caplog.records if r.name == "verifypd.access"]
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == r.json()["id"] and line["trace_id"] == "ab" * 16
    assert line["api"] == "http" and line["outcome"] == "length" and line["output_tokens"] == 3
    assert line["prompt_tokens"] == 2 and line["duration_ms"] > 0 and line["logger"] == "verifypd.access"


def test_log_format_json_from_the_environment(tmp_path):
    """The engine core and the lanes read $VERIFYPD_LOG_FORMAT (serve --log-format sets it)."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import logging; from verifypd.domain.logs import setup_logging; setup_logging(); "
        "logging.getLogger('verifypd.lanes').error('lane %s exited', 'draft', extra={'lane': 'draft', 'reason': 'x'})"
    )
    env = dict(os.environ, VERIFYPD_LOG_FORMAT="json")
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stderr
    line = json.loads(err.strip().splitlines()[-1])
    assert line["msg"] == "lane draft exited" and line["lane"] == "draft" and line["reason"] == "x"
    assert line["level"] == "ERROR" and line["ts"].endswith("+00:00")

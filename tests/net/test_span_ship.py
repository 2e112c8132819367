"""Spans leave a process as plain records and are exported by its exporter process
(net/span_ship.py, net/span_export.py): what a record says arrives over OTLP exactly (ids,
parent, kind, times, attributes of each type, status, events, the service name); a full queue
drops and counts; a dead exporter process stops tracing, never the caller; the traceparent
parser agrees with the OTel propagator; `--trace-sample-ratio`'s environment samples roots by
ratio and follows a sampled parent."""

from __future__ import annotations

import logging

import pytest
from otlp_receiver import start_receiver
from services_helpers import wait_until

from verifypd.net import span_ship
from verifypd.net.trace_context import context_of, make_tracing, parse_traceparent, sample_ratio_env

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736


@pytest.fixture
def receiver(monkeypatch):
    receiver, server, port = start_receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: the exporter process exports soon
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    yield receiver
    server.stop(0)


def test_a_record_arrives_over_otlp_as_written(receiver):
    records = span_ship.SpanRecords.start("verifypd-test")
    try:
        attrs = {"i": 7, "f": 0.25, "b": True, "s": "x", "l": ["stop"]}
        records.write(("root", TRACE, 0x11, 0, 1, 1_000, 9_000, {}, 0, "", ()))
        records.write(("child", TRACE, 0x22, 0x11, 2, 2_000, 3_000, attrs, 2, "lane lost", (("retry", 2_500, {}),)))
        assert wait_until(lambda: len(receiver.spans) == 2, 30), receiver.spans
    finally:
        records.close()
    spans = {s["name"]: s for s in receiver.spans}
    root, child = spans["root"], spans["child"]
    assert root["service"] == child["service"] == "verifypd-test"
    assert root["trace"] == child["trace"] == f"{TRACE:032x}"
    assert (root["id"], root["parent"]) == (f"{0x11:016x}", "")
    assert (child["id"], child["parent"]) == (f"{0x22:016x}", root["id"])
    assert (root["start"], root["end"], child["start"], child["end"]) == (1_000, 9_000, 2_000, 3_000)
    assert (root["kind"], child["kind"]) == (2, 3)  # SERVER, CLIENT (OTLP numbers the enum from 1)
    assert (root["status"], child["status"]) == (0, 2)  # UNSET, ERROR
    assert child["events"] == [("retry", 2_500)]
    a = child["attrs"]
    assert (a["i"].int_value, a["f"].double_value, a["b"].bool_value, a["s"].string_value) == (7, 0.25, True, "x")
    assert [v.string_value for v in a["l"].array_value.values] == ["stop"]


def test_sdk_spans_ship_through_the_same_records(receiver):
    tracing = make_tracing("verifypd-gateway")
    assert tracing is not None
    try:
        span = tracing.tracer.start_span("verifypd.generate", attributes={"verifypd.api": "grpc"})
        span.end()
        assert wait_until(lambda: any(s["name"] == "verifypd.generate" for s in receiver.spans), 30)
    finally:
        tracing.close()
    (s,) = receiver.spans
    assert s["service"] == "verifypd-gateway" and s["attrs"]["verifypd.api"].string_value == "grpc"
    assert s["id"] == f"{span.get_span_context().span_id:016x}"


class _Stream:
    def __init__(self, fail: bool = False):
        self.fail, self.data = fail, b""

    def write(self, data: bytes) -> None:
        if self.fail:
            raise BrokenPipeError("exporter gone")
        self.data += data

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_full_queue_drops_and_counts(monkeypatch):
    monkeypatch.setattr(span_ship, "MAX_PENDING", 3)
    stream = _Stream()
    records = span_ship.SpanRecords("t", stream, flush_s=60.0)
    for i in range(5):
        records.write(("s", TRACE, i + 1, 0, 0, 1, 2, {}, 0, "", ()))
    assert records.dropped == 2
    records.flush()
    assert records.sent == 3 and span_ship.FRAME.unpack(stream.data[:4])[0] == len(stream.data) - 4
    records.close()


def test_a_dead_exporter_stops_tracing_not_the_caller(caplog):
    records = span_ship.SpanRecords("t", _Stream(fail=True), flush_s=60.0)
    records.write(("s", TRACE, 1, 0, 0, 1, 2, {}, 0, "", ()))
    with caplog.at_level(logging.WARNING, logger="verifypd.tracing"):
        records.flush()
    records.write(("s", TRACE, 2, 0, 0, 1, 2, {}, 0, "", ()))
    records.flush()
    assert records.dropped == 2 and records.sent == 0
    assert any("spans are dropped" in r.getMessage() for r in caplog.records)
    records.close()


@pytest.mark.parametrize(
    "text",
    [
        f"00-{TRACE:032x}-00f067aa0ba902b7-01",
        f"00-{TRACE:032x}-00f067aa0ba902b7-00",
        f"01-{TRACE:032x}-00f067aa0ba902b7-01-future",
        f"00-{TRACE:032x}-00f067aa0ba902b7-01-extra",
        f"ff-{TRACE:032x}-00f067aa0ba902b7-01",
        f"00-{0:032x}-00f067aa0ba902b7-01",
        f"00-{TRACE:032x}-0000000000000000-01",
        f"00-{TRACE:032X}-00f067aa0ba902b7-01",
        f"00-{TRACE:032x}-00f067aa0ba902b7-0g",
        f"00_{TRACE:032x}-00f067aa0ba902b7-01",
        f"  00-{TRACE:032x}-00f067aa0ba902b7-01 ",
        "00-abc-def-01",
        "",
    ],
)
def test_traceparent_parser_agrees_with_the_propagator(text):
    from opentelemetry import trace

    ctx = context_of(text)
    want = None
    if ctx is not None:
        sc = trace.get_current_span(ctx).get_span_context()
        want = (sc.trace_id, sc.span_id, sc.trace_flags.sampled)
    assert parse_traceparent(text) == want


def test_sample_ratio_env_samples_roots_by_ratio_and_follows_a_parent(receiver, monkeypatch):
    for key, value in sample_ratio_env(0.0).items():
        monkeypatch.setenv(key, value)
    tracing = make_tracing("verifypd-gateway")
    assert tracing is not None
    try:
        root = tracing.tracer.start_span("root")
        child = tracing.tracer.start_span("child", context=context_of(f"00-{TRACE:032x}-00f067aa0ba902b7-01"))
        assert not root.get_span_context().trace_flags.sampled
        assert child.get_span_context().trace_flags.sampled
    finally:
        tracing.close()


def test_a_record_json_cannot_hold_costs_its_frame_only(caplog):
    stream = _Stream()
    records = span_ship.SpanRecords("t", stream, flush_s=60.0)
    records.write(("s", TRACE, 1, 0, 0, 1, 2, {"bad": object()}, 0, "", ()))
    with caplog.at_level(logging.WARNING, logger="verifypd.tracing"):
        records.flush()
    records.write(("s", TRACE, 2, 0, 0, 1, 2, {}, 0, "", ()))
    records.flush()
    assert (records.dropped, records.sent) == (1, 1)
    records.close()

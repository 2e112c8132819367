"""An OTLP endpoint named in the environment with no importable OTLP exporter (a partial install)
turns tracing off with one warning instead of failing the process at startup."""

from __future__ import annotations

import logging
import sys

from verifypd.net.trace_context import make_tracer

EXPORTER = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"


def test_missing_exporter_turns_tracing_off_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, EXPORTER, None)  # `import` of it now raises ImportError
    with caplog.at_level(logging.WARNING, logger="verifypd.tracing"):
        assert make_tracer("verifypd-core") is None
    assert any("tracing off in verifypd-core" in r.getMessage() for r in caplog.records)


def test_importable_exporter_makes_a_tracer(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9")
    assert make_tracer("verifypd-core") is not None

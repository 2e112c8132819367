"""Finished spans leave a serving process as plain records, exported by a child process.

Why: the SDK's BatchSpanProcessor encodes protobuf and calls gRPC in a thread of the process that
made the spans. In the engine core that thread takes the interpreter lock from the loop thread
for milliseconds at a time (each GIL hand-back waits out the switch interval), and the SDK's own
span objects cost ~40 us each to start and end: together ~14 % of a simulated 1.7 ms step loop
(bench/serving/tracing_core_loop.py), which is what tracing cost `serve` at c = 64 on an H200.

Here the hot side only appends a tuple per finished span (`SpanRecords.write`, ~1 us); a flusher
thread hands the pending records every FLUSH_S to the exporter process as one length-prefixed
JSON frame on its stdin (one short lock hold, then a write that releases the lock). The exporter
(net/span_export.py) rebuilds the spans and exports them with the SDK's BatchSpanProcessor and
OTLP exporter, so every OTEL_EXPORTER_OTLP_* and OTEL_BSP_* variable means what it always does.

Record (a tuple, JSON array on the wire): (name, trace id, span id, parent span id (0: a root),
kind (SpanKind value), start ns, end ns, attributes dict, status code (StatusCode value), status
description, events ((name, time ns, attributes), ...)). Ids are ints; times are epoch ns.
At most MAX_PENDING records wait; beyond that a span is dropped and counted (`dropped`), as the
SDK's queue does. The exporter process exits when this side closes its stdin (or dies).
"""

from __future__ import annotations

import json
import logging
import os
import random
import struct
import subprocess
import sys
import threading
import time

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

log = logging.getLogger("verifypd.tracing")
FLUSH_S = 0.2  # short: each flush holds the interpreter lock for well under a millisecond
MAX_PENDING = 65536
FRAME = struct.Struct("<I")  # a frame: its JSON length (little-endian u32), then the JSON
FRAME_RECORDS = 128  # records per frame: its encoding holds the interpreter lock ~0.3 ms


def new_id() -> int:
    """A random non-zero 64-bit span id."""
    return random.getrandbits(64) or 1


def new_trace_id() -> int:
    """A random non-zero 128-bit trace id."""
    return random.getrandbits(128) or 1


class SpanRecords:
    """One process's finished spans on their way to its exporter process (`start`)."""

    def __init__(self, service_name: str, stream, proc: subprocess.Popen | None = None, flush_s: float = FLUSH_S):
        self.service_name, self.proc, self.flush_s = service_name, proc, flush_s
        self.dropped = 0
        self.sent = 0
        self._stream = stream  # a binary file: the exporter's stdin
        self._pending: list[tuple] = []
        self._closed = threading.Event()
        self._lock = threading.Lock()  # the flusher and close() write frames, one at a time
        self._thread = threading.Thread(target=self._run, name="span-records", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, service_name: str) -> SpanRecords:
        """Starts the exporter process (it inherits this environment: the OTLP endpoint, sampler, BSP)."""
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # has verifypd/
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "verifypd.net.span_export", service_name],
            stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},  # this verifypd, wherever the child starts
        )
        return cls(service_name, proc.stdin, proc)

    def write(self, record: tuple) -> None:
        """Any thread; `record` as the module doc says."""
        if len(self._pending) < MAX_PENDING:
            self._pending.append(record)
        else:
            self.dropped += 1

    def _run(self) -> None:
        while not self._closed.wait(self.flush_s):
            self.flush()

    def flush(self) -> None:
        # The swap needs no lock: an append racing it lands in the list taken here or the new one.
        batch, self._pending = self._pending, []
        for i in range(0, len(batch), FRAME_RECORDS):  # one short lock hold per frame
            self._send(batch[i : i + FRAME_RECORDS])

    def _send(self, records: list[tuple]) -> None:
        try:
            data = json.dumps(records, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:  # an attribute JSON can't hold: this frame only is lost
            log.warning("spans of %s dropped: %s", self.service_name, exc)
            self.dropped += len(records)
            return
        with self._lock:
            if self._stream is None:
                self.dropped += len(records)
                return
            try:
                self._stream.write(FRAME.pack(len(data)) + data)
                self._stream.flush()
                self.sent += len(records)
            except (OSError, ValueError) as exc:  # the exporter process is gone: tracing stops, serving goes on
                log.warning("span exporter of %s is gone (%s): spans are dropped from now on", self.service_name, exc)
                self._stream = None
                self.dropped += len(records)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ships what is pending and lets the exporter export it and exit."""
        self._closed.set()
        self._thread.join(timeout_s)
        self.flush()
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def record_of(span: ReadableSpan) -> tuple:
    """An SDK span as a record (the gateway's and the lanes' spans, made with the SDK's tracer)."""
    ctx, parent, status = span.context, span.parent, span.status
    events = tuple((e.name, e.timestamp, dict(e.attributes or {})) for e in span.events)
    return (
        span.name,
        ctx.trace_id,
        ctx.span_id,
        parent.span_id if parent is not None else 0,
        span.kind.value,
        span.start_time,
        span.end_time if span.end_time is not None else time.time_ns(),
        dict(span.attributes or {}),
        status.status_code.value,
        status.description or "",
        events,
    )


class ShippingSpanProcessor(SpanProcessor):
    """The SDK tracer's processor: each ended span becomes a record."""

    def __init__(self, records: SpanRecords):
        self.records = records

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self.records.write(record_of(span))

    def shutdown(self) -> None:
        self.records.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.records.flush()
        return True

"""An in-process OTLP/gRPC TraceService receiver for tests: keeps every exported span."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span as a dict: service, name, trace/span/parent ids (hex), times,
    attributes, kind, status code, events."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            {
                                "service": service,
                                "name": s.name,
                                "trace": s.trace_id.hex(),
                                "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "start": s.start_time_unix_nano,
                                "end": s.end_time_unix_nano,
                                "attrs": {a.key: a.value for a in s.attributes},
                                "kind": s.kind,  # the OTLP enum: SPAN_KIND_INTERNAL = 1, SERVER = 2, CLIENT = 3
                                "status": s.status.code,  # STATUS_CODE_UNSET = 0, OK = 1, ERROR = 2
                                "events": [(e.name, e.time_unix_nano) for e in s.events],
                            }
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> dict[str, list[dict]]:
        with self.lock:
            out: dict[str, list[dict]] = {}
            for s in self.spans:
                if s["trace"] == trace_id:
                    out.setdefault(s["name"], []).append(s)
            return out


def start_receiver() -> tuple[Receiver, grpc.Server, int]:
    """(receiver, its started gRPC server, port on 127.0.0.1); stop the server when done."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return receiver, server, port

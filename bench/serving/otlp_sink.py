"""An OTLP/gRPC TraceService receiver in a process of its own, niced to 19, for the tracing
benches: it counts spans and keeps nothing. Its own process and the lowest priority so that its
decoding (the bench's cost, not the product's) takes no core from the server it measures.

    sink = OtlpSink()          # started; sink.port
    sink.spans()               # spans received so far
    sink.stop()
"""

from __future__ import annotations

import subprocess
import sys

SOURCE = """
import os, sys
from concurrent import futures
import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb, trace_service_pb2_grpc as rpc
os.nice(19)
n = [0]
class Sink(rpc.TraceServiceServicer):
    def Export(self, request, context):
        n[0] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return pb.ExportTraceServiceResponse()
server = grpc.server(futures.ThreadPoolExecutor(1))
rpc.add_TraceServiceServicer_to_server(Sink(), server)
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
for line in sys.stdin:  # a line in: the count out
    print(n[0], flush=True)
"""


class OtlpSink:
    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SOURCE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout
        self.port = int(self._out.readline())

    def spans(self) -> int:
        self._in.write("\n")
        self._in.flush()
        return int(self._out.readline())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)

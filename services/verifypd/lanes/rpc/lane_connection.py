"""A lane client's gRPC connection, the router's end of one lane process. Torch-free.

The channel reconnects quickly to a restarted lane and, with lane TLS, is replaced once the certificate
files rotate. Unary calls (setup, and work calls without the call channel) turn every failure into
`LaneError` and count their serialized bytes; health checks say SERVING, SLOW or DOWN; Describe is
cached. The lane clients (lane_client.py) add the work calls and the call channel on top.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from verifypd.domain.lanes import LaneError, LaneInfo
from verifypd.lanes.rpc import lane_convert as lc
from verifypd.net.auth import lane_metadata
from verifypd.net.lane_tls import LaneChannel
from verifypd.net.trace_context import TRACEPARENT
from verifypd.v1 import lanes_pb2

# Reconnect quickly to a restarted lane (gRPC's default back-off grows to 120 s).
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 512 << 20),
    ("grpc.max_receive_message_length", 512 << 20),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# What one health check of a lane says (`LaneConnection.probe`).
SERVING, SLOW, DOWN = "serving", "slow", "down"
SERVICE_NAMES = {
    "prefill": "verifypd.v1.PrefillLane",
    "draft": "verifypd.v1.DraftLane",
    "verify": "verifypd.v1.VerifyLane",
}


class LaneConnection:
    """The gRPC side of one lane client (GrpcPrefillLane, GrpcDraftLane, GrpcVerifyLane subclass it)."""

    lane = ""  # "prefill" | "draft" | "verify", set by each lane client
    stub_class: Callable[[grpc.Channel], Any]  # the lane's gRPC stub (lanes_pb2_grpc), set by each lane client

    def __init__(self, addr: str, timeout_s: float = 60.0, secret: str | None = None, tls=None):
        """`tls`: a verifypd.net.lane_tls.LaneTls (mutual TLS), or None."""
        self.addr = addr
        self.tls = tls
        self.timeout_s = timeout_s
        self.secret = secret
        self._metadata = lane_metadata(secret)  # the lane secret, on every call but health
        self._lane_channel = LaneChannel(addr, tls, GRPC_OPTIONS)
        self._bind_stubs()
        self._info_pb: lanes_pb2.LaneInfo | None = None
        self._lock = threading.Lock()
        self.wire_bytes = 0  # serialized request + reply bytes of every lane call
        self.calls = 0

    def _bind_stubs(self) -> None:
        self.channel = self._lane_channel.channel
        self.stub = self.stub_class(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _fresh_channel(self) -> None:
        """With TLS: a new channel once the certificate files changed (rotation); see LaneChannel."""
        if self._lane_channel.refresh():
            self._bind_stubs()

    def rpc(self, method: str, request, timeout_s: float | None = None, traceparent: str | None = None):
        """A unary gRPC call to the lane (setup, and work calls without the call channel);
        `traceparent`: the work call's span context, sent as metadata."""
        self._fresh_channel()
        metadata = self._metadata if traceparent is None else (*self._metadata, (TRACEPARENT, traceparent))
        try:
            reply = getattr(self.stub, method)(request, timeout=timeout_s or self.timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise LaneError(
                f"{self.lane} lane at {self.addr}: {method} failed: {exc.code().name}: {exc.details()}"
            ) from None
        self.count(request.ByteSize() + reply.ByteSize())
        return reply

    def count(self, nbytes: int) -> None:
        """Counts one lane call that moved `nbytes` serialized bytes (request + reply)."""
        with self._lock:
            self.wire_bytes += nbytes
            self.calls += 1

    # -- setup -------------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Blocks until the lane's health says SERVING (raises LaneError on timeout; with TLS, one
        naming what the handshake said, e.g. an expired or foreign certificate)."""
        self._fresh_channel()
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
            status = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            if self.tls is not None:
                why = self.tls.diagnose(self.addr)
            else:
                why = (
                    f"{str(exc) or type(exc).__name__} (a lane that serves mutual TLS refuses plaintext: "
                    f"give --lane-tls-cert-file, --lane-tls-key-file and --lane-tls-ca-file)"
                )
            raise LaneError(f"{self.lane} lane at {self.addr} is not reachable: {why}") from None
        if status.status != health_pb2.HealthCheckResponse.SERVING:
            raise LaneError(f"{self.lane} lane at {self.addr} is not serving")

    def healthy(self, timeout_s: float = 2.0) -> bool:
        return self.probe(timeout_s) == SERVING

    def probe(self, timeout_s: float = 2.0) -> str:
        """One health check: SERVING; SLOW when it did not answer within `timeout_s` (a loaded host
        or a hung lane: only how long it lasts tells them apart, core/lane_watch.py decides); DOWN
        when the lane refused the connection or says NOT_SERVING (a dead or restarting process)."""
        self._fresh_channel()
        try:
            status = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as exc:
            return SLOW if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else DOWN
        return SERVING if status.status == health_pb2.HealthCheckResponse.SERVING else DOWN

    def describe_pb(self, refresh: bool = False) -> lanes_pb2.LaneInfo:
        if self._info_pb is None or refresh:
            self._info_pb = self.rpc("Describe", lanes_pb2.LaneInfoRequest())
        return self._info_pb

    def describe(self) -> LaneInfo:
        return lc.lane_info_from_pb(self.describe_pb())

    def import_pools(self, pools: list[lanes_pb2.PoolDescriptor], kv_transport: str) -> lanes_pb2.ImportPoolsReply:
        return self.rpc("ImportPools", lanes_pb2.ImportPoolsRequest(pools=pools, kv_transport=kv_transport))

    def close(self) -> None:
        self._lane_channel.close()

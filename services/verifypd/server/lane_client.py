"""The lane protocols over gRPC: `Router(GrpcPrefillLane(a), GrpcDraftLane(b), GrpcVerifyLane(c))`
cannot tell these from the in-process lanes. Torch-free (the gateway process of `split` never
touches tensors).

Every failure of a lane call (process gone, deadline, error status) becomes `LaneError`; the
gateway then ends in-flight requests with UNAVAILABLE. `wire_bytes` counts the serialized bytes of
every lane call (request + reply), so a test can prove that with handles no KV crossed gRPC.
"""
from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from verifypd.lanes.interface import (DraftItem, DraftOutput, LaneError, LaneInfo, PrefillItem, PrefillOutput,
                                      VerifyItem, VerifyOutput)
from verifypd.server import lane_convert as lc
from verifypd.server.auth import lane_metadata
from verifypd.v1 import lanes_pb2, lanes_pb2_grpc

# Reconnect quickly to a restarted lane (gRPC's default back-off grows to 120 s).
GRPC_OPTIONS = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20),
                ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000)]
SERVICE_NAMES = {"prefill": "verifypd.v1.PrefillLane", "draft": "verifypd.v1.DraftLane",
                 "verify": "verifypd.v1.VerifyLane"}


class _GrpcLane:
    lane = ""
    _stub_class = None

    def __init__(self, addr: str, timeout_s: float = 60.0, secret: str | None = None):
        self.addr = addr
        self.timeout_s = timeout_s
        self._metadata = lane_metadata(secret)  # the lane secret, on every call but health
        self.channel = grpc.insecure_channel(addr, options=GRPC_OPTIONS)
        self.stub = self._stub_class(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._info_pb: lanes_pb2.LaneInfo | None = None
        self._lock = threading.Lock()
        self.wire_bytes = 0   # serialized request + reply bytes of every lane call
        self.calls = 0

    def _call(self, method: str, request, timeout_s: float | None = None):
        try:
            reply = getattr(self.stub, method)(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise LaneError(f"{self.lane} lane at {self.addr}: {method} failed: "
                            f"{exc.code().name}: {exc.details()}") from None
        with self._lock:
            self.wire_bytes += request.ByteSize() + reply.ByteSize()
            self.calls += 1
        return reply

    # -- setup -------------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Blocks until the lane's health says SERVING (raises LaneError on timeout)."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
            status = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            raise LaneError(f"{self.lane} lane at {self.addr} is not reachable: {exc}") from None
        if status.status != health_pb2.HealthCheckResponse.SERVING:
            raise LaneError(f"{self.lane} lane at {self.addr} is not serving")

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            status = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return status.status == health_pb2.HealthCheckResponse.SERVING

    def describe_pb(self, refresh: bool = False) -> lanes_pb2.LaneInfo:
        if self._info_pb is None or refresh:
            self._info_pb = self._call("Describe", lanes_pb2.LaneInfoRequest())
        return self._info_pb

    def describe(self) -> LaneInfo:
        return lc.lane_info_from_pb(self.describe_pb())

    def import_pools(self, pools: list[lanes_pb2.PoolDescriptor], kv_transport: str) -> lanes_pb2.ImportPoolsReply:
        return self._call("ImportPools", lanes_pb2.ImportPoolsRequest(pools=pools, kv_transport=kv_transport))

    def close(self) -> None:
        self.channel.close()


class GrpcPrefillLane(_GrpcLane):
    lane = "prefill"
    _stub_class = lanes_pb2_grpc.PrefillLaneStub

    def __init__(self, addr: str, timeout_s: float = 60.0, secret: str | None = None):
        super().__init__(addr, timeout_s, secret)
        self.kv_bytes_copied = 0  # KV bytes the lane streamed to owners (copy transport)

    def prefill(self, items: list[PrefillItem]) -> list[PrefillOutput]:
        result = self._call("Prefill", lc.prefill_batch_to_pb(items))
        self.kv_bytes_copied += result.kv_bytes_copied
        return lc.prefill_outputs_from_pb(result)


class GrpcDraftLane(_GrpcLane):
    lane = "draft"
    _stub_class = lanes_pb2_grpc.DraftLaneStub

    def draft(self, items: list[DraftItem]) -> list[DraftOutput]:
        return lc.draft_outputs_from_pb(self._call("Draft", lc.draft_batch_to_pb(items)))


class GrpcVerifyLane(_GrpcLane):
    lane = "verify"
    _stub_class = lanes_pb2_grpc.VerifyLaneStub

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        def encode(probs, top_k):  # only when mixing an in-process draft lane with a remote verify
            from verifypd.server.kv_transport import encode_probs
            return encode_probs(probs, top_k)

        return lc.verify_outputs_from_pb(self._call("Verify", lc.verify_batch_to_pb(items, encode)))


def wire_pools(prefill: GrpcPrefillLane, draft: GrpcDraftLane, verify: GrpcVerifyLane,
               kv_transport: str = "auto") -> lanes_pb2.ImportPoolsReply:
    """The one-time pool exchange: tells the prefill lane about the owners' pools.

    The owners' KvTransfer addresses are the addresses we reach them at (only the wiring side
    knows them), used when a pool is copied rather than imported.
    """
    if kv_transport not in ("auto", "handle", "copy"):
        raise ValueError(f"kv_transport must be auto, handle or copy; got {kv_transport!r}")
    pools = []
    for owner in (verify, draft):
        for d in owner.describe_pb().pools:
            d = lanes_pb2.PoolDescriptor.FromString(d.SerializeToString())
            d.kv_transfer_addr = owner.addr
            pools.append(d)
    return prefill.import_pools(pools, kv_transport)

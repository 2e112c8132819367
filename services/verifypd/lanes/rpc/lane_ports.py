"""The ports of a lane process: `build_lane_server` serves a LaneServicer (lane_server.py) on a gRPC
port (its lane service, KvTransfer where it owns pools, health and reflection; the lane secret and
WireGuard on every RPC but health) and starts its call channel (call_channel.py) on a second port.
"""

from __future__ import annotations

from concurrent import futures

import grpc

from verifypd.lanes.rpc import call_decode as cd
from verifypd.lanes.rpc.call_channel import CallServer
from verifypd.lanes.rpc.lane_server import LaneServicer
from verifypd.net.auth import lane_interceptor
from verifypd.net.health import Health, add_health_and_reflection
from verifypd.net.limits import LANE_GRPC_OPTIONS
from verifypd.net.wire_guard import WireGuard
from verifypd.v1 import lanes_pb2_grpc


def build_lane_server(
    servicer: LaneServicer,
    host: str,
    port: int,
    call_port: int | None = 0,
) -> tuple[grpc.Server, int, Health]:
    """A started gRPC server for the lane; returns (server, bound port, health servicer).
    With a secret, every RPC but health must carry it (auth.py). Also starts the lane's call
    channel on `call_port` (0: any free port; None: no call channel, work calls over gRPC only);
    Describe announces its port. With `servicer.tls` both ports speak mutual TLS only."""
    interceptors = [lane_interceptor(servicer.secret)] if servicer.secret else []
    interceptors.append(WireGuard())  # garbage is INVALID_ARGUMENT, one rate-limited line
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8), options=LANE_GRPC_OPTIONS, interceptors=interceptors
    )
    adders = {
        "prefill": lanes_pb2_grpc.add_PrefillLaneServicer_to_server,
        "draft": lanes_pb2_grpc.add_DraftLaneServicer_to_server,
        "verify": lanes_pb2_grpc.add_VerifyLaneServicer_to_server,
    }
    adders[servicer.role](servicer, server)
    services = [f"verifypd.v1.{servicer.role.capitalize()}Lane"]
    if servicer.owned:
        lanes_pb2_grpc.add_KvTransferServicer_to_server(servicer.transfer, server)
        services.append("verifypd.v1.KvTransfer")
    health = add_health_and_reflection(server, services)
    bound = (
        server.add_secure_port(f"{host}:{port}", servicer.tls.grpc_server_credentials())
        if servicer.tls
        else server.add_insecure_port(f"{host}:{port}")
    )
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    if call_port is not None:
        pipelined = servicer.role == "verify"  # verify calls launched before the last one's reply
        servicer.call_server = CallServer(
            servicer.handle_call, cd.ChannelState, host, call_port, servicer.secret, servicer.tls, pipelined
        )
    return server, bound, health

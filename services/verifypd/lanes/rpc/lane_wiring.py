"""The one-time wiring of split lanes, done by the router's side after connecting the lane clients
(and again after a lane restart): the prefill lane imports the owners' pools (`wire_pools`), and the
verify lane opens the draft lane's DraftHandoff buffer where both run on one GPU.
"""

from __future__ import annotations

from verifypd.domain.lanes import LaneError
from verifypd.domain.options import KV_TRANSPORTS
from verifypd.lanes.rpc.lane_client import GrpcDraftLane, GrpcPrefillLane, GrpcVerifyLane
from verifypd.v1 import lanes_pb2


def shares_pools(wiring: lanes_pb2.ImportPoolsReply) -> bool:
    """Whether the prefill lane imported every pool by handle (reads and writes the owners' memory),
    rather than copying KV through staging pools of its own: the condition of prefix caching in
    split (core.assembly.build_split)."""
    return all(mode == "imported" for mode in wiring.mode_by_pool.values())


def wire_pools(
    prefill: GrpcPrefillLane, draft: GrpcDraftLane, verify: GrpcVerifyLane, kv_transport: str = "auto"
) -> lanes_pb2.ImportPoolsReply:
    """The one-time pool exchange: tells the prefill lane about the owners' pools.

    The owners' KvTransfer addresses are the addresses we reach them at (only the wiring side
    knows them), used when a pool is copied rather than imported.
    """
    if kv_transport not in KV_TRANSPORTS:
        raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}; got {kv_transport!r}")
    pools = []
    for owner in (verify, draft):
        for d in owner.describe_pb().pools:
            d = lanes_pb2.PoolDescriptor.FromString(d.SerializeToString())
            d.kv_transfer_addr = owner.addr
            pools.append(d)
    # The prefill lane may skip its device sync only if every call that can read its KV carries
    # the event: true when the owners are called over their call channels. A channel that cannot
    # be reached now (a port a firewall or Service does not expose) is not used at all: work
    # calls to that lane go over gRPC, and nothing relies on device-side ordering.
    for lane in (prefill, draft, verify):
        lane.probe_channel()
    forward = all(lane.on_call_channel() for lane in (prefill, draft, verify))
    reply = prefill.rpc(
        "ImportPools",
        lanes_pb2.ImportPoolsRequest(pools=pools, kv_transport=kv_transport, forward_kv_written_event=forward),
    )
    prefill.kv_written_event = reply.kv_written_event
    for owner in (draft, verify):
        # Only a lane that reads the prefill lane's KV waits for its writes: a pool-less draft lane
        # (ngram, none) may run on the CPU, where there is no event to wait on (found on an H200:
        # `serve --topology split --draft none` refused every draft call).
        owner.producer = prefill if owner.describe_pb().pools else None
    _wire_handoff(draft, verify)
    return reply


def _wire_handoff(draft: GrpcDraftLane, verify: GrpcVerifyLane) -> None:
    """Draft tokens on the device (DraftHandoff) when the verify lane can open the draft lane's
    buffer: both on the call channel, on one GPU. Otherwise they keep travelling through us."""
    draft.handoff = None
    info = draft.describe_pb()
    if not (info.HasField("draft_handoff") and draft.on_call_channel() and verify.on_call_channel()):
        return
    try:
        verify.rpc("ImportPools", lanes_pb2.ImportPoolsRequest(draft_handoff=info.draft_handoff))
    except LaneError:  # another device or host: the host path it is
        return
    draft.handoff = (info.draft_handoff.rows, info.draft_handoff.cols)

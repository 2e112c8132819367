"""Lanes over the network (split topology): lane servers, the router's lane clients, their codecs.

lane_server.py    lane processes: own/import KV pools, serve Describe/ImportPools/work RPCs
lane_ports.py     build_lane_server: a lane's gRPC port (auth, health, TLS) and its call-channel port
lane_client.py    GrpcPrefillLane / GrpcDraftLane / GrpcVerifyLane (the lane protocols over gRPC)
lane_connection.py  a lane client's gRPC connection: unary calls, health (SERVING/SLOW/DOWN), Describe
started_call.py   StartedLaneCall: a work call written on the call channel, its reply read later
lane_wiring.py    wire_pools: the prefill lane imports the owners' pools; the draft handoff is opened
call_channel.py   the fast path for work calls (framed protobufs over TCP); call_codec/call_decode
lane_calls.py, lane_validate.py, lane_setup.py, lane_convert.py   the lane side's call handling
pool_import.py    ImportPools, lane side: the owners' pools checked, a KV transport chosen, each opened
kv_transport.py   pool descriptors, shared-memory import, the copy transport, DraftProbs codec
peer_copy.py      the peer transport: per-layer copies into an owner's pool on another GPU of the host
cuda_ipc.py, draft_handoff.py     CUDA IPC handles of pools and of the draft-token buffer
lane_spans.py     trace spans of lane calls, router and lane side (context sent with each call)
"""

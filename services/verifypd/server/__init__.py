"""verifypd services: the Generate gateway, Control, lane servers and their gRPC clients.

Layout:
    convert.py      proto <-> domain objects of the public API and Control (torch-free)
    lane_convert.py proto <-> domain objects of the internal lane RPCs (torch-free)
    engine_loop.py  the one thread that owns the Router; inbox of requests/aborts/config swaps
    gateway.py      Generation + Control servicers, health, reflection; builds colocated/split
    lane_client.py  GrpcPrefillLane / GrpcDraftLane / GrpcVerifyLane (the lane protocols over gRPC)
    lane_server.py  lane processes: own/import KV pools, serve Describe/ImportPools/work RPCs
    kv_transport.py pool descriptors, shared-memory import, the copy transport, DraftProbs codec
    cuda_ipc.py     the CUDA IPC handle of a pool, spelled out as explicit fields
    launcher.py     spawning lane processes for `serve --topology split`
    health.py       standard gRPC health checking + reflection, on every server
    telemetry.py    OpenTelemetry metrics (OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set)
    cli.py          `verifypd serve`, `verifypd lane`, `verifypd generate --server`
"""

"""Lanes: batch executors behind one interface (PrefillLane, DraftLane, VerifyLane), with an
in-process and a gRPC transport, and the processes that run them.

local.py             the in-process lanes over model runners (zero copy)
rpc/                 lanes over the network: lane servers, the router's lane clients, codecs, KV transport
tensor_parallel/     the rank processes of a target over --tensor-parallel N; assembling rank 0
processes.py         LaneProcesses: spawning the three lane processes of `serve --topology split`;
                     child_env (the environment every spawned verifypd process gets)
supervisor.py        LaneSupervisor: restarting lanes that die; crash-loop detection
mps.py               a private CUDA MPS daemon for the lanes of one serve (--mps)
"""

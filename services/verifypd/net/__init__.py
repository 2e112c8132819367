"""Network plumbing shared by the gateway, the engine core and the lanes. Torch-free.

auth.py      the lane secret and the gateway's API/admin keys (gRPC interceptors)
tls.py       TLS of the public listeners and their clients
lane_tls.py  mutual TLS between the engine core and the lanes
health.py    gRPC health checking and reflection
"""

"""The engine core: the router and its lanes, in their own process (`verifypd serve`).

process.py      building the router (colocated or over lane clients) and running it as a process
core_server.py  the router + engine loop behind the core channel; lane watchdog and re-wiring
loop.py  the one thread that steps the router; inbox of adds/cancels/config swaps
channel.py      the core channel: length-prefixed JSON over a local socket, one message per step
telemetry.py    OpenTelemetry metrics of the engine (OTLP, and Prometheus text for /metrics)
"""

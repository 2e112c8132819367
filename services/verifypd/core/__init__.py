"""The engine core: the router and its lanes behind the core channel, in their own process
(`verifypd serve`), and the gateway's client of it.

assembly.py     the one place stacks are built from resolved options: colocated (models, pools,
                in-process lanes, router) and split (the router over lane clients)
process.py      the engine-core process: CoreProcess (the gateway's side: spawn, CoreOptions as
                JSON on stdin) and core_main (the child: build the stack, run the loop)
core_server.py  CoreServer: the router + CoreLoop behind the core channel; lane watchdog and re-wiring
loop.py         CoreLoop: the one thread that steps the router; inbox of adds/cancels/config swaps
channel.py      the core channel: length-prefixed JSON over a local socket, one message per step
client.py       CoreClient: the gateway's end of the channel (submit, cancel, control, detokenization)
telemetry.py    OpenTelemetry metrics of the core (OTLP, and Prometheus text for /metrics)
"""

"""`verifypd lane prefill|draft|verify`: one lane server of the split topology, until SIGTERM/SIGINT
or until its parent process is gone."""

from __future__ import annotations

import os
import sys

from verifypd.domain.heap import freeze_startup_heap
from verifypd.domain.logs import setup_logging, simulated_label, warn_simulated
from verifypd.launch.serve_args import engine_options
from verifypd.launch.signals import wait_for_signal
from verifypd.net.auth import LANE_SECRET_ENV


def cmd_lane(args) -> int:
    from verifypd.lanes.rpc.lane_ports import build_lane_server
    from verifypd.lanes.rpc.lane_server import LaneServicer
    from verifypd.lanes.rpc.lane_spans import LaneServerSpans
    from verifypd.net.auth import load_secret
    from verifypd.net.lane_tls import lane_tls

    setup_logging()
    try:
        secret = load_secret(args.secret_file)
        tls = lane_tls(args.tls_cert_file, args.tls_key_file, args.tls_ca_file, args.tls_server_name)
    except (OSError, ValueError) as exc:  # TlsError is a ValueError
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.health_port <= 65535:
        print(
            f"verifypd: error: --health-port must be 0 (off) or a port number; got {args.health_port}", file=sys.stderr
        )
        return 2
    if secret is None and not args.allow_unauthenticated:
        print(
            f"verifypd: error: a lane needs a shared secret (--secret-file or env {LANE_SECRET_ENV}); only the "
            f"gateway may call lanes. --allow-unauthenticated serves without one (tests only).",
            file=sys.stderr,
        )
        return 2
    if not 1 <= args.device_lanes <= 3:
        print(f"verifypd: error: --device-lanes must be 1, 2 or 3; got {args.device_lanes}", file=sys.stderr)
        return 2
    try:
        options = engine_options(args)
    except ValueError as exc:  # InvalidRequest: e.g. --k-max out of range
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    if options.tensor_parallel > 1 and args.lane == "draft":
        print(
            f"verifypd: error: --tensor-parallel {options.tensor_parallel}: the draft lane is not sharded (only "
            "the verify and prefill lanes run the target)",
            file=sys.stderr,
        )
        return 2
    if args.lane == "verify":
        warn_simulated(options)
    elif options.simulated_acceptance is not None:
        print("verifypd: error: --simulated-acceptance applies to the verify lane only", file=sys.stderr)
        return 2
    servicer = LaneServicer(args.lane, options, secret=secret, tls=tls)
    servicer.spans = LaneServerSpans.from_env(args.lane)  # None unless OTLP is configured (inherited)
    if not -1 <= args.call_port <= 65535:
        print(f"verifypd: error: --call-port must be -1, 0 or a port number; got {args.call_port}", file=sys.stderr)
        return 2
    try:
        server, port, health = build_lane_server(
            servicer, args.host, args.port, None if args.call_port == -1 else args.call_port
        )
        health_port = None
        if args.health_port:
            from verifypd.net.health import HealthPort, serving_check

            health_port = HealthPort(args.host, args.health_port, {"/health": serving_check(health)})
    except OSError as exc:
        print(f"verifypd: error: cannot serve the {args.lane} lane: {exc}", file=sys.stderr)
        servicer.close()
        return 2
    if args.port_file:  # written atomically: the launcher reads it as soon as it exists
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:  # port, then the pool files this lane owns (for cleanup)
            shards = [d.shm_path for d in servicer.rank_shards if d.shm_path]  # --tensor-parallel: the other ranks'
            f.write("\n".join([str(port), *[p.shm_path for p in servicer.owned.values() if p.shm_path], *shards]))
        os.replace(tmp, args.port_file)
    freeze_startup_heap()  # domain/heap.py (the lane's pools come later, in its setup call: few objects)
    calls = f", call channel on port {servicer.call_server.port}" if servicer.call_server else ""
    calls += ", mutual TLS" if tls is not None else ""
    calls += f", plaintext health on port {health_port.port}" if health_port is not None else ""
    print(
        f"verifypd: {args.lane} lane serving on {args.host}:{port}{calls} "
        f"(pid {os.getpid()}{simulated_label(options)})",
        file=sys.stderr,
        flush=True,
    )
    parent = args.parent_pid
    try:
        wait_for_signal(poll=(lambda: os.getppid() != parent) if parent else None)
    finally:
        health.set(False)
        server.stop(1).wait(2)
        servicer.close()
    return 0

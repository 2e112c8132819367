"""Building the engine core (router + lanes) and running it as its own process.

    spawn_core(serve_argv)  -> CoreProcess   the gateway's side: a socketpair, the child started
                                             with `python -m verifypd.core.process`
    core_main(argv)                          the child: parses the same `serve` arguments, builds
                                             the router (colocated, or split: lane processes it
                                             launches and supervises, or lanes at --*-addr), then
                                             runs the engine loop on its main thread

`build_colocated_core` / `build_split_core` are also what the in-process gateway of the tests uses.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading

from verifypd import __version__
from verifypd.v1 import generate_pb2

log = logging.getLogger("verifypd.core")


def server_info(target: str, draft: str, topology: str, max_context: int) -> generate_pb2.ServerInfo:
    return generate_pb2.ServerInfo(
        target_model=target, draft_model=draft, topology=topology, max_context=max_context, version=__version__
    )


def build_colocated_core(options, *, observer=None, topology: str = "colocated"):
    """(router, info, local Engine): models, pools and lanes in this process. The router does not
    detokenize: the gateway does."""
    from verifypd.engine import Engine

    engine = Engine(options, observer=observer, detokenize=False)
    return engine.router, server_info(options.target, options.draft, topology, engine.router.max_context), engine


def connect_lanes(
    addrs: dict[str, str],
    *,
    timeout_s: float = 60.0,
    ready_timeout_s: float = 120.0,
    secret: str | None = None,
    tls=None,
):
    """`tls`: a verifypd.net.lane_tls.LaneTls (mutual TLS to every lane) or None (plaintext)."""
    from verifypd.lanes.rpc.lane_client import GrpcDraftLane, GrpcPrefillLane, GrpcVerifyLane

    lanes = (
        GrpcPrefillLane(addrs["prefill"], timeout_s, secret, tls=tls),
        GrpcDraftLane(addrs["draft"], timeout_s, secret, tls=tls),
        GrpcVerifyLane(addrs["verify"], timeout_s, secret, tls=tls),
    )
    for lane in lanes:
        lane.wait_ready(ready_timeout_s)
    return lanes


def build_split_core(
    addrs: dict[str, str],
    options,
    *,
    kv_transport: str = "auto",
    observer=None,
    lane_timeout_s: float = 60.0,
    topology: str = "split",
    lane_secret: str | None = None,
    lane_tls=None,
    ready_timeout_s: float = 120.0,
):
    """(router, info, lanes, wiring): the router over gRPC lane clients; the prefill lane imports
    (or stages) the owners' pools once (and again after a lane restart, CoreServer._rewire).
    The router does not detokenize: the gateway does (decode=None)."""
    from verifypd.lanes.rpc.lane_client import wire_pools
    from verifypd.router.router import Router

    prefill, draft, verify = connect_lanes(
        addrs, timeout_s=lane_timeout_s, secret=lane_secret, tls=lane_tls, ready_timeout_s=ready_timeout_s
    )
    wiring = wire_pools(prefill, draft, verify, kv_transport)
    log.info("lanes wired: %s (import %.3f s)", dict(wiring.mode_by_pool), wiring.import_seconds)
    verify_info = verify.describe_pb()
    router = Router(
        prefill,
        draft,
        verify,
        decode=None,
        eos_token_ids=tuple(verify_info.eos_token_ids),
        config=options.config,
        max_running=options.max_running,
        observer=observer,
    )
    info = server_info(options.target, options.draft, topology, router.max_context)
    return router, info, (prefill, draft, verify), wiring


# -- the child process -------------------------------------------------------------------------
def core_main(argv: list[str]) -> int:
    """`python -m verifypd.core.process --channel-fd N SERVE_ARGS...`"""
    from verifypd.core.channel import BlockingChannel
    from verifypd.core.core_server import CoreServer
    from verifypd.core.telemetry import Telemetry
    from verifypd.launch.serve_args import engine_options, serve_parser, setup_logging, warn_simulated

    if len(argv) < 2 or argv[0] != "--channel-fd":
        print("usage: python -m verifypd.core.process --channel-fd N serve ARGS...", file=sys.stderr)
        return 2
    # The gateway decides when to stop (its drain): a terminal's Ctrl-C reaches the whole process
    # group, and the core must keep serving the requests the gateway is draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = BlockingChannel(socket.socket(fileno=int(argv[1])))
    serve_argv = argv[2:]
    args = serve_parser().parse_args(serve_argv[1:] if serve_argv[:1] == ["serve"] else serve_argv)
    setup_logging()
    options = engine_options(args)
    warn_simulated(options)
    readers, registry = [], None
    if args.http_port:  # /metrics on the gateway asks this process for its instruments' text
        from verifypd.core.telemetry import prometheus_reader

        reader, registry = prometheus_reader()
        readers.append(reader)
    telemetry = Telemetry("verifypd-gateway", readers=readers)
    from verifypd.launch.serve_args import serve_lane_tls

    lane_tls = serve_lane_tls(args)
    if lane_tls is not None:  # fail at once on our own expired / foreign certificate, not after lane timeouts
        from verifypd.domain.lanes import LaneError

        own = lane_tls.self_check()
        if own:
            raise LaneError(own)
    split = dict(kv_transport=args.kv_transport, lane_timeout_s=args.lane_timeout, lane_tls=lane_tls)
    addrs = {lane: getattr(args, f"{lane}_addr") for lane in ("prefill", "draft", "verify")}
    lanes, on_close, supervisor, wiring = (), [telemetry.shutdown], None, None
    if any(addrs.values()):
        from verifypd.net.auth import load_secret

        router, info, lanes, wiring = build_split_core(
            addrs,
            options,
            topology=args.topology,
            observer=telemetry,
            lane_secret=load_secret(args.lane_secret_file),
            **split,
        )
    elif args.topology == "split":
        from verifypd.launch.launcher import LaneProcesses
        from verifypd.launch.supervisor import LaneSupervisor

        options.shared_cpu_pools = True
        procs = LaneProcesses(options, host="127.0.0.1", tls=lane_tls, mps=args.mps)
        try:
            addrs = procs.start()
            for lane, pid in procs.pids().items():
                print(f"verifypd: {lane} lane pid={pid} addr={addrs[lane]}", file=sys.stderr, flush=True)
            router, info, lanes, wiring = build_split_core(
                addrs, options, observer=telemetry, lane_secret=procs.secret, **split
            )
        except BaseException:
            procs.terminate()
            raise
        # A crash loop fails the engine; on close the supervisor stops first, so lanes exiting
        # from then on are shutting down, not crashing, and the launcher stops them.
        supervisor = LaneSupervisor(
            procs, lambda message: core.engine.fail(message), max_restarts=args.max_lane_restarts
        )
        on_close[:0] = [supervisor.stop, procs.terminate]
    else:
        router, info, _engine = build_colocated_core(options, observer=telemetry)
    core = CoreServer(
        router,
        channel,
        info,
        max_queue=args.max_queue,
        lanes=lanes,
        kv_transport=args.kv_transport,
        recovery_timeout_s=args.recovery_timeout,
        on_close=on_close,
        metrics_registry=registry,
    )
    core.wiring = wiring
    if supervisor is not None:
        supervisor.start()
    _exit_with_parent()
    core.start(loop_in_thread=False)  # returns when the gateway says stop or goes away
    return 0


def _exit_with_parent() -> None:
    """Belt and braces beside the channel's EOF: a gateway that vanished must not leave a core."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# -- the gateway's side ------------------------------------------------------------------------
class CoreProcess:
    """A spawned engine-core process and the gateway's end of its channel."""

    def __init__(self, serve_argv: list[str], program: list[str] | None = None):
        """`program`: what runs the core (default this module; benches pass their own), called as
        PROGRAM --channel-fd N SERVE_ARGV..."""
        from verifypd.launch.launcher import child_env

        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        program = program or [sys.executable, "-m", "verifypd.core.process"]
        cmd = [*program, "--channel-fd", str(child.fileno()), *serve_argv]
        self.proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), env=child_env())
        child.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self, timeout_s: float = 30.0) -> None:
        """After `stop` on the channel: waits for a clean exit (lanes stopped), then kills."""
        if self.wait(timeout_s) is None:
            log.warning("engine core (pid %d) did not exit in %.0f s: killing it", self.proc.pid, timeout_s)
            self.proc.kill()
            self.proc.wait()


def main() -> int:
    from verifypd.domain.lanes import LaneError
    from verifypd.domain.requests import InvalidRequest
    from verifypd.launch.launcher import LaneStartError
    from verifypd.model.loader import ModelLoadError

    try:
        return core_main(sys.argv[1:])
    except (InvalidRequest, ModelLoadError, OSError) as exc:
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2
    except LaneStartError as exc:  # split: a lane refused its arguments (2) or failed (1)
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 2 if exc.code == 2 else 1
    except LaneError as exc:  # e.g. a lane that refuses our certificate: one line, no traceback
        print(f"verifypd: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

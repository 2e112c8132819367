"""The engine core as its own process (`verifypd serve`).

CoreProcess(options)  the gateway's side: a socketpair, the child started with
                      `python -m verifypd.core.process --channel-fd N`, the resolved
                      CoreOptions written to its stdin as JSON (no secret on a command line)
core_main(fd, opts)   the child: builds the stack from the options (core/assembly.py:
                      colocated, or split over lane processes it starts and supervises, or
                      over lanes at the given addresses), then runs the core loop on its
                      main thread
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from verifypd.domain.options import CoreOptions

if TYPE_CHECKING:
    from verifypd.core.assembly import SplitLanes, SplitStack
    from verifypd.lanes.supervisor import LaneSupervisor
    from verifypd.v1 import lanes_pb2

log = logging.getLogger("verifypd.core")


# -- the child process -------------------------------------------------------------------------
def core_main(channel_fd: int, options: CoreOptions) -> int:
    """Serves the core channel on `channel_fd` with the stack `options` describe, until the gateway
    says stop or goes away."""
    from verifypd.core.assembly import build_colocated, build_split
    from verifypd.core.channel import BlockingChannel
    from verifypd.core.core_server import CoreServer
    from verifypd.core.telemetry import Telemetry
    from verifypd.core.tracing import RequestTracing
    from verifypd.domain.heap import freeze_startup_heap
    from verifypd.domain.logs import setup_logging, warn_simulated
    from verifypd.net.lane_tls import serve_lane_tls
    from verifypd.net.trace_context import make_tracing

    # The gateway decides when to stop (its drain): a terminal's Ctrl-C reaches the whole process
    # group, and the core must keep serving the requests the gateway is draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = BlockingChannel(socket.socket(fileno=channel_fd))
    setup_logging()
    engine_options = options.engine
    warn_simulated(engine_options)
    readers, registry, serving = [], None, None
    if options.metrics:  # /metrics on the gateway asks this process for its instruments' text
        from verifypd.core.serving_metrics import ServingMetrics
        from verifypd.core.telemetry import prometheus_reader

        reader, registry = prometheus_reader()
        readers.append(reader)
        serving = ServingMetrics(options.model_name or engine_options.target)
        registry.register(serving)
    telemetry = Telemetry("verifypd-gateway", readers=readers, serving=serving)
    spans = make_tracing("verifypd-core")  # None unless OTLP is configured
    tracing = RequestTracing(spans) if spans is not None else None
    telemetry.tracing = tracing
    lane_tls = serve_lane_tls(options.lane_tls)
    if lane_tls is not None:  # fail at once on our own expired / foreign certificate, not after lane timeouts
        from verifypd.domain.lanes import LaneError

        own = lane_tls.self_check()
        if own:
            raise LaneError(own)

    def split_stack(addrs: dict[str, str], lane_secret: str | None, topology: str = "split") -> SplitStack:
        stack = build_split(
            addrs,
            engine_options,
            kv_transport=options.kv_transport,
            observer=telemetry,
            lane_timeout_s=options.lane_timeout_s,
            topology=topology,
            lane_secret=lane_secret,
            lane_tls=lane_tls,
        )
        if tracing is not None:  # the lane calls' spans, their context sent to the lanes
            tracing.trace_lane_calls(stack.lanes)
        return stack

    lanes: SplitLanes | tuple[()] = ()
    on_close: list[Callable[[], None]] = [telemetry.shutdown]
    supervisor: LaneSupervisor | None = None
    wiring: lanes_pb2.ImportPoolsReply | None = None
    if options.lane_addrs:
        stack = split_stack(options.lane_addrs, options.lane_secret, options.topology)
        router, info, lanes, wiring = stack.router, stack.info, stack.lanes, stack.wiring
    elif options.topology == "split":
        from verifypd.lanes.processes import LaneProcesses
        from verifypd.lanes.supervisor import LaneSupervisor

        engine_options.shared_cpu_pools = True
        procs = LaneProcesses(engine_options, host="127.0.0.1", tls=lane_tls, mps=options.mps)
        try:
            addrs = procs.start()
            for lane, pid in procs.pids().items():
                print(f"verifypd: {lane} lane pid={pid} addr={addrs[lane]}", file=sys.stderr, flush=True)
            stack = split_stack(addrs, procs.secret)
            router, info, lanes, wiring = stack.router, stack.info, stack.lanes, stack.wiring
        except BaseException:
            procs.terminate()
            raise
        # A crash loop fails the core; on close the supervisor stops first, so lanes exiting
        # from then on are shutting down, not crashing, and the lane processes stop them.
        supervisor = LaneSupervisor(
            procs, lambda message: core.loop.fail(message), max_restarts=options.max_lane_restarts
        )
        on_close[:0] = [supervisor.stop, procs.terminate]
        if serving is not None:
            serving.lane_restarts = lambda: supervisor.total_restarts
    else:
        colocated = build_colocated(engine_options, observer=telemetry, detokenize=False)
        router, info = colocated.router, colocated.info()
    core = CoreServer(
        router,
        channel,
        info,
        max_queue=options.max_queue,
        lanes=lanes,
        kv_transport=options.kv_transport,
        recovery_timeout_s=options.recovery_timeout_s,
        on_close=on_close,
        metrics_registry=registry,
        lane_timeout_s=options.lane_timeout_s,
        on_hung=supervisor.kill_hung if supervisor is not None else None,
        stall_timeout_s=options.stall_timeout_s,
    )
    core.wiring = wiring
    core.tracing = tracing
    if supervisor is not None:
        supervisor.start()
    _exit_with_parent()
    freeze_startup_heap()  # domain/heap.py: a full collection would stall the loop for ~100 ms
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

    def __init__(
        self, options: CoreOptions | None, *, program: list[str] | None = None, program_args: Sequence[str] = ()
    ):
        """`options`: written to the child's stdin as JSON (None: nothing is, stdin is empty).
        `program`: what runs the core (default this module; benches pass their own), called as
        PROGRAM --channel-fd N PROGRAM_ARGS..."""
        from verifypd.lanes.processes import child_env

        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        program = program or [sys.executable, "-m", "verifypd.core.process"]
        cmd = [*program, "--channel-fd", str(child.fileno()), *program_args]
        self.proc = subprocess.Popen(
            cmd,
            pass_fds=(child.fileno(),),
            env=child_env(core_share=2),  # colocated: the engine's torch gets half the cores
            stdin=subprocess.PIPE if options is not None else subprocess.DEVNULL,
        )
        child.close()
        stdin = self.proc.stdin  # a pipe exactly when there are options
        if options is not None and stdin is not None:
            try:
                stdin.write(options.to_json().encode())
                stdin.close()
            except BrokenPipeError:  # the child is gone already: its exit status tells why
                pass

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


def main(argv: list[str] | None = None) -> int:
    """`python -m verifypd.core.process --channel-fd N`, CoreOptions JSON on stdin."""
    from verifypd.domain.lanes import LaneError
    from verifypd.domain.models import ModelLoadError
    from verifypd.domain.requests import InvalidRequest
    from verifypd.lanes.processes import LaneStartError

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--channel-fd":
        print("usage: python -m verifypd.core.process --channel-fd N  (CoreOptions JSON on stdin)", file=sys.stderr)
        return 2
    try:
        options = CoreOptions.from_json(sys.stdin.read())
    except (KeyError, TypeError, ValueError) as exc:
        print(f"verifypd: error: engine core: bad options on stdin: {exc}", file=sys.stderr)
        return 2
    try:
        return core_main(int(argv[1]), options)
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

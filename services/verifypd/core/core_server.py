"""The engine core: the router and its lanes behind the core channel (core/channel.py).

`verifypd serve` runs it as its own process (`python -m verifypd.core.process`, spawned by
the gateway with the channel's socket inherited), so the router's steps never share an
interpreter lock with gRPC, HTTP, tokenization or detokenization. Its main thread does nothing
but steps (`CoreLoop`); one reader thread turns channel messages into inbox commands; the split
topology adds the lane watchdog and supervisor threads. Tests run the same `CoreServer` in
threads of their own process (`gateway.build_colocated`), over a socketpair all the same.

The core exits when the gateway says `stop` or closes the channel (the gateway died): it never
outlives its gateway, and its lanes (split) never outlive it (they watch its pid).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from verifypd.core.channel import BlockingChannel, ChannelClosed, b64, output_to_wire, spec_from_wire, unb64
from verifypd.core.lane_watch import HUNG, LOST, LaneWatch
from verifypd.core.loop import CoreLoop, Overloaded, Unavailable
from verifypd.domain import convert
from verifypd.domain.lanes import LaneError
from verifypd.domain.requests import InvalidRequest, RequestOutput
from verifypd.v1 import control_pb2

if TYPE_CHECKING:
    from verifypd.core.assembly import SplitLanes
    from verifypd.core.tracing import RequestTracing
    from verifypd.v1 import lanes_pb2

log = logging.getLogger("verifypd.core")
HEARTBEAT_S = 1.0  # the core tells the gateway it is alive (and whether it takes requests) this often


def refusal(exc: BaseException) -> tuple[str, str]:
    """(gRPC status name, message) of an exception a command raised."""
    if isinstance(exc, InvalidRequest):
        return "INVALID_ARGUMENT", str(exc)
    if isinstance(exc, Overloaded):
        return "RESOURCE_EXHAUSTED", str(exc)
    if isinstance(exc, Unavailable):
        return "UNAVAILABLE", f"server is not serving: {exc}"
    return "INTERNAL", f"internal error in the engine: {exc}"


class CoreServer:
    """The router + CoreLoop serving one channel. `lanes`: gRPC lane clients to watch and re-wire
    (split topology); `on_close`: run after the loop stops (terminate spawned lanes)."""

    def __init__(
        self,
        router,
        channel: BlockingChannel,
        info,
        *,
        max_queue: int = 256,
        lanes: SplitLanes | tuple[()] = (),
        kv_transport: str = "auto",
        recovery_timeout_s: float = 120.0,
        on_close=(),
        watch_interval_s: float = 1.0,
        metrics_registry=None,
        lane_timeout_s: float = 60.0,
        on_hung: Callable[[str], None] | None = None,
        stall_timeout_s: float = 10.0,
    ):
        """`lane_timeout_s`: a lane whose health checks fail that long is hung; `on_hung(lane)` then
        kills its process (the supervisor, when this core started the lanes). `stall_timeout_s`: a
        step running longer makes the gateway's health NOT_SERVING (the core takes no request)."""
        self.router, self.channel, self.info = router, channel, info
        self.lanes, self.kv_transport = lanes, kv_transport
        self.loop = CoreLoop(
            router,
            self,
            max_queue=max_queue,
            on_failure=self._on_failure,
            recover=self._rewire if self.lanes else None,
            recovery_timeout_s=recovery_timeout_s,
        )
        self.metrics_registry = metrics_registry
        self.tracing: RequestTracing | None = None  # core/tracing.py: set when OTLP traces are on
        self._on_close = list(on_close)
        self._watch_interval_s = watch_interval_s
        self.lane_watch = LaneWatch(lane_timeout_s)
        self._on_hung = on_hung
        self._stall_timeout_s = stall_timeout_s
        self._stopped = threading.Event()
        self._closed = False
        self.wiring: lanes_pb2.ImportPoolsReply | None = (
            None  # split: the last ImportPools reply (re-wiring replaces it)
        )
        self._reader = threading.Thread(target=self._read, name="core-channel", daemon=True)

    # -- StepSink (loop thread) --------------------------------------------------------------
    def step(self, outputs: list[RequestOutput]) -> None:
        self._send({"t": "step", "out": [output_to_wire(o) for o in outputs]})

    def fail(self, request_ids: list[str], code: str, message: str, fatal: bool) -> None:
        self._send(
            {"t": "fail", "ids": [int(i) for i in request_ids], "code": code, "message": message, "fatal": fatal}
        )

    def _send(self, msg: dict) -> None:
        try:
            self.channel.send(msg)
        except OSError:  # the gateway is gone: the reader sees EOF and stops the loop
            pass

    # -- life cycle ----------------------------------------------------------------------------
    def ready_message(self) -> dict:
        info = self.info
        return {
            "t": "ready",
            "info": {
                "target_model": info.target_model,
                "draft_model": info.draft_model,
                "topology": info.topology,
                "max_context": info.max_context,
                "version": info.version,
                "sliding_window": info.sliding_window,
                "sliding_window_kv": info.sliding_window_kv,
            },
            "eos": sorted(self.router.eos_token_ids),
            # whether this core caches prefixes (split: only with KV passed by handle), so the
            # gateway makes samples 1.. of a request wait for sample 0's prompt KV (gateway.samples)
            "prefix_cache": self.router.prefix is not None,
        }

    def start(self, *, loop_in_thread: bool) -> None:
        """Announces readiness and starts reading commands; the loop runs in a thread or, with
        loop_in_thread=False, on the caller's thread until stopped (the process's main thread)."""
        self._send(self.ready_message())
        self._reader.start()
        threading.Thread(target=self._heartbeat, name="core-heartbeat", daemon=True).start()
        if self.lanes:
            threading.Thread(target=self._watch_lanes, name="lane-watchdog", daemon=True).start()
        if loop_in_thread:
            self.loop.start()
        else:
            self.loop.run()
            self._close()

    def stop(self) -> None:
        """Stops the loop (joining its thread) and closes lanes and channel. Idempotent."""
        self._stopped.set()
        self.loop.stop()
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lane in self.lanes:
            lane.close()
        for fn in self._on_close:
            fn()
        self.channel.close()

    def _on_failure(self, message: str) -> None:
        log.error("not serving any more: %s", message, extra={"reason": message})

    def stalled(self) -> str | None:
        """Why the core takes no request now (a step has run past the stall timeout), or None."""
        began = self.loop.step_started
        if began is None:
            return None
        running = time.monotonic() - began
        if running <= self._stall_timeout_s:
            return None
        return f"an engine step has been running for {running:.0f} s (a lane is slow or hung); requests wait"

    def _heartbeat(self) -> None:
        """Every HEARTBEAT_S, from a thread of its own (the loop thread may be stuck in a lane call):
        alive, and whether requests are taken. The gateway's health follows it (core/client.py)."""
        while not self._stopped.wait(HEARTBEAT_S):
            self._send({"t": "beat", "stalled": self.stalled()})

    # -- commands (reader thread) --------------------------------------------------------------
    def _read(self) -> None:
        try:
            while not self._stopped.is_set():
                msg = self.channel.receive()
                kind = msg["t"]
                if kind == "add":
                    self._add(msg)
                elif kind == "cancel":
                    self.loop.cancel(str(msg["id"]))
                elif kind == "call":
                    self._call(msg)
                elif kind == "stop":
                    break
                else:
                    log.warning("unknown channel message %r", kind)
        except (ChannelClosed, OSError, KeyError, TypeError, ValueError) as exc:
            if not self._stopped.is_set():
                log.warning("core channel: %s; stopping", exc)
        self._stopped.set()
        self.loop.stop(timeout_s=0)

    def _add(self, msg: dict) -> None:
        rid = msg["id"]
        try:
            spec = spec_from_wire(msg["spec"], str(rid))
        except (KeyError, TypeError, ValueError) as exc:
            self._send({"t": "refused", "id": rid, "code": "INVALID_ARGUMENT", "message": f"bad request: {exc}"})
            return

        tracing = self.tracing
        if tracing is not None and msg.get("tp"):  # the gateway's span: this request's core spans hang below it
            tracing.begin(str(rid), msg["tp"])

        def done(future) -> None:  # loop thread, before the step that first schedules it
            exc = future.exception()
            if exc is None:
                self._send({"t": "added", "id": rid})
            else:
                if tracing is not None:
                    tracing.forget(str(rid))
                code, message = refusal(exc)
                self._send({"t": "refused", "id": rid, "code": code, "message": message})

        self.loop.submit(spec).add_done_callback(done)

    def _call(self, msg: dict) -> None:
        cid, op, arg = msg["cid"], msg["op"], msg.get("arg")
        ops = {
            "get_config": lambda router: self._config_b64(router.config),
            "update_config": lambda router: self._update_config(router, arg),
            "stats": lambda router: self._stats(router),
        }
        if op == "metrics":  # the Prometheus text of this process's instruments (no router access)
            self._send({"t": "reply", "cid": cid, "ok": self._metrics_text()})
            return
        if op not in ops:
            self._send({"t": "reply", "cid": cid, "error": ["INVALID_ARGUMENT", f"unknown call {op!r}"]})
            return

        def done(future) -> None:
            exc = future.exception()
            self._send(
                {"t": "reply", "cid": cid, "ok": future.result()}
                if exc is None
                else {"t": "reply", "cid": cid, "error": list(refusal(exc))}
            )

        self.loop.post(ops[op]).add_done_callback(done)

    @staticmethod
    def _config_b64(config) -> str:
        return b64(convert.config_to_pb(config).SerializeToString())

    def _update_config(self, router, arg: dict | None) -> str:
        # Runs between steps: the step after this one plans with the new config.
        if arg is None:
            raise ValueError("update_config: the call carries no arg (the new config)")
        pb = control_pb2.RuntimeConfig.FromString(unb64(arg["config"]))
        new = router.config.updated(**convert.config_changes_from_pb(pb, router.config))
        router.config = new
        self.loop.config_log.append((self.loop.steps, new.revision))
        log.info(
            "config revision %d applied (by %r: %s): %s",
            new.revision,
            arg.get("requested_by", ""),
            arg.get("reason", ""),
            new,
        )
        return self._config_b64(new)

    def _stats(self, router) -> dict:
        """What benches read: steps, their busy time and tokens, requests and blocks in use."""
        e = self.loop
        return {
            "in_flight": e.in_flight(),
            "steps": e.steps,
            "step_seconds": e.step_seconds,
            "tokens_out": e.tokens_out,
            "target_blocks_in_use": router.target_blocks.num_used,
        }

    def _metrics_text(self) -> str:
        if self.metrics_registry is None:
            return ""
        from prometheus_client import generate_latest

        return generate_latest(self.metrics_registry).decode()

    # -- split topology: lanes -----------------------------------------------------------------
    def _watch_lanes(self) -> None:
        """A lane that dies while idle starts recovery too (a call to a dead lane fails by itself:
        the RPC ends with UNAVAILABLE); one that stops answering is lost only once it counts as hung
        (lane_watch.py), and then killed so that it restarts. Repeated reports during one recovery
        are no-ops."""
        probe_s = max(self._watch_interval_s, 1.0)
        while not self._stopped.wait(self._watch_interval_s):
            for lane in self.lanes:
                started = time.monotonic()
                verdict = lane.probe(timeout_s=probe_s)
                if self._stopped.is_set():
                    return
                action = self.lane_watch.observe(lane.lane, verdict, started, time.monotonic())
                if action == HUNG:
                    log.error(
                        "%s lane at %s has not answered a health check for %.0f s (--lane-timeout): hung",
                        lane.lane,
                        lane.addr,
                        self.lane_watch.hung_after_s,
                    )
                    if self._on_hung is not None:
                        self._on_hung(lane.lane)
                    self.loop.lane_lost(f"{lane.lane} lane at {lane.addr} is hung")
                    break
                if action == LOST:
                    self.loop.lane_lost(f"{lane.lane} lane at {lane.addr} is not serving")
                    break

    def _rewire(self) -> None:
        """Engine thread, during recovery: raises LaneError until every lane serves again; then
        re-reads the owners' pools (new ids and generations after a restart) and has the prefill
        lane import them. Old-generation handles are refused by the lanes from then on."""
        from verifypd.lanes.rpc.lane_wiring import shares_pools, wire_pools

        for lane in self.lanes:
            if not lane.healthy(timeout_s=1.0):
                raise LaneError(f"{lane.lane} lane at {lane.addr} is not serving yet")
        for lane in self.lanes:
            lane.describe_pb(refresh=True)
        if not self.lanes:
            raise RuntimeError("no lanes to re-wire")  # recover is installed only with lanes (__init__)
        prefill, draft, verify = self.lanes
        self.wiring = wire_pools(prefill, draft, verify, self.kv_transport)
        log.info("lanes re-wired: %s", dict(self.wiring.mode_by_pool))
        if not shares_pools(self.wiring):  # copied KV now: cached blocks may miss in the prefill lane
            self.router.context.prefix_cache_wanted = False

"""The gateway: one gRPC server with Generation, Control, health and reflection, in front of the
router (run by the engine thread, engine_loop.py).

`build_colocated` puts models and lanes in this process; `build_split` connects to lane servers
(spawned by the launcher or already running) and wires their KV pools once.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures

import grpc

from verifypd import __version__
from verifypd.engine.router import Router
from verifypd.engine.types import InvalidRequest
from verifypd.server import convert
from verifypd.lanes.interface import LaneError
from verifypd.server.auth import api_key_interceptor
from verifypd.server.engine_loop import Draining, EngineLoop, Failure, Overloaded, Unavailable
from verifypd.server.health import add_health_and_reflection
from verifypd.server.lane_client import GrpcDraftLane, GrpcPrefillLane, GrpcVerifyLane, wire_pools
from verifypd.v1 import control_pb2_grpc, generate_pb2, generate_pb2_grpc

log = logging.getLogger("verifypd.gateway")
SERVICES = ["verifypd.v1.Generation", "verifypd.v1.Control"]
DRAIN_RETRY_MS = 1000


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, engine: EngineLoop, codec, info: generate_pb2.ServerInfo, default_max_tokens: int):
        self.engine, self.codec, self.info = engine, codec, info
        self.default_max_tokens = default_max_tokens

    def Generate(self, request, context):
        t0 = time.monotonic()
        try:
            spec = convert.request_spec_from_pb(request, self.codec, max_context=self.info.max_context,
                                                default_max_tokens=self.default_max_tokens)
            stream = self.engine.submit(spec)
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Draining as exc:
            # gRPC's retry pushback: a client with a retry policy waits this long, then retries
            # (on another replica behind a load balancer; this one is going away).
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(DRAIN_RETRY_MS)),))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (Unavailable, TimeoutError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"server is not serving: {exc}")
        if not context.add_callback(lambda: self.engine.cancel(stream)):
            self.engine.cancel(stream)  # already cancelled before we could listen
            return
        while True:
            try:
                item = stream.queue.get(timeout=0.25)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if isinstance(item, Failure):
                context.abort(item.code, item.message)
            yield convert.response_to_pb(stream.request_id, item.token_ids, item.text, item.finish_reason,
                                         item.usage, item.applied_k, time.monotonic() - t0)
            if item.finished:
                return

    def GetServerInfo(self, request, context):
        return self.info


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, engine: EngineLoop):
        self.engine = engine

    def GetConfig(self, request, context):
        return convert.config_to_pb(self.engine.call(lambda router: router.config))

    def UpdateConfig(self, request, context):
        def apply(router: Router):
            # Runs between steps: the step after this one plans with the new config.
            new = router.config.updated(**convert.config_changes_from_pb(request.config, router.config))
            router.config = new
            self.engine.config_log.append((self.engine.steps, new.revision))
            log.info("config revision %d applied (by %r: %s): %s", new.revision, request.requested_by,
                     request.reason, new)
            return new
        try:
            return convert.config_to_pb(self.engine.call(apply))
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class Gateway:
    def __init__(self, router: Router, codec, info: generate_pb2.ServerInfo, *, host: str = "127.0.0.1",
                 port: int = 0, max_queue: int = 256, default_max_tokens: int = convert.DEFAULT_MAX_TOKENS,
                 lanes=(), on_close=(), watch_interval_s: float = 1.0, kv_transport: str = "auto",
                 recovery_timeout_s: float = 120.0, api_key: str | None = None):
        self.router, self.info = router, info
        self.codec, self.default_max_tokens = codec, default_max_tokens  # for the HTTP API (http_api.py)
        self.lanes = list(lanes)              # gRPC lane clients to watch and re-wire (split)
        self.kv_transport = kv_transport
        self.engine = EngineLoop(router, max_queue=max_queue, on_failure=self._on_failure,
                                 recover=self._rewire if self.lanes else None, recovery_timeout_s=recovery_timeout_s)
        workers = min(1024, max_queue + router.scheduler.max_running + 16)
        # Beyond `workers` concurrent RPCs gRPC itself answers RESOURCE_EXHAUSTED.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gw"),
                                  maximum_concurrent_rpcs=workers,
                                  interceptors=[api_key_interceptor(api_key)] if api_key else [])
        generate_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.engine, codec, info, default_max_tokens), self.server)
        control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(self.engine), self.server)
        self.health = add_health_and_reflection(self.server, SERVICES, serving=False)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.address = f"{host}:{self.port}"
        self._on_close = list(on_close)
        self._watch_interval_s = watch_interval_s
        self._stopped = threading.Event()
        self._started = False

    def start(self) -> "Gateway":
        if self._started:
            return self
        self._started = True
        self.engine.start()
        self.server.start()
        self.health.set(True)
        if self.lanes:
            threading.Thread(target=self._watch_lanes, name="lane-watchdog", daemon=True).start()
        return self

    def _on_failure(self, message: str) -> None:
        log.error("not serving any more: %s", message)
        self.health.set(False)

    def _watch_lanes(self) -> None:
        """A lane that dies while idle starts recovery too (a call to a dead lane fails by itself:
        the RPC ends with UNAVAILABLE). Repeated reports during one recovery are no-ops."""
        while not self._stopped.wait(self._watch_interval_s):
            for lane in self.lanes:
                if not lane.healthy(timeout_s=max(self._watch_interval_s, 1.0)) and not self._stopped.is_set():
                    self.engine.lane_lost(f"{lane.lane} lane at {lane.addr} is not serving")
                    break

    def _rewire(self) -> None:
        """Engine thread, during recovery: raises LaneError until every lane serves again; then
        re-reads the owners' pools (new ids and generations after a restart) and has the prefill
        lane import them. Old-generation handles are refused by the lanes from then on."""
        for lane in self.lanes:
            if not lane.healthy(timeout_s=1.0):
                raise LaneError(f"{lane.lane} lane at {lane.addr} is not serving yet")
        for lane in self.lanes:
            lane.describe_pb(refresh=True)
        self.wiring = wire_pools(*self.lanes, self.kv_transport)
        log.info("lanes re-wired: %s", dict(self.wiring.mode_by_pool))

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Graceful shutdown, phase by phase: NOT_SERVING and refuse new requests at once; let the
        requests in flight finish for up to `timeout_s`; then stop. True if none was cut short."""
        t0 = time.monotonic()
        self.health.set(False)
        self.engine.draining = True
        log.info("drain: started: health NOT_SERVING, new requests refused; %d in flight, waiting up to %.0f s",
                 self.engine.in_flight(), timeout_s)
        while self.engine.in_flight() and time.monotonic() - t0 < timeout_s:
            time.sleep(0.05)
        left = self.engine.in_flight()
        if left:
            log.warning("drain: timeout after %.1f s: ending %d requests with UNAVAILABLE", time.monotonic() - t0, left)
            self.engine.fail(f"server shut down before the request finished (drain timeout {timeout_s:.0f} s)")
        else:
            log.info("drain: all in-flight requests finished in %.1f s", time.monotonic() - t0)
        self.stop(grace_s=2.0)
        log.info("drain: stopped")
        return not left

    def wait(self) -> None:
        self.server.wait_for_termination()

    def stop(self, grace_s: float = 1.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.set(False)
        self.server.stop(grace_s).wait(grace_s + 1)
        self.engine.stop()
        for lane in self.lanes:
            lane.close()
        for fn in self._on_close:
            fn()

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def server_info(target: str, draft: str, topology: str, max_context: int) -> generate_pb2.ServerInfo:
    return generate_pb2.ServerInfo(target_model=target, draft_model=draft, topology=topology,
                                   max_context=max_context, version=__version__)


def build_colocated(options, *, observer=None, topology: str = "colocated", **gateway_kwargs) -> Gateway:
    """Models, pools and lanes in this process (verifypd.local_engine.Engine)."""
    from verifypd.local_engine import Engine

    engine = Engine(options, observer=observer)
    info = server_info(options.target, options.draft, topology, engine.router.max_context)
    gateway = Gateway(engine.router, engine.codec, info, **gateway_kwargs)
    gateway.local_engine = engine
    return gateway


def connect_lanes(addrs: dict[str, str], *, timeout_s: float = 60.0, ready_timeout_s: float = 120.0,
                  secret: str | None = None):
    lanes = (GrpcPrefillLane(addrs["prefill"], timeout_s, secret), GrpcDraftLane(addrs["draft"], timeout_s, secret),
             GrpcVerifyLane(addrs["verify"], timeout_s, secret))
    for lane in lanes:
        lane.wait_ready(ready_timeout_s)
    return lanes


def build_split(addrs: dict[str, str], options, *, kv_transport: str = "auto", observer=None, codec=None,
                lane_timeout_s: float = 60.0, topology: str = "split", lane_secret: str | None = None,
                **gateway_kwargs) -> Gateway:
    """Router over gRPC lane clients; the prefill lane imports (or stages) the owners' pools once
    (and again after a lane restart, see Gateway._rewire)."""
    prefill, draft, verify = connect_lanes(addrs, timeout_s=lane_timeout_s, secret=lane_secret)
    reply = wire_pools(prefill, draft, verify, kv_transport)
    log.info("lanes wired: %s (import %.3f s)", dict(reply.mode_by_pool), reply.import_seconds)
    if codec is None:
        codec = load_codec(options.target)
    verify_info = verify.describe_pb()
    router = Router(prefill, draft, verify, decode=codec.decode, eos_token_ids=tuple(verify_info.eos_token_ids),
                    config=options.config, max_running=options.max_running, observer=observer)
    info = server_info(options.target, options.draft, topology, router.max_context)
    gateway = Gateway(router, codec, info, lanes=(prefill, draft, verify), kv_transport=kv_transport,
                      **gateway_kwargs)
    gateway.wiring = reply
    return gateway


def load_codec(target: str):
    """The target's tokenizer without its weights (the split gateway loads no model)."""
    import os
    import pathlib

    from verifypd.model.loader import EMBEDDED_NAME, ModelLoadError, embedded_model_path
    from verifypd.tokenizer import TextCodec

    if target.startswith("random:"):
        return TextCodec(None)
    from transformers import AutoTokenizer

    kwargs: dict = {}
    if target == EMBEDDED_NAME or target.endswith(".gguf"):
        path = embedded_model_path() if target == EMBEDDED_NAME else pathlib.Path(target)
        source, kwargs["gguf_file"] = str(path.parent), path.name
    elif os.path.isdir(target):
        source = target
    else:
        source, kwargs["local_files_only"] = target, True
    try:
        return TextCodec(AutoTokenizer.from_pretrained(source, **kwargs))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {target!r}: {exc}") from exc

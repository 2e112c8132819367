"""The gateway: the public face of a server. One asyncio event loop (its own thread) runs the
grpc.aio server (Generation, Control, health, reflection), the OpenAI HTTP API (uvicorn on the
same loop, http_server.py), tokenization, detokenization and stop strings; no thread per stream.
The router runs in the engine core (core/core_server.py), reached over the core channel:

    verifypd serve          the core is its own process (core/process.py: CoreProcess)
    build_colocated/split   the core runs in threads of this process, over a socketpair all the
                            same (tests, benches): `gateway.router` / `gateway.core_loop` reach it
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

import grpc

from verifypd.core import assembly
from verifypd.core.channel import AsyncChannel, BlockingChannel
from verifypd.core.client import READY_TIMEOUT_S, CoreClient, Failure
from verifypd.core.core_server import CoreServer
from verifypd.core.loop import Draining, Overloaded, Unavailable
from verifypd.domain import convert
from verifypd.domain.requests import InvalidRequest
from verifypd.gateway import samples
from verifypd.gateway.request_errors import RequestErrors
from verifypd.gateway.response_wire import ResponseEncoder, add_generation_service
from verifypd.net.auth import gateway_interceptor
from verifypd.net.health import AsyncHealth
from verifypd.net.limits import GATEWAY_GRPC_OPTIONS, ConnectionLimits
from verifypd.net.wire_guard import AsyncWireGuard
from verifypd.v1 import control_pb2_grpc

if TYPE_CHECKING:
    from verifypd.core.assembly import ColocatedStack, SplitStack
    from verifypd.gateway.http_server import HttpServer

log = logging.getLogger("verifypd.gateway")
SERVICES = ["verifypd.v1.Generation", "verifypd.v1.Control"]
DRAIN_RETRY_MS = 1000


class GenerationServicer:
    def __init__(self, gateway: Gateway):
        self.gw = gateway

    async def Generate(self, request, context):
        t0 = time.monotonic()
        gw = self.gw
        try:
            spec = convert.request_spec_from_pb(
                request, gw.codec, max_context=gw.info.max_context, default_max_tokens=gw.default_max_tokens
            )
            count = samples.check_count(request.n)
            if count > 1:
                streams = await samples.submit_samples(
                    gw.client, spec, count, context.invocation_metadata(), "grpc", gw.share_prefix
                )
            else:
                stream = await gw.client.submit(spec, context.invocation_metadata(), "grpc")
        except InvalidRequest as exc:
            gw.errors.add("grpc", "INVALID_ARGUMENT", "invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            gw.errors.add("grpc", "RESOURCE_EXHAUSTED", "queue_full")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Draining as exc:
            gw.errors.add("grpc", "UNAVAILABLE", "draining")
            # gRPC's retry pushback: a client with a retry policy waits this long, then retries
            # (on another replica behind a load balancer; this one is going away).
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(DRAIN_RETRY_MS)),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (Unavailable, TimeoutError) as exc:
            gw.errors.add("grpc", "UNAVAILABLE", "not_serving")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"server is not serving: {exc}")
        if count > 1:
            async for message in self._samples(streams, context, t0):
                yield message
            return
        finished = False
        encoder = ResponseEncoder(stream.request_id)
        try:
            while not finished:
                # Everything since the last message: one message for several steps when behind.
                for item in await stream.box.take():
                    if isinstance(item, Failure):
                        finished = True
                        gw.errors.add("grpc", item.code.name, "failed")
                        await context.abort(item.code, item.message)
                    finished = item.finished
                    yield encoder.encode(
                        item.token_ids,
                        item.text,
                        item.finish_reason,
                        item.usage,
                        item.applied_k,
                        time.monotonic() - t0,
                        item.logprobs,
                    )
        finally:  # client cancel or deadline (the task is cancelled): free its KV before the next step
            if not finished:
                gw.client.cancel(stream)

    async def _samples(self, streams: list, context, t0: float):
        """The messages of n > 1 samples (gateway.samples), each naming its `choice_index`."""
        gw = self.gw
        encoders = [ResponseEncoder(s.request_id.rsplit("/", 1)[0], i) for i, s in enumerate(streams)]
        ended: set[int] = set()
        try:
            async for index, items in samples.interleaved(streams):
                for item in items:
                    if isinstance(item, Failure):
                        ended.add(index)
                        gw.errors.add("grpc", item.code.name, "failed")
                        await context.abort(item.code, item.message)
                    if item.finished:
                        ended.add(index)
                    yield encoders[index].encode(
                        item.token_ids,
                        item.text,
                        item.finish_reason,
                        item.usage,
                        item.applied_k,
                        time.monotonic() - t0,
                        item.logprobs,
                    )
        finally:  # cancel, deadline or a failed sample: free the others' KV
            for index, stream in enumerate(streams):
                if index not in ended:
                    gw.client.cancel(stream)

    async def GetServerInfo(self, request, context):
        return self.gw.info


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, gateway: Gateway):
        self.gw = gateway

    async def GetConfig(self, request, context):
        try:
            return await self.gw.client.get_config()
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def UpdateConfig(self, request, context):
        # Applied by the core between steps: the step after this one plans with the new config.
        try:
            return await self.gw.client.update_config(request.config, request.requested_by, request.reason)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


class Gateway:
    """`core_sock`: the gateway's end of the core channel. `core`: an in-process CoreServer (tests);
    `core_process`: a spawned one (serve). `start()` waits for the core's `ready`, then serves."""

    def __init__(
        self,
        core_sock: socket.socket,
        codec,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        default_max_tokens: int = convert.DEFAULT_MAX_TOKENS,
        api_key: str | None = None,
        admin_key: str | None = None,
        core: CoreServer | None = None,
        core_process=None,
        info=None,
        tls=None,
        limits: ConnectionLimits | None = None,
        share_prefix: bool | None = True,
    ):
        """`limits`: connections and idle timeouts of the gRPC port (net/limits.py; serve sizes them
        from the descriptor limit), None: the defaults of in-process gateways. `share_prefix`: the
        core caches prefixes, so samples of one prompt share its KV (gateway.samples); None: as the
        core's ready message says (a core in another process, whose lanes decide it)."""
        self._share_prefix = share_prefix
        self.codec, self.default_max_tokens = codec, default_max_tokens
        self.errors = RequestErrors()  # verifypd_request_errors_total, rendered by /metrics
        self._grpc_options = limits.gateway_grpc_options() if limits is not None else GATEWAY_GRPC_OPTIONS
        self.core, self.core_process = core, core_process
        self.info = info if info is not None else (core.info if core is not None else None)
        self.core_exited = threading.Event()  # set when the core went away (serve exits then)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-loop", daemon=True)
        self._thread.start()
        self._stopped = threading.Event()
        self._started = False
        self._open = False  # started and neither draining, stopped nor failed (health follows the core too)
        self.http: HttpServer | None = None  # an HttpServer on self.loop (serve): stopped first
        # build_colocated / build_split: the in-process core's stack (core.assembly)
        self.stack: ColocatedStack | SplitStack | None = None
        try:
            self._run(self._setup(core_sock, host, port, api_key, admin_key, tls))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro, timeout_s: float | None = None):
        """Runs a coroutine on the gateway's loop from another thread and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _setup(self, core_sock, host: str, port: int, api_key: str | None, admin_key: str | None, tls) -> None:
        """`tls`: a verifypd.net.tls.ServerTls (the port speaks only TLS) or None (plaintext)."""
        self.client = CoreClient(
            await AsyncChannel.open(core_sock),
            self.codec,
            on_failure=self._on_core_failure,
            on_state=self._refresh_health,
        )
        # Always installed: without an admin key, Control.UpdateConfig is refused (auth.gateway_access).
        self.server = grpc.aio.server(
            interceptors=[gateway_interceptor(api_key, admin_key), AsyncWireGuard()], options=self._grpc_options
        )
        add_generation_service(GenerationServicer(self), self.server)  # Generate yields wire bytes
        control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(self), self.server)
        self.health = AsyncHealth(self.server, SERVICES, self.loop)
        self.health.set(False)
        self.port = (
            self.server.add_secure_port(f"{host}:{port}", tls.grpc_credentials())
            if tls is not None
            else self.server.add_insecure_port(f"{host}:{port}")
        )
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.address = f"{host}:{self.port}"

    @property
    def share_prefix(self) -> bool:
        """Whether samples 1.. of a request wait for sample 0's first token (gateway.samples)."""
        if self._share_prefix is None:
            return self.client.prefix_cache
        return self._share_prefix

    # -- the in-process core (tests, benches) --------------------------------------------------
    @property
    def router(self):
        return self.core.router

    @property
    def lanes(self):
        return self.core.lanes

    @property
    def wiring(self):
        """Split: the prefill lane's last ImportPools reply (the in-process core's)."""
        return self.core.wiring

    @property
    def core_loop(self):
        """The in-process core's CoreLoop (tests read its state through `core_loop.call`)."""
        return self.core.loop

    # -- life cycle ----------------------------------------------------------------------------
    def start(self, ready_timeout_s: float | None = None) -> Gateway:
        if self._started:
            return self
        self._started = True
        if self.core is not None:
            self.core.start(loop_in_thread=True)

        async def serve() -> None:
            await self.client.wait_ready(ready_timeout_s or READY_TIMEOUT_S)
            self.info = self.info or self.client.info
            await self.server.start()

        self._run(serve())
        self._open = True
        self._refresh_health()
        return self

    def _refresh_health(self) -> None:
        """SERVING while started, not draining or stopped, and the core takes requests (core/client.py
        `admitting`: alive, heard from, no step stuck past --stall-timeout)."""
        self.health.set(self._open and self.client.admitting)

    def _on_core_failure(self, message: str, exited: bool) -> None:
        self._open = False
        self.health.set(False)
        if exited and not self._stopped.is_set():
            self.core_exited.set()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Graceful shutdown, phase by phase: NOT_SERVING and refuse new requests at once; let the
        requests in flight finish for up to `timeout_s`; then stop. True if none was cut short."""
        t0 = time.monotonic()
        # Refuse first, then say NOT_SERVING: a client that sees NOT_SERVING and sends a request must
        # be refused. (Set through the event loop, the flag could land after a request the loop took
        # meanwhile: a bool written from this thread is read by the loop's next submit.)
        self.client.draining = True
        self._open = False
        self.health.set(False)
        log.info(
            "drain: started: health NOT_SERVING, new requests refused; %d in flight, waiting up to %.0f s",
            self.client.in_flight(),
            timeout_s,
        )
        while self.client.in_flight() and time.monotonic() - t0 < timeout_s:
            time.sleep(0.05)
        left = self.client.in_flight()
        if left:
            log.warning("drain: timeout after %.1f s: ending %d requests with UNAVAILABLE", time.monotonic() - t0, left)
            message = f"server shut down before the request finished (drain timeout {timeout_s:.0f} s)"
            self.loop.call_soon_threadsafe(self.client.end_all, message)
        else:
            log.info("drain: all in-flight requests finished in %.1f s", time.monotonic() - t0)
        self.stop(grace_s=2.0)
        log.info("drain: stopped")
        return not left

    def wait(self) -> None:
        self._stopped.wait()

    def stop(self, grace_s: float = 1.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._open = False
        self.health.set(False)
        if self.http is not None:
            self.http.stop()
        try:
            self._run(self.server.stop(grace_s), timeout_s=grace_s + 5)
        except Exception:  # a stop that did not finish in time: the process is going away anyway
            log.exception("gRPC server stop")
        self.loop.call_soon_threadsafe(self.client.stop)
        if self.core is not None:
            self.core.stop()
        if self.core_process is not None:
            self.core_process.terminate()
        self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_tasks() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client = getattr(self, "client", None)
            if client is not None:  # the channel's transport (and its socket) with it
                client.channel.close()
                await asyncio.sleep(0)  # let the transport's close callback run

        try:
            self._run(cancel_tasks(), timeout_s=5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_router(
    router,
    codec,
    info,
    *,
    max_queue: int = 256,
    lanes=(),
    kv_transport: str = "auto",
    recovery_timeout_s: float = 120.0,
    on_close=(),
    metrics_registry=None,
    watch_interval_s: float = 1.0,
    lane_timeout_s: float = 60.0,
    stall_timeout_s: float = 10.0,
    on_hung=None,
    **gateway_kwargs,
) -> Gateway:
    """A gateway over a router whose core runs in threads of this process (one socketpair)."""
    gateway_sock, core_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    core = CoreServer(
        router,
        BlockingChannel(core_sock),
        info,
        max_queue=max_queue,
        lanes=lanes,
        kv_transport=kv_transport,
        recovery_timeout_s=recovery_timeout_s,
        on_close=on_close,
        metrics_registry=metrics_registry,
        watch_interval_s=watch_interval_s,
        lane_timeout_s=lane_timeout_s,
        stall_timeout_s=stall_timeout_s,
        on_hung=on_hung,
    )
    return Gateway(gateway_sock, codec, core=core, **gateway_kwargs)


def build_colocated(options, *, observer=None, topology: str = "colocated", **kwargs) -> Gateway:
    """Models, pools and lanes in this process (core.assembly.build_colocated), core in threads.
    The router does not detokenize: the gateway does. `gateway.stack` holds the stack."""
    stack = assembly.build_colocated(options, observer=observer, detokenize=False)
    kwargs.setdefault("share_prefix", options.prefix_cache)
    gateway = serve_router(stack.router, stack.codec, stack.info(topology), **kwargs)
    gateway.stack = stack
    return gateway


def build_split(
    addrs: dict[str, str],
    options,
    *,
    kv_transport: str = "auto",
    observer=None,
    codec=None,
    lane_timeout_s: float = 60.0,
    topology: str = "split",
    lane_secret: str | None = None,
    lane_tls=None,
    **kwargs,
) -> Gateway:
    """Router over gRPC lane clients (core in threads of this process). `lane_tls`: a
    verifypd.net.lane_tls.LaneTls (mutual TLS to the lanes) or None."""
    stack = assembly.build_split(
        addrs,
        options,
        kv_transport=kv_transport,
        observer=observer,
        lane_timeout_s=lane_timeout_s,
        topology=topology,
        lane_secret=lane_secret,
        lane_tls=lane_tls,
    )
    gateway = serve_router(
        stack.router,
        codec or load_codec(options.target),
        stack.info,
        lanes=stack.lanes,
        kv_transport=kv_transport,
        lane_timeout_s=lane_timeout_s,
        share_prefix=None,  # as the core says, as in `serve` (split caches with KV by handle only: core.assembly)
        **kwargs,
    )
    if gateway.core is None:
        raise RuntimeError("serve_router made a gateway without its in-process core")
    gateway.core.wiring = stack.wiring
    gateway.stack = stack
    return gateway


def load_codec(target: str):
    """The target's tokenizer without its weights (the gateway loads no model)."""
    import os
    import pathlib

    from verifypd.domain.models import EMBEDDED_NAME, ModelLoadError, embedded_model_path
    from verifypd.domain.tokenizer import TextCodec

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
        raise ModelLoadError(f"cannot load the tokenizer of {target!r}: {exc}") from None

"""Runs the HTTP API (http_api.py) with uvicorn on the gateway's event loop (beside the grpc.aio
server: one loop, no thread per request), and the Prometheus side of the telemetry.

`/metrics` shows the very instruments the OTLP exporter sends: `core.telemetry.prometheus_reader()` is one more
OpenTelemetry MetricReader on the same MeterProvider (opentelemetry-exporter-prometheus), which
translates names the standard way (`gen_ai.server.time_to_first_token` with unit s ->
`gen_ai_server_time_to_first_token_seconds`). Each gateway gets its own CollectorRegistry, so
several gateways in one process (tests) do not mix their metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from verifypd.domain.logs import rate_limited
from verifypd.net.limits import DEFAULT_IDLE_TIMEOUT_S, ConnectionLimits

if TYPE_CHECKING:
    from verifypd.net.tls import ServerTls

log = logging.getLogger("verifypd.http")
flood_log = rate_limited(logging.getLogger("verifypd.http.connections"))


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP API's listening socket, bound (not listening yet); OSError naming the flag and port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it a response's header and body writes meet delayed ACKs (~40 ms per request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"--http-port {port}: cannot bind the HTTP API to {host}:{port}: {exc.strerror or exc}") from None
    return sock


def guarded_protocol(limits: ConnectionLimits):
    """uvicorn's HTTP protocol (httptools, else h11: what http="auto" picks) with two guards uvicorn
    lacks: a connection over `limits.max_connections` is closed at once (its descriptor freed, so a
    flood cannot take them all), and one that has not sent a whole request head within
    `limits.idle_timeout_s` of connecting is closed (uvicorn's keep-alive timer starts only after a
    first response: an idle or slow-header connection otherwise stays open for ever)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: type = AutoHTTPProtocol

    class Guarded(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                flood_log.warning(
                    "HTTP: %d connections open (the limit): closing a new one from %s",
                    limits.max_connections,
                    self.client,
                )
                transport.close()
                return
            self.loop.call_later(limits.idle_timeout_s, self.first_request_deadline)

        def first_request_deadline(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                flood_log.info(
                    "HTTP: closed a connection from %s that sent no request in %.0f s",
                    self.client,
                    limits.idle_timeout_s,
                )
                self.transport.close()

    return Guarded


class HttpServer:
    """uvicorn serving an ASGI app on host:port (0 = any free port) on `loop` (the gateway's), or
    on a loop of its own in a daemon thread when none is given. `tls`: a verifypd.net.tls.ServerTls
    (HTTPS only, with client certificates when it has a client CA) or None (plain HTTP)."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        grace_s: float = 5.0,
        loop: asyncio.AbstractEventLoop | None = None,
        tls: ServerTls | None = None,
        sock: socket.socket | None = None,
        limits: ConnectionLimits | None = None,
    ):
        """`sock`: a socket `bind_http` bound already (serve binds every port before loading models);
        `limits`: connections and the first request's deadline (net/limits.py; None: its defaults)."""
        import uvicorn

        self.sock = sock if sock is not None else bind_http(host, port)
        self.port = self.sock.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self.url = f"{'https' if tls is not None else 'http'}://{'[' + host + ']' if ':' in host else host}:{self.port}"
        # lifespan off: nothing to set up; h11 (pure Python) unless httptools is installed ("auto").
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # uvicorn annotates int, but passes it to asyncio.wait_for as a timeout: seconds, any float
            timeout_graceful_shutdown=grace_s,  # type: ignore[arg-type]
            http=guarded_protocol(limits or ConnectionLimits(1024, DEFAULT_IDLE_TIMEOUT_S)),
            loop="asyncio",
            **(tls.uvicorn_options() if tls is not None else {}),
        )
        self.server = uvicorn.Server(config)
        self.tls = tls
        self.loop = loop
        self.thread = threading.Thread(target=self._run, name="verifypd-http", daemon=True) if loop is None else None
        self._future: concurrent.futures.Future[None] | None = None
        self.server_loop: asyncio.AbstractEventLoop | None = None  # the thread's own loop, when no `loop` is given
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._serve_here())
        except BaseException as exc:  # reported by start()/logged; the gRPC side keeps running
            self._error = exc
            log.exception("HTTP server stopped")

    async def _serve_here(self) -> None:
        self.server_loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    def _alive(self) -> bool:
        if self.thread is not None:
            return self.thread.is_alive()
        return self._future is not None and not self._future.done()

    def start(self, timeout_s: float = 10.0) -> HttpServer:
        if self.thread is not None:
            self.thread.start()
        else:
            assert self.loop is not None  # __init__ makes a thread exactly when no loop is given
            self._future = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[self.sock]), self.loop)
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._alive() or time.monotonic() > deadline:
                if self._future is not None and self._future.done():
                    self._error = self._future.exception()
                raise RuntimeError(f"the HTTP server did not start: {self._error!r}")
            time.sleep(0.01)
        if self.tls is not None:
            self._watch_certificate(self.tls)
        return self

    def _watch_certificate(self, tls: ServerTls) -> None:
        """A rotated certificate (files replaced) serves the next handshakes; open connections
        keep theirs. Runs on the server's loop, the only user of its SSLContext."""
        from verifypd.net.tls import RELOAD_CHECK_S, FileStamp

        watch = FileStamp((tls.cert_file, tls.key_file, tls.client_ca_file), check_s=0.0)
        loop = self.loop or self.server_loop
        if loop is None:  # the thread sets server_loop before its server starts, and start() waits for that
            raise RuntimeError("the HTTP server has no event loop yet: watch its certificate once it started")
        context = self.server.config.ssl  # made by uvicorn when it loaded the config (started, with TLS options)
        if context is None:
            raise RuntimeError("the HTTP server serves no TLS: it has no certificate to watch")

        def check() -> None:
            if self.server.should_exit:
                return
            tls.reload_into(context, watch)
            loop.call_later(RELOAD_CHECK_S, check)

        loop.call_soon_threadsafe(loop.call_later, RELOAD_CHECK_S, check)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops accepting; in-flight requests get `grace_s`, then their tasks are cancelled
        (which aborts their engine requests)."""
        self.server.should_exit = True
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(timeout_s)
        if self._future is not None:
            try:
                self._future.result(timeout_s)
            except Exception:  # stopped or failed: the socket goes either way
                pass
        self.sock.close()

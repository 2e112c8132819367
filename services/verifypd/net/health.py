"""Standard gRPC health checking and server reflection, on every verifypd server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


class Health:
    """The health servicer plus the names it reports on ("" = the whole server)."""

    def __init__(self, servicer: health.HealthServicer, services: list[str]):
        self.servicer = servicer
        self.services = ["", *services]
        self.serving = False

    def set(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.services:
            self.servicer.set(name, status)


def add_health_and_reflection(server: grpc.Server, services: list[str], serving: bool = True) -> Health:
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*services, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    h = Health(servicer, services)
    h.set(serving)
    return h


class AsyncHealth:
    """Health of a grpc.aio server: `set` may be called from any thread; the servicer is updated
    on the server's event loop."""

    def __init__(self, server: grpc.aio.Server, services: list[str], loop: asyncio.AbstractEventLoop):
        from grpc_health.v1 import _async

        self.servicer, self.loop = _async.HealthServicer(), loop
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection([*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        self.services = ["", *services]
        self.serving = False

    def set(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def apply() -> None:
            for name in self.services:
                await self.servicer.set(name, status)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.loop.create_task(apply())
        elif not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(apply(), self.loop)


class HealthPort:
    """A plaintext HTTP port for the kubelet's probes when the server's own ports speak TLS (the
    kubelet's gRPC probe cannot do TLS, and its HTTPS probe presents no client certificate).

    It answers `GET <path>` for each path in `checks` (path -> () -> (ok, reason)) with 200 or
    503 and a one-line JSON body, and nothing else (404): no request data, no keys, nothing but
    the serving state that gRPC health already tells anyone. Bound on the server's --host (the
    kubelet probes the pod IP); a daemon thread of its own."""

    def __init__(self, host: str, port: int, checks: dict):
        import http.server
        import json
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                check = checks.get(self.path.split("?", 1)[0])
                if check is None:
                    ok, body = False, {"error": "not found"}
                    code = 404
                else:
                    ok, reason = check()
                    code, body = (200 if ok else 503), {"status": "serving" if ok else "not_serving", "reason": reason}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # probes every few seconds: not worth a log line each
                pass

        server_class = http.server.ThreadingHTTPServer
        if ":" in host:
            import socket

            class HealthServer6(http.server.ThreadingHTTPServer):
                address_family = socket.AF_INET6

            server_class = HealthServer6
        try:
            self.server = server_class((host.strip("[]"), port), Handler)
        except OSError as exc:
            raise OSError(f"cannot bind the health port {host}:{port}: {exc.strerror or exc}") from None
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="health-port", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serving_check(health) -> Callable[[], tuple[bool, str]]:
    """A HealthPort check reading a Health / AsyncHealth's state (its `serving`)."""
    return lambda: (health.serving, "serving" if health.serving else "not serving")

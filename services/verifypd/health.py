"""Standard gRPC health checking and server reflection, on every verifypd server."""
from __future__ import annotations

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

    def __init__(self, server: grpc.aio.Server, services: list[str], loop):
        from grpc_health.v1 import _async

        self.servicer, self.loop = _async.HealthServicer(), loop
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection([*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        self.services = ["", *services]
        self.serving = False

    def set(self, serving: bool) -> None:
        import asyncio

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

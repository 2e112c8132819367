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

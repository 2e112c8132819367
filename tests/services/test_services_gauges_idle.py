"""Telemetry gauges follow the engine down: after a cancel, and while idle, KV blocks in use and
lane queue depths read 0, not the last busy step's values."""
from __future__ import annotations

import grpc
import pytest

from services_helpers import Client, engine_options, greedy_request, wait_until
from services_helpers import tiny_models  # noqa: F401 (a fixture)
from verifypd.v1 import generate_pb2


def gauge_values(reader, name: str) -> dict[str, float]:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    for p in m.data.data_points:
                        out[",".join(str(v) for v in p.attributes.values())] = p.value
    return out


def test_gauges_drop_to_zero_after_cancel_and_when_idle(tiny_models):
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from verifypd import metric_names as mn
    from verifypd.gateway.server import build_colocated
    from verifypd.core.telemetry import Telemetry

    reader = InMemoryMetricReader()
    with build_colocated(engine_options(*tiny_models), observer=Telemetry(readers=[reader])) as gw:
        client = Client(gw.address)
        call = client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request(list(range(3, 40)), 200)),
                                   timeout=60)
        next(call)
        assert any(v > 0 for v in gauge_values(reader, mn.KV_BLOCKS_IN_USE).values())
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)
        assert wait_until(lambda: set(gauge_values(reader, mn.KV_BLOCKS_IN_USE).values()) == {0}, 5)
        assert wait_until(lambda: set(gauge_values(reader, mn.LANE_QUEUE_DEPTH).values()) == {0}, 5)
        client.close()

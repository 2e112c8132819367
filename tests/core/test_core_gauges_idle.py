"""Telemetry gauges follow the engine down: after a cancel, and while idle, KV blocks in use and
lane queue depths read 0, not the last busy step's values."""

from __future__ import annotations

import grpc
import pytest
from services_helpers import (
    Client,
    engine_options,
    greedy_request,
    wait_until,
)

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

    from verifypd.core.telemetry import Telemetry
    from verifypd.domain import metric_names as mn
    from verifypd.gateway.server import build_colocated

    reader = InMemoryMetricReader()
    with build_colocated(engine_options(*tiny_models), observer=Telemetry(readers=[reader])) as gw:
        client = Client(gw.address)
        call = client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request(list(range(3, 40)), 200)), timeout=60)
        next(call)
        assert any(v > 0 for v in gauge_values(reader, mn.KV_BLOCKS_IN_USE).values())
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)
        assert wait_until(lambda: set(gauge_values(reader, mn.KV_BLOCKS_IN_USE).values()) == {0}, 30)
        assert wait_until(lambda: set(gauge_values(reader, mn.LANE_QUEUE_DEPTH).values()) == {0}, 30)
        client.close()


def _points(reader, name: str) -> list:
    return [
        p
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
        for p in m.data.data_points
    ]


def test_verify_items_reach_the_instruments_once_per_step_with_exact_sums():
    """Telemetry.on_verify runs per verify item on the engine thread; the instruments are called
    once per step (on_step), and the draft / accepted counters still sum every item."""
    from types import SimpleNamespace

    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from verifypd.core.telemetry import Telemetry
    from verifypd.domain import metric_names as mn

    reader = InMemoryMetricReader()
    telemetry = Telemetry(readers=[reader])
    router = SimpleNamespace(
        scheduler=SimpleNamespace(running=[], num_waiting=0),
        target_blocks=SimpleNamespace(num_used=0),
        draft_blocks=None,
    )
    calls = {"record": 0, "add": 0}
    for name, method in (("applied_k", "record"), ("draft_tokens", "add"), ("accepted_tokens", "add")):
        inner = getattr(getattr(telemetry, name), method)

        def counted(*a, _inner=inner, _method=method, **kw):
            calls[_method] += 1
            return _inner(*a, **kw)

        setattr(telemetry, name, SimpleNamespace(**{method: counted}))
    steps = [[(3, 2)] * 50 + [(1, 1)] * 10 + [(0, 0)] * 4, [(0, 0)] * 64, [(4, 0), (4, 4)]]
    for items in steps:
        for k, accepted in items:
            telemetry.on_verify(k, accepted)
        telemetry.on_step(router)
    assert calls == {"record": 3 + 1 + 1, "add": 2 + 0 + 2}  # distinct ks per step; two counters per drafting step
    total = lambda name: sum(p.value for p in _points(reader, name))  # noqa: E731
    assert total(mn.DRAFT_TOKENS) == 50 * 3 + 10 + 8
    assert total(mn.ACCEPTED_TOKENS) == 50 * 2 + 10 + 4
    assert sum(p.count for p in _points(reader, mn.APPLIED_K)) == 5

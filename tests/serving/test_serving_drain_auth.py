"""Graceful drain on SIGTERM (`verifypd serve` as a subprocess) and the gateway's optional API key
(the admin key of Control: test_gateway_control_access.py)."""

from __future__ import annotations

import signal
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from services_helpers import (
    BLOCK_SIZE,
    MAX_CONTEXT,
    Client,
    Server,
    engine_options,
    free_port,
    greedy_request,
    wait_until,
)

from verifypd.v1 import control_pb2, generate_pb2

API_KEY = "test-api-key-0123456789"


def test_api_key_guards_generation_and_control_not_health(tiny_models, capsys):
    from verifypd.cli import main
    from verifypd.gateway.server import build_colocated

    with build_colocated(engine_options(*tiny_models), api_key=API_KEY) as gw:
        client = Client(gw.address)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)):
            with pytest.raises(grpc.RpcError) as err:
                list(
                    client.gen.Generate(
                        generate_pb2.GenerateRequest(**greedy_request([5, 6], 4)), metadata=metadata, timeout=30
                    )
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                client.control.GetConfig(control_pb2.GetConfigRequest(), metadata=metadata, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:  # no admin key configured: nobody may change it
                client.control.UpdateConfig(control_pb2.UpdateConfigRequest(), metadata=metadata, timeout=30)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "admin key" in err.value.details()
        assert client.health_status() == health_pb2.HealthCheckResponse.SERVING  # probes carry no key
        good = (("authorization", f"Bearer {API_KEY}"),)
        msgs = list(
            client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request([5, 6], 4)), metadata=good, timeout=30)
        )
        assert sum(len(m.token_ids) for m in msgs) == 4
        client.close()
        # The CLI client sends the key it is given.
        assert main(["generate", "--server", gw.address, "--raw", "--max-tokens", "3", "w5"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert (
            main(
                ["generate", "--server", gw.address, "--raw", "--max-tokens", "3", "--api-key", API_KEY, "--json", "w5"]
            )
            == 0
        )


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits(tiny_models):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--port",
        str(port),
        "--target",
        tiny_models[0],
        "--draft",
        tiny_models[1],
        "--device",
        "cpu",
        "--num-blocks",
        "256",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-context",
        str(MAX_CONTEXT),
        "--drain-timeout",
        "60",
        "--http-port",
        "0",
    ]
    server = Server(cmd, echo=False)
    proc, lines, ready = server.proc, server.lines, server.ready
    try:
        assert ready.wait(120), "".join(lines[-20:])
        client = Client(f"127.0.0.1:{port}")
        calls = [
            client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request([5 + n, 6, 7], 200)), timeout=120)
            for n in range(6)
        ]
        firsts = [next(c) for c in calls]  # all six are streaming
        results = {}

        def drain(n):
            try:
                results[n] = sum(len(m.token_ids) for m in [firsts[n], *calls[n]])
            except grpc.RpcError as exc:
                results[n] = exc.code()

        readers = [threading.Thread(target=drain, args=(n,)) for n in range(6)]
        for t in readers:
            t.start()
        proc.send_signal(signal.SIGTERM)
        # NOT_SERVING alone could be a step past --stall-timeout on a loaded machine: wait for the drain
        assert wait_until(lambda: "drain: started" in "".join(lines), 30), "".join(lines[-20:])
        assert client.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            client.generate(**greedy_request([5, 6], 5), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
        assert ("grpc-retry-pushback-ms", "1000") in tuple(err.value.trailing_metadata())
        for t in readers:
            t.join(90)
        assert results == {n: 200 for n in range(6)}, "in-flight requests were cut short by the drain"
        assert proc.wait(30) == 0
        log = "".join(lines)
        for phase in ("received SIGTERM", "drain: started", "drain: all in-flight requests finished", "drain: stopped"):
            assert phase in log, phase
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        time.sleep(0)

"""The engine-core channel (core_channel.py, engine_core.py, engine_client.py): one message per
engine step for all requests, per-request order, cancel races, a client id reused right after a
cancel, stop strings applied in the gateway, and an engine-core process that dies: every request
ends with UNAVAILABLE at once, health goes NOT_SERVING and `verifypd serve` exits."""

from __future__ import annotations

import os
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
    offline_outputs,
    random_prompts,
    wait_until,
)

from verifypd.domain.requests import RequestSpec
from verifypd.v1 import generate_pb2


class CountingChannel:
    """Wraps the core's BlockingChannel: counts `step` messages and rows per message."""

    def __init__(self, inner):
        self.inner, self.step_messages, self.rows = inner, 0, []

    def send(self, msg: dict) -> None:
        if msg["t"] == "step":
            self.step_messages += 1
            self.rows.append(len(msg["out"]))
        self.inner.send(msg)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def gateway(tiny_models):
    from verifypd.gateway.server import build_colocated

    gw = build_colocated(engine_options(*tiny_models))
    gw.core.channel = CountingChannel(gw.core.channel)
    yield gw.start()
    gw.stop()


@pytest.fixture()
def client(gateway):
    c = Client(gateway.address)
    yield c
    c.close()


@pytest.mark.slow
def test_one_message_per_step_carries_every_request_in_order(tiny_models, gateway, client):
    prompts = random_prompts(6, seed=3)
    expected = offline_outputs(
        engine_options(*tiny_models), [RequestSpec(tuple(p), max_tokens=20, stop_at_eos=False) for p in prompts]
    )
    channel = gateway.core.channel
    steps0, messages0 = gateway.core_loop.steps, channel.step_messages
    results: dict[int, list[int]] = {}
    barrier = threading.Barrier(len(prompts))

    def run(n: int) -> None:
        barrier.wait()
        results[n], _ = client.generate(**greedy_request(prompts[n], max_tokens=20))

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[n] for n in range(len(prompts))] == expected  # every token, in order, to its request
    steps, messages = gateway.core_loop.steps - steps0, channel.step_messages - messages0
    assert messages == steps, "a step must send exactly one message (steps with output)"
    assert max(channel.rows[messages0:]) > 1, "concurrent requests must share step messages"


def test_cancel_before_added_and_while_streaming_frees_everything(gateway, client):
    prompt = random_prompts(1, seed=4)[0]
    for wait_s in (0.0, 0.0, 0.005, 0.02, 0.05):  # cancels racing the add, the first step, later steps
        call = client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request(prompt, max_tokens=200)), timeout=30)
        time.sleep(wait_s)
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    assert wait_until(lambda: gateway.client.in_flight() == 0, 30)
    assert wait_until(
        lambda: gateway.core_loop.call(lambda r: (r.target_blocks.num_used, len(r.sequences()))) == (0, 0), 5
    )


def test_client_id_reused_right_after_cancel_gets_only_its_own_tokens(tiny_models, gateway, client):
    first, second = random_prompts(2, seed=5)
    expected = offline_outputs(
        engine_options(*tiny_models), [RequestSpec(tuple(second), max_tokens=16, stop_at_eos=False)]
    )[0]
    for _ in range(3):
        call = client.gen.Generate(
            generate_pb2.GenerateRequest(**greedy_request(first, max_tokens=200), request_id="same"), timeout=30
        )
        next(call)  # streaming: the core is stepping it right now
        call.cancel()
        assert wait_until(lambda: gateway.client.in_flight() == 0, 30)
        ids, msgs = client.generate(**greedy_request(second, max_tokens=16), request_id="same")
        assert ids == expected and {m.request_id for m in msgs} == {"same"}


def test_stop_string_is_applied_by_the_gateway(client):
    words = client.generate(text="w5 w6 w7", max_tokens=12, stop_at_eos=False)[1]
    text = "".join(m.text for m in words).split()
    stop = text[3]
    ids, msgs = client.generate(text="w5 w6 w7", max_tokens=12, stop_at_eos=False, stop=[stop])
    assert msgs[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
    assert "".join(m.text for m in msgs).split() == text[: text.index(stop)]


@pytest.mark.slow
def test_engine_core_process_crash_fails_requests_and_serve_exits(tiny_models):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--port",
        str(port),
        "--http-port",
        "0",
        "--target",
        tiny_models[0],
        "--draft",
        tiny_models[1],
        "--device",
        "cpu",
        "--num-blocks",
        "64",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-context",
        str(MAX_CONTEXT),
    ]
    server = Server(cmd, echo=False)
    try:
        assert server.ready.wait(180), "".join(server.lines[-30:])
        core_pid = int(next(ln for ln in server.lines if "engine core pid" in ln).rsplit("pid ", 1)[1].rstrip(")\n"))
        c = Client(f"127.0.0.1:{port}")
        outcomes: list = []
        started = threading.Event()

        def stream(prompt) -> None:
            try:
                for _ in c.gen.Generate(
                    generate_pb2.GenerateRequest(**greedy_request(prompt, max_tokens=240)), timeout=120
                ):
                    started.set()
                outcomes.append(("finished", ""))
            except grpc.RpcError as exc:
                outcomes.append((exc.code(), exc.details()))

        readers = [threading.Thread(target=stream, args=(p,)) for p in random_prompts(8, seed=6, max_len=8)]
        for r in readers:
            r.start()
        assert started.wait(60)
        os.kill(core_pid, signal.SIGSTOP)  # frozen mid-stream: the requests in flight wait on it
        late = [threading.Thread(target=stream, args=([5, 6, 7],)) for _ in range(2)]  # adds nobody answers
        for r in late:
            r.start()
        time.sleep(0.5)
        os.kill(core_pid, signal.SIGKILL)
        for r in readers + late:
            r.join(30)
        assert not any(r.is_alive() for r in readers + late), "a request hung after the engine core died"
        failed = [o for o in outcomes if o[0] != "finished"]
        assert len(failed) >= 2 and all(
            code == grpc.StatusCode.UNAVAILABLE and "engine-core process exited" in details for code, details in failed
        ), outcomes
        assert server.proc.wait(30) == 1, "serve must exit (non-zero) when its engine core is gone"
        assert any("exiting" in ln for ln in server.lines)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_health_not_serving_after_core_loss_in_process(tiny_models):
    """The in-process core stopped under the gateway: new requests get UNAVAILABLE, health NOT_SERVING."""
    from verifypd.gateway.server import build_colocated

    gw = build_colocated(engine_options(*tiny_models)).start()
    try:
        c = Client(gw.address)
        assert c.health_status() == health_pb2.HealthCheckResponse.SERVING
        gw.core.channel.close()  # the core's end goes away, as when its process dies
        assert wait_until(lambda: c.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING, 30)
        with pytest.raises(grpc.RpcError) as err:
            c.generate(**greedy_request([5, 6], max_tokens=4))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        c.close()
    finally:
        gw.stop()

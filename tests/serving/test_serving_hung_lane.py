"""A lane process that lives but stops answering (SIGSTOP), under `verifypd serve --topology split`.

The supervisor must treat it as dead once its health checks have failed for --lane-timeout: kill
it (SIGKILL), restart it, and recover the requests in flight, which finish OK with the fault-free
tokens. Meanwhile the engine core's step is stuck on it, so health says NOT_SERVING (the core takes
no request), and a request sent then waits and completes instead of failing.
"""

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
    wait_until,
)

from verifypd.domain.requests import RequestSpec
from verifypd.v1 import generate_pb2

pytestmark = pytest.mark.slow  # `verifypd serve --topology split`, a lane process stopped (tests/README.md)

LANE_TIMEOUT_S = 4
RECOVERY_TIMEOUT_S = 60  # generous: a lane restarts in ~20 s on a loaded 2-core machine
STOPPED_S = 75  # without the kill the lane would resume only now: after the recovery timed out


def split_cmd(tiny_models, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--topology",
        "split",
        "--port",
        str(port),
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
        "--max-running",
        "4",
        "--k-initial",
        "4",
        "--no-adaptive",
        "--lane-timeout",
        str(LANE_TIMEOUT_S),
        "--recovery-timeout",
        str(RECOVERY_TIMEOUT_S),
        "--stall-timeout",
        "1",
        "--http-port",
        "0",
        "--drain-timeout",
        "2",
    ]


def run(client: Client, prompt: list[int], max_tokens: int, out: dict, key, streaming=None) -> None:
    chunks, code = [], grpc.StatusCode.OK
    try:
        for msg in client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request(prompt, max_tokens)), timeout=240):
            chunks.append(msg)
            if streaming is not None:
                streaming.set()
    except grpc.RpcError as exc:
        code = exc.code()
    out[key] = (code, [t for m in chunks for t in m.token_ids])


def test_a_stopped_lane_is_killed_restarted_and_loses_no_request(tiny_models):
    prompts = {"long": [5, 6, 7, 8], "late": [9, 10, 11]}
    tokens = {"long": 240, "late": 8}
    expected = dict(
        zip(
            prompts,
            offline_outputs(
                engine_options(*tiny_models),
                [RequestSpec(tuple(prompts[k]), max_tokens=tokens[k], stop_at_eos=False) for k in prompts],
            ),
            strict=True,
        )
    )
    port = free_port()
    server = Server(split_cmd(tiny_models, port)).wait_ready()
    client = Client(f"127.0.0.1:{port}")
    stopped_pid = server.lane_pids()["verify"]
    out: dict = {}
    try:
        streaming = threading.Event()
        long = threading.Thread(target=run, args=(client, prompts["long"], tokens["long"], out, "long", streaming))
        long.start()
        assert streaming.wait(60)  # in flight from here on (240 tokens: far from done)
        os.kill(stopped_pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        # The core's step waits on the stopped lane: it takes no request, and health says so.
        assert wait_until(lambda: client.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING, 20), (
            "health stayed SERVING while the engine core was stuck on a stopped lane"
        )
        late = threading.Thread(target=run, args=(client, prompts["late"], tokens["late"], out, "late"))
        late.start()  # sent while the core is stuck: must wait, then complete
        restarted = wait_until(lambda: server.lane_pids()["verify"] != stopped_pid, STOPPED_S)
        took = time.monotonic() - t_stop
        assert restarted, f"the stopped verify lane was not killed and restarted within {STOPPED_S} s"
        long.join(240)
        late.join(240)
        assert out["long"] == (grpc.StatusCode.OK, expected["long"]), "the request in flight was lost or changed"
        assert out["late"] == (grpc.StatusCode.OK, expected["late"]), "the request sent during the stall failed"
        assert wait_until(lambda: client.health_status() == health_pb2.HealthCheckResponse.SERVING, 30)
        assert server.count(r"verify lane \(pid \d+\) is alive but does not answer: killing it") == 1
        assert server.count(r"not serving any more") == 0
        print(f"verify lane stopped -> restarted after {took:.1f} s")
    finally:
        if is_lane(stopped_pid):  # never leave a stopped lane behind, whatever failed
            os.kill(stopped_pid, signal.SIGCONT)
        client.close()
        server.stop()


def is_lane(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"verifypd.cli\0lane" in f.read()
    except OSError:
        return False

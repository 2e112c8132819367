"""`verifypd serve --topology split` as a user runs it, and what happens when a lane process dies:
in-flight requests end with UNAVAILABLE in bounded time, health turns NOT_SERVING, and the lane
children go away with the server."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services_helpers import BLOCK_SIZE, MAX_CONTEXT, Client, free_port, greedy_request, wait_until
from services_helpers import tiny_models  # noqa: F401 (a fixture)
from verifypd.server.launcher import child_env
from verifypd.v1 import generate_pb2


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def shm_pool_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("verifypd-")}


@pytest.fixture(scope="module")
def split_server(tiny_models):
    shm_before = shm_pool_files()
    port = free_port()
    cmd = [sys.executable, "-m", "verifypd.cli", "serve", "--topology", "split", "--port", str(port),
           "--target", tiny_models[0], "--draft", tiny_models[1], "--device", "cpu", "--num-blocks", "64",
           "--block-size", str(BLOCK_SIZE), "--max-context", str(MAX_CONTEXT), "--max-running", "2",
           "--k-initial", "4", "--no-adaptive", "--http-port", "0"]
    proc = subprocess.Popen(cmd, env=child_env(), stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            sys.stderr.write(line)
            if "verifypd: serving" in line:
                ready.set()
    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(180):
        proc.kill()
        pytest.fail("server did not start:\n" + "".join(lines[-30:]))
    pids = {m.group(1): int(m.group(2)) for m in (re.search(r"verifypd: (\w+) lane pid=(\d+)", ln) for ln in lines) if m}
    assert set(pids) == {"prefill", "draft", "verify"}
    yield f"127.0.0.1:{port}", pids, proc, shm_before
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    for pid in pids.values():
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_cli_client_against_split_server(split_server, capsys):
    from verifypd.cli import main

    address, *_ = split_server
    assert main(["generate", "--server", address, "--raw", "--json", "--max-tokens", "12", "w9 w10 w11"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] in ("length", "eos") and 1 <= len(out["token_ids"]) <= 12


def test_dead_lane_ends_in_flight_requests_with_unavailable(split_server):
    address, pids, proc, shm_before = split_server
    client = Client(address)
    # 6 long requests, 2 running at a time: plenty still in flight when the lane dies.
    calls = [client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request([5 + n, 6, 7], 200)), timeout=60)
             for n in range(6)]
    results: dict[int, object] = {}

    def drain(n):
        try:
            list(calls[n])
            results[n] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            results[n] = exc.code()
    threads = [threading.Thread(target=drain, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    assert wait_until(lambda: client.health_status() == health_pb2.HealthCheckResponse.SERVING, 5)
    time.sleep(0.3)  # requests are decoding now
    os.kill(pids["draft"], signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(15)
    assert time.monotonic() - killed_at < 15, "requests hung after the lane died"
    assert len(results) == 6
    assert grpc.StatusCode.UNAVAILABLE in results.values()
    assert set(results.values()) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
    assert wait_until(lambda: client.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
    with pytest.raises(grpc.RpcError) as err:  # new requests fail fast too
        client.generate(**greedy_request([5, 6], 5), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    client.close()
    # The server exits on SIGTERM and takes the remaining lanes with it.
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)
    assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 15)
    assert shm_pool_files() == shm_before, "KV pool files left in /dev/shm"

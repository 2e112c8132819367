"""`verifypd serve --topology split` as a user runs it, and what happens when lane processes die.

* Recovery: under closed-loop load each lane type is SIGKILLed once; the supervisor restarts it,
  the gateway re-wires the pools and re-prefills the requests in flight. Every request completes
  OK with exactly max_tokens tokens, equal to a run without faults, and no client stream repeats
  or skips a token.
* Crash loop: a lane killed again and again is given up on: one log line, in-flight requests
  UNAVAILABLE, health NOT_SERVING; SIGTERM still stops the server, its lanes and their /dev/shm
  files.
"""

from __future__ import annotations

import glob
import os
import pathlib
import signal
import subprocess
import sys
import threading
import urllib.request

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

pytestmark = pytest.mark.slow  # `verifypd serve --topology split`, its lane processes killed (tests/README.md)

MAX_TOKENS = 24
CONCURRENCY = 4
REQUESTS = 30


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


def left_behind(files: set[str]) -> set[str]:
    """The pool files no living process maps: what a dead lane left. (Another verifypd on the same
    machine, e.g. a concurrent test run, creates and maps pool files of its own meanwhile.)"""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            text = pathlib.Path(maps).read_text()
        except OSError:
            continue
        mapped.update(name for name in files if name in text)
    return files - mapped


@pytest.fixture(scope="module")
def split_server(tiny_models):
    shm_before = shm_pool_files()
    port, http_port = free_port(), free_port()
    cmd = [
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
        "--max-lane-restarts",
        "3",
        "--recovery-timeout",
        "90",
        "--http-port",
        str(http_port),
    ]
    server = Server(cmd)
    server.http_port = http_port  # /metrics
    if not server.ready.wait(180):
        server.proc.kill()
        pytest.fail("server did not start:\n" + "".join(server.lines[-30:]))
    assert set(server.lane_pids()) == {"prefill", "draft", "verify"}
    all_pids: set[int] = set()
    yield f"127.0.0.1:{port}", server, shm_before, all_pids
    all_pids.update(server.lane_pids().values())
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(40)
        except subprocess.TimeoutExpired:
            server.proc.kill()
    for pid in all_pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_cli_client_against_split_server(split_server, capsys):
    from verifypd.cli import main

    address, *_ = split_server
    assert main(["generate", "--server", address, "--raw", "--json", "--max-tokens", "12", "w9 w10 w11"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] in ("length", "eos") and 1 <= len(out["token_ids"]) <= 12


def closed_loop(address: str, prompts: list[list[int]], results: dict, stop: threading.Event):
    """CONCURRENCY workers each send the next prompt as soon as their last one ended."""
    lock = threading.Lock()
    todo = list(enumerate(prompts))

    def worker():
        client = Client(address)
        while not stop.is_set():
            with lock:
                if not todo:
                    break
                n, prompt = todo.pop(0)
            chunks, code = [], grpc.StatusCode.OK
            try:
                for msg in client.gen.Generate(
                    generate_pb2.GenerateRequest(**greedy_request(prompt, MAX_TOKENS)), timeout=240
                ):
                    chunks.append(msg)
            except grpc.RpcError as exc:
                code = exc.code()
            results[n] = (code, chunks)
        client.close()

    return [threading.Thread(target=worker) for _ in range(CONCURRENCY)]


def test_each_lane_killed_mid_run_loses_no_request_and_no_token(split_server, tiny_models):
    address, server, _, all_pids = split_server
    prompts = random_prompts(REQUESTS, seed=11, max_len=20)
    expected = offline_outputs(
        engine_options(*tiny_models), [RequestSpec(tuple(p), max_tokens=MAX_TOKENS, stop_at_eos=False) for p in prompts]
    )
    results: dict[int, tuple] = {}
    stop = threading.Event()
    workers = closed_loop(address, prompts, results, stop)
    for t in workers:
        t.start()
    killed = []
    try:
        for n, lane in enumerate(("draft", "verify", "prefill")):
            # Mid-run: requests are streaming (some done, more to come), and no recovery is under way.
            assert wait_until(lambda n=n: len(results) >= 4 + 7 * n, 120), f"no progress before killing {lane}"
            assert wait_until(lambda: not server.recovering(), 120), "a recovery did not end"
            before, pid = server.recoveries(), server.lane_pids()[lane]
            all_pids.add(pid)
            os.kill(pid, signal.SIGKILL)
            killed.append(lane)
            # Restarted, and a recovery ended after that. (Counting recoveries exactly would also count
            # one the lane watchdog may start on a loaded machine for a healthy lane whose health check
            # was slow: no restart, no request lost, so not what this test is about.)
            assert wait_until(
                lambda lane=lane, pid=pid, before=before: (
                    server.lane_pids()[lane] != pid and server.recovered_since(before)
                ),
                120,
            ), f"no recovery after killing {lane}"
        for t in workers:
            t.join(240)
    finally:
        stop.set()
    assert killed == ["draft", "verify", "prefill"]
    assert server.count(r"lane restarted, pid") == 3  # only the killed lanes were restarted
    assert len(results) == REQUESTS
    for n, (code, chunks) in sorted(results.items()):
        streamed = [t for m in chunks for t in m.token_ids]
        assert code == grpc.StatusCode.OK, f"request {n} ended with {code}"
        # What the client saw, chunk by chunk, is exactly the fault-free output: no token twice,
        # none skipped, and exactly max_tokens of them.
        assert streamed == expected[n], f"request {n}: stream differs from the fault-free run"
        assert len(streamed) == MAX_TOKENS and chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    client = Client(address)
    assert client.health_status() == health_pb2.HealthCheckResponse.SERVING
    client.close()
    # The supervisor's count on /metrics: the three kills, and no restart it did not make.
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10).read().decode()
    restarts = [line for line in metrics.splitlines() if line.startswith("verifypd_lane_restarts")]
    assert restarts and float(restarts[0].split()[-1]) == 3, restarts


def test_crash_loop_gives_up_clearly_and_sigterm_still_cleans_up(split_server):
    address, server, shm_before, all_pids = split_server
    client = Client(address)
    # A long request in flight while the draft lane is killed again and again.
    call = client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request([5, 6, 7], 200)), timeout=120)
    first = next(call)  # streaming: in flight from here on
    assert first.token_ids
    outcome = {}

    def drain():
        try:
            list(call)
            outcome["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()

    reader = threading.Thread(target=drain)
    reader.start()
    for _ in range(8):
        if server.count("crash loop"):
            break
        pid = server.lane_pids()["draft"]
        all_pids.add(pid)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        # Wait for the supervisor's next move: a restart (new pid) or giving up. The next kill
        # comes while the new lane is still loading, so recovery never completes in between.
        wait_until(lambda pid=pid: server.lane_pids()["draft"] != pid or server.count("crash loop"), 30)
    assert server.count(r"supervisor ERROR draft lane crash loop.*the gateway stops serving") == 1, (
        "the crash loop was not reported once"
    )
    reader.join(30)
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE
    assert wait_until(lambda: client.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
    with pytest.raises(grpc.RpcError) as err:  # new requests fail fast
        client.generate(**greedy_request([5, 6], 5), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    client.close()
    all_pids.update(server.lane_pids().values())
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(40) == 0
    assert wait_until(lambda: not any(pid_alive(p) for p in all_pids), 15)
    assert not left_behind(shm_pool_files() - shm_before), "KV pool files left in /dev/shm"

"""`verifypd serve` and a lane process against hostile or careless input, as processes:

* secrets never reach a child's command line (the API key from a file, the lane secret);
* undecodable protobuf bytes to the gateway and to a lane are INVALID_ARGUMENT, one short line each,
  no traceback;
* a clean SIGTERM logs no ERROR;
* a taken port fails `serve` at once, naming its flag, before any model loads; `--api-key` on the
  command line is warned about;
* oversized messages without the lane secret are refused without being buffered (the lane's memory
  high-water mark stays put), and over the lane's receive limit with it.
"""

from __future__ import annotations

import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from services_helpers import BLOCK_SIZE, MAX_CONTEXT, Client, Server, free_port, serve_cmd, wait_until

from verifypd.lanes.processes import child_env

pytestmark = pytest.mark.slow  # serve and lane subprocesses (tests/README.md)

API_KEY = "hostile-edges-api-key-0123456789"


def cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def descendants(pid: int) -> list[int]:
    """By parent pid (a thread's children are not in the main thread's task/PID/children)."""
    parents: dict[int, int] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
    tree = [pid]
    for p in tree:
        tree += [child for child, parent in parents.items() if parent == p]
    return tree[1:]


def lane_secret_of(pid: int) -> str:
    env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"VERIFYPD_LANE_SECRET="))


def raw_call(address: str, method: str, payload: bytes, metadata=(), timeout: float = 30):
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)])
    try:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        call(payload, metadata=metadata, timeout=timeout)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    finally:
        channel.close()


def test_split_serve_secrets_garbage_and_clean_shutdown(tiny_models, tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text(API_KEY + "\n")
    port = free_port()
    server = Server(serve_cmd(tiny_models, port, "--api-key-file", str(key_file), topology="split")).wait_ready()
    try:
        children = descendants(server.proc.pid)
        lanes = server.lane_pids()
        assert len(children) >= 4 and set(lanes.values()) <= set(children)  # the core and its three lanes
        lane_secret = lane_secret_of(lanes["verify"])
        for pid in [server.proc.pid, *children]:
            argv = cmdline(pid)
            assert API_KEY.encode() not in argv, f"the API key is on the command line of pid {pid}"
            assert lane_secret.encode() not in argv, f"the lane secret is on the command line of pid {pid}"

        # Four random bytes are no GenerateRequest: INVALID_ARGUMENT, not UNKNOWN.
        bearer = (("authorization", f"Bearer {API_KEY}"),)
        code, details = raw_call(
            f"127.0.0.1:{port}", "/verifypd.v1.Generation/GetServerInfo", b"\xff\xff\xff\xff", bearer
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "cannot be decoded" in details, (code, details)
        stream = grpc.insecure_channel(f"127.0.0.1:{port}")
        gen = stream.unary_stream("/verifypd.v1.Generation/Generate", request_serializer=None)
        with pytest.raises(grpc.RpcError) as err:
            list(gen(b"\x0a\xff\xff\xff", metadata=bearer, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stream.close()
        # The same to a lane (with its secret): INVALID_ARGUMENT, not INTERNAL.
        lane_addr = re.search(r"verify lane pid=\d+ addr=(\S+)", "".join(server.lines)).group(1)
        code, _ = raw_call(
            lane_addr, "/verifypd.v1.VerifyLane/Verify", b"\x0a\xff\xff\xff", (("x-verifypd-lane-secret", lane_secret),)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, code
        assert server.count("Traceback") == 0
        assert server.count("refused an undecodable") >= 2
        c = Client(f"127.0.0.1:{port}", bearer=API_KEY)
        ids, _ = c.generate(token_ids={"ids": [5, 6, 7]}, max_tokens=4, stop_at_eos=False)
        assert len(ids) == 4  # still serving
        c.close()
    finally:
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
    assert code == 0
    time.sleep(0.5)  # the reader thread takes the last lines
    errors = [ln for ln in server.lines if " ERROR " in ln]
    assert not errors, f"a clean SIGTERM logged errors: {errors}"
    assert server.count("engine core stopped") == 1


@pytest.mark.parametrize("flag", ["--http-port", "--port", "--health-port"])
def test_a_taken_port_fails_serve_at_once_naming_the_flag(tiny_models, flag):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    busy = taken.getsockname()[1]
    ports = {"--port": str(free_port()), "--http-port": str(free_port()), "--health-port": "0"}
    ports[flag] = str(busy)
    cmd = serve_cmd(tiny_models, 0, "--api-key", API_KEY)
    for name, value in ports.items():  # the later value of a flag wins in argparse
        cmd += [name, value]
    try:
        proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr
    assert f"{flag} {busy}" in proc.stderr and "verifypd: serving" not in proc.stderr
    assert "verifypd.core" not in proc.stderr, "the engine core started (models loading) before the port check"
    assert "--api-key on the command line is visible" in proc.stderr


def vm_hwm_mb(pid: int) -> float:
    text = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024


def test_oversized_messages_are_not_buffered_before_refusal(tiny_models, tmp_path):
    port_file = tmp_path / "port"
    secret = "lane-secret-for-the-size-test-0123"
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "lane",
        "verify",
        "--port-file",
        str(port_file),
        *("--target", tiny_models[0], "--draft", tiny_models[1], "--device", "cpu"),
        *("--num-blocks", "16", "--block-size", str(BLOCK_SIZE), "--max-context", str(MAX_CONTEXT)),
    ]
    lane = subprocess.Popen(cmd, env={**child_env(), "VERIFYPD_LANE_SECRET": secret}, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(port_file.exists, 120), "the lane did not start"
        address = f"127.0.0.1:{port_file.read_text().split()[0]}"
        payload = b"\x0a" + b"\xff" * (200 << 20)  # 200 MiB of a field that never ends
        before = vm_hwm_mb(lane.pid)
        for _ in range(4):
            code, _ = raw_call(address, "/verifypd.v1.VerifyLane/Verify", payload, timeout=60)
            assert code == grpc.StatusCode.UNAUTHENTICATED, code
        after_unauthenticated = vm_hwm_mb(lane.pid)
        # 4 x 200 MiB sent: buffering even one would add ~200 MiB.
        assert after_unauthenticated - before < 64, (before, after_unauthenticated)
        code, details = raw_call(
            address, "/verifypd.v1.VerifyLane/Verify", payload, (("x-verifypd-lane-secret", secret),), timeout=60
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        after_limit = vm_hwm_mb(lane.pid)
        print(f"lane VmHWM {before:.0f} -> {after_unauthenticated:.0f} -> {after_limit:.0f} MiB")
        assert after_limit - before < 100, (before, after_limit)
    finally:
        lane.send_signal(signal.SIGTERM)
        try:
            lane.wait(30)
        except subprocess.TimeoutExpired:
            lane.kill()

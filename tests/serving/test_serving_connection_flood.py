"""Idle connections must not lock everyone out (net/limits.py, gateway/http_server.py's guarded protocol).

`verifypd serve` under an open-file limit of 512 gets 700 idle connections on each public port (more
than the limit in all). New clients must still be served, the idle connections are closed after
--idle-timeout, and the log stays short (no "Too many open files" loop).
"""

from __future__ import annotations

import shutil
import socket
import time

import grpc
import httpx
import pytest
from services_helpers import Client, Server, free_port, serve_cmd, wait_until

pytestmark = [
    pytest.mark.slow,  # a serve subprocess (tests/README.md)
    pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)"),
]

IDLE = 700  # per port
FD_LIMIT = 512


def open_idle(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket) -> bool:
    s.settimeout(0.01)
    try:
        return s.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:  # reset
        return True


def test_idle_connections_beyond_the_fd_limit_lock_nobody_out(tiny_models):
    port, http_port = free_port(), free_port()
    cmd = ["prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", *serve_cmd(tiny_models, port, "--idle-timeout", "2")]
    cmd += ["--http-port", str(http_port)]
    server = Server(cmd, echo=False).wait_ready()
    idle: list[socket.socket] = []
    try:
        assert wait_until(lambda: server.count("OpenAI-compatible HTTP API") == 1, 60)
        idle = open_idle(http_port, IDLE) + open_idle(port, IDLE)
        assert len(idle) > FD_LIMIT  # more than the server could ever hold open
        # A new client is served (at once, or once the idle connections are closed).
        assert wait_until(lambda: health_ok(http_port), 60), "the HTTP port locked out a new client"
        # gRPC: the port holds at most its share of connections; the idle ones are closed after
        # --idle-timeout (handshake never finished), so a client that retries gets in.
        assert wait_until(lambda: grpc_ok(port), 60), "the gRPC port locked out a new client"
        # The idle connections were closed by the server (most within --idle-timeout, the rest at once).
        assert wait_until(lambda: sum(closed_by_server(s) for s in idle) > 0.9 * len(idle), 60)
        assert health_ok(http_port)
        flood_lines = server.count(r"Too many open files|out of system resource")
        assert flood_lines < 20, f"{flood_lines} 'too many open files' lines in the log"
        assert len(server.lines) < 300, f"{len(server.lines)} log lines"
    finally:
        for s in idle:
            s.close()
        server.stop()


def grpc_ok(port: int) -> bool:
    c = Client(f"127.0.0.1:{port}")
    try:
        ids, _ = c.generate(token_ids={"ids": [5, 6, 7]}, max_tokens=4, stop_at_eos=False, timeout=20)
        return len(ids) == 4
    except grpc.RpcError:
        time.sleep(0.5)
        return False
    finally:
        c.close()


def health_ok(http_port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        time.sleep(0.2)
        return False

"""Helpers and fixtures of the tests that serve over gRPC/HTTP (gateway, lanes, core, serving rooms).

Fixtures are defined here and imported by the test modules (test modules never import a module
named `conftest`: several test directories have one).
"""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
import threading
import time

import engine_helpers as _engine_models  # the tiny checkpoints' writers
import grpc
import pytest

VOCAB = _engine_models.VOCAB

K = 4
NUM_BLOCKS = 64
BLOCK_SIZE = 4
MAX_CONTEXT = 256


def engine_options(target: str, draft: str, *, k: int = K, adaptive: bool = False, **overrides):
    from verifypd.domain.config import RuntimeConfig
    from verifypd.engine import EngineOptions

    config = RuntimeConfig(k_min=0, k_max=8, k_initial=k, adaptive=adaptive)
    fields = dict(
        target=target,
        draft=draft,
        device="cpu",
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_context=MAX_CONTEXT,
        config=config,
    )
    fields.update(overrides)
    return EngineOptions(**fields)


def random_prompts(n: int, seed: int, max_len: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]


def offline_outputs(options, specs) -> list[list[int]]:
    """What the offline engine (no gRPC) produces for the same requests."""
    from verifypd.engine import Engine

    done = Engine(options).generate(specs)
    return [c.token_ids for c in done.values()]


class SlowLane:
    """Wraps a lane; `delay_s` makes every call slower so a request stays in flight (test knob)."""

    def __init__(self, lane):
        self.lane, self.delay_s = lane, 0.0

    def describe(self):
        return self.lane.describe()

    def __getattr__(self, name):
        method = getattr(self.lane, name)
        if not callable(method):  # flags such as `feeds_tokens` pass through as they are
            return method

        def call(*args, **kwargs):
            time.sleep(self.delay_s)
            return method(*args, **kwargs)

        return call


def concurrent_greedy(client, prompts: list[list[int]], max_tokens: int) -> list[list[int] | None]:
    """Each prompt's greedy tokens from `client`, all requests in flight at once (None: no answer)."""
    got: dict[int, list[int]] = {}

    def run(n: int) -> None:
        got[n] = client.generate(**greedy_request(prompts[n], max_tokens=max_tokens), timeout=120)[0]

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return [got.get(n) for n in range(len(prompts))]


def started_lanes(options):
    """Yields the three lane processes of `options` started (a module fixture's body), then stops them."""
    from verifypd.lanes.processes import LaneProcesses

    procs = LaneProcesses(options)
    procs.start(timeout_s=120)
    yield procs
    procs.terminate()


def split_gateway(lanes, options, kv_transport: str):
    """A started split gateway over `lanes` (started_lanes), its KV moved by `kv_transport`."""
    from verifypd.gateway.server import build_split

    return build_split(lanes.addrs, options, kv_transport=kv_transport, lane_secret=lanes.secret).start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


class Client:
    """Stubs of one server (Generation, Control, Health, Reflection) on one channel."""

    def __init__(self, address: str, bearer: str | None = None):
        """`bearer`: a key sent as `authorization: Bearer <key>` on every call (API or admin key)."""
        from grpc_health.v1 import health_pb2_grpc

        from verifypd.net.auth import bearer_interceptor
        from verifypd.v1 import control_pb2_grpc, generate_pb2_grpc

        self.address = address
        self.channel = grpc.insecure_channel(address)
        if bearer:
            self.channel = grpc.intercept_channel(self.channel, bearer_interceptor(bearer))
        self.gen = generate_pb2_grpc.GenerationStub(self.channel)
        self.control = control_pb2_grpc.ControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, timeout: float = 60, **fields):
        """Runs one request to completion; returns (token ids, messages)."""
        from verifypd.v1 import generate_pb2

        msgs = list(self.gen.Generate(generate_pb2.GenerateRequest(**fields), timeout=timeout))
        return [t for m in msgs for t in m.token_ids], msgs

    def health_status(self, service: str = "") -> int:
        from grpc_health.v1 import health_pb2

        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def close(self) -> None:
        self.channel.close()


def greedy_request(prompt: list[int], max_tokens: int = 24, **extra) -> dict:
    from verifypd.v1 import generate_pb2

    return dict(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        max_tokens=max_tokens,
        stop_at_eos=False,
        sampling=generate_pb2.SamplingParams(seed=0),
        **extra,
    )


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    return _engine_models.write_target_and_draft(tmp_path_factory.mktemp("models"))


class Server:
    """A `verifypd serve` subprocess whose stderr is collected (lane pids, recovery log lines)."""

    def __init__(
        self,
        cmd: list[str],
        ready_line: str = "verifypd: serving",
        echo: bool = True,
        env: dict[str, str] | None = None,
    ):
        from verifypd.lanes.processes import child_env

        self.proc = subprocess.Popen(cmd, env={**child_env(), **(env or {})}, stderr=subprocess.PIPE, text=True)
        self.ready_line, self.echo = ready_line, echo
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if self.echo:
                sys.stderr.write(line)
            if self.ready_line in line:
                self.ready.set()

    def count(self, pattern: str) -> int:
        return sum(1 for ln in list(self.lines) if re.search(pattern, ln))

    def lane_pids(self) -> dict[str, int]:
        """The current pid of each lane (the start lines, then the supervisor's restart lines)."""
        pids: dict[str, int] = {}
        for ln in list(self.lines):
            m = re.search(r"verifypd: (\w+) lane pid=(\d+)", ln) or re.search(r"(\w+) lane restarted, pid (\d+)", ln)
            if m:
                pids[m.group(1)] = int(m.group(2))
        return pids

    def recoveries(self) -> int:
        """Recoveries the engine finished (split topology: each re-wires the lanes)."""
        return self.count(r"lanes recovered after")

    def recovering(self) -> bool:
        """A recovery began (the engine's "lane failure: ...; recovering" line) and has not ended."""
        return self.count(r"lane failure: .*; recovering") > self.recoveries()

    def recovered_since(self, before: int) -> bool:
        """A recovery ended after `before` had ended, and none is under way now. Not "exactly one
        more": the lane watchdog may also recover from a healthy lane whose health check was slow on
        a loaded machine (a recovery without a restart; see tests/README.md)."""
        return self.recoveries() > before and not self.recovering()

    def wait_ready(self, timeout_s: float = 180) -> Server:
        if not self.ready.wait(timeout_s):
            self.stop()
            pytest.fail("verifypd serve did not start:\n" + "".join(self.lines[-30:]))
        return self

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM (drain, then exit), SIGKILL when that takes too long."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def serve_cmd(tiny_models, port: int, *extra: str, topology: str = "colocated") -> list[str]:
    """`verifypd serve` through the CLI with the tiny random models on CPU (no HTTP port)."""
    return [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--topology",
        topology,
        "--port",
        str(port),
        "--target",
        tiny_models[0],
        "--draft",
        tiny_models[1],
        "--device",
        "cpu",
        "--num-blocks",
        "128",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-context",
        str(MAX_CONTEXT),
        "--http-port",
        "0",
        "--drain-timeout",
        "2",
        *extra,
    ]

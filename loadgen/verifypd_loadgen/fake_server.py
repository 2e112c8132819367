"""A deterministic Generation server for tests and smoke tests (`verifypd-loadgen fake-server`).

Timing is scheduled from the moment the request is received, so it does not drift:
the first message (carrying `burst[0]` tokens) is sent at ttft_s + prefill_s_per_token *
prompt length; every later message carries the next burst size (cycled) and is sent
burst * itl_s after the previous one. So per-token ITL is itl_s and per-chunk ITL is
burst * itl_s. Messages after the first count as verify steps with applied_k = k, drafting k
tokens and accepting burst - 1 of them. It generates max_tokens tokens (16 when 0).
"""

from __future__ import annotations

import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from verifypd.v1 import generate_pb2, generate_pb2_grpc
from verifypd_loadgen import __version__


@dataclass
class FailRule:
    """Abort matching requests with `code` after `after` tokens were sent.

    A request matches when `match` (a regex) is found in its request_id or text prompt, or,
    with `every` = N, when it is the N-th, 2N-th, ... request received."""

    code: grpc.StatusCode
    match: str | None = None
    every: int | None = None
    after: int = 0

    @classmethod
    def parse(cls, spec: str) -> FailRule:
        """`CODE[,match=REGEX][,every=N][,after=T]`, e.g. `UNAVAILABLE,every=5`."""
        name, *opts = spec.split(",")
        try:
            code = grpc.StatusCode[name.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown gRPC status code {name!r}") from None
        kw: dict = {}
        for opt in opts:
            key, _, value = opt.partition("=")
            if key not in ("match", "every", "after"):
                raise ValueError(f"unknown fail option {key!r} in {spec!r}")
            kw[key] = value if key == "match" else int(value)
        if kw.get("match") is None and kw.get("every") is None:
            raise ValueError(f"fail rule {spec!r} needs match=REGEX or every=N")
        return cls(code, **kw)

    def applies(self, seq: int, request: generate_pb2.GenerateRequest) -> bool:
        if self.every and seq % self.every == 0:
            return True
        if not self.match:
            return False
        return bool(re.search(self.match, request.request_id) or re.search(self.match, request.text))


@dataclass
class FakeConfig:
    ttft_s: float = 0.010
    prefill_s_per_token: float = 0.0
    itl_s: float = 0.002
    burst: tuple[int, ...] = (1,)
    k: int = 0
    default_max_tokens: int = 16
    final_empty: bool = False  # end with a message carrying no tokens (as servers may)
    server_info: bool = True  # False: GetServerInfo answers UNIMPLEMENTED
    fail: list[FailRule] = field(default_factory=list)


class FakeGeneration(generate_pb2_grpc.GenerationServicer):
    def __init__(self, config: FakeConfig | None = None):
        self.config = config or FakeConfig()
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.received: list[tuple[float, generate_pb2.GenerateRequest]] = []

    def _enter(self, request, t0: float) -> int:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.received.append((t0, request))
            return len(self.received)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def GetServerInfo(self, request, context):
        if not self.config.server_info:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "GetServerInfo disabled")
        return generate_pb2.ServerInfo(
            target_model="fake-target",
            draft_model="fake-draft",
            topology="colocated",
            max_context=1 << 20,
            version=f"fake-{__version__}",
        )

    def Generate(self, request, context):
        t0 = time.perf_counter()
        seq = self._enter(request, t0)
        left = []

        def leave():  # idempotent: _generate may leave early (see there)
            if not left:
                left.append(True)
                self._leave()

        try:
            yield from self._generate(request, context, seq, t0, leave)
        finally:
            leave()

    def _generate(self, request, context, seq, t0, leave):
        cfg = self.config
        rule = next((r for r in cfg.fail if r.applies(seq, request)), None)
        n_prompt = len(request.token_ids.ids) or len(request.text.split()) or len(request.chat.messages)
        total = request.max_tokens or cfg.default_max_tokens
        due = t0 + cfg.ttft_s + cfg.prefill_s_per_token * n_prompt
        usage = generate_pb2.Usage(prompt_tokens=n_prompt)
        sent = step = 0
        while sent < total:
            if rule is not None and sent >= rule.after:
                leave()
                context.abort(rule.code, f"injected {rule.code.name} for {request.request_id}")
            b = min(cfg.burst[step % len(cfg.burst)], total - sent)
            if step:
                due += b * cfg.itl_s
                usage.verify_steps += 1
                usage.draft_tokens += cfg.k
                usage.accepted_tokens += b - 1
            time.sleep(max(0.0, due - time.perf_counter()))
            if not context.is_active():
                return
            ids = [(seq * 7919 + sent + i) % 30000 + 100 for i in range(b)]
            sent += b
            usage.completion_tokens = sent
            msg = generate_pb2.GenerateResponse(
                request_id=request.request_id,
                token_ids=ids,
                text=" tok" * b,
                usage=usage,
                applied_k=cfg.k if step else 0,
                server_elapsed_s=time.perf_counter() - t0,
            )
            last = sent >= total and not cfg.final_empty
            if last:
                msg.finish_reason = generate_pb2.FINISH_REASON_LENGTH
                # Leave before the final message: the client may start its next request as
                # soon as it sees it, and must not be counted twice in flight.
                leave()
            yield msg
            step += 1
        if cfg.final_empty:
            leave()
            yield generate_pb2.GenerateResponse(
                request_id=request.request_id,
                usage=usage,
                finish_reason=generate_pb2.FINISH_REASON_LENGTH,
                server_elapsed_s=time.perf_counter() - t0,
            )


def start(
    config: FakeConfig | None = None, host: str = "127.0.0.1", port: int = 0, max_workers: int = 64
) -> tuple[grpc.Server, FakeGeneration, int]:
    """Starts a fake server; returns (server, servicer, bound port). Stop with server.stop(0).

    A request is served by one worker thread for its whole stream, so max_workers bounds the
    concurrency the fake server can sustain."""
    servicer = FakeGeneration(config)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    return server, servicer, bound

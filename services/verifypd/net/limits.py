"""Connection and message limits of the servers' ports: what a flood of idle connections or an
oversized message may cost, bounded before it costs it.

* **File descriptors.** `raise_fd_limit` lifts the soft RLIMIT_NOFILE to the hard one at start-up,
  and `ConnectionLimits.for_this_process` splits what is left (less a reserve for the process's own
  files, sockets and the core channel) between the HTTP and the gRPC port, so that connections alone
  can never exhaust the descriptors: a full port closes a new connection at once (HTTP) or refuses it
  (gRPC's `grpc.max_allowed_incoming_connections`), and the others keep working. Without this, 4,500
  idle connections under a 4,096 limit took every descriptor, and every accept after that failed and
  logged "Too many open files" in a loop.
* **Idle connections.** A connection that has not sent a request's headers (HTTP) or finished the
  HTTP/2 handshake (gRPC) within `idle_timeout_s` is closed; an established gRPC connection with no
  call for `grpc_idle_s` too (clients reconnect by themselves). Keep-alive pings find dead peers.
* **Message sizes.** A gRPC server buffers a whole request message, up to its receive limit, before
  any handler (or the lane secret's interceptor, which refuses without reading the message) can look
  at it; the limit is therefore the largest message the port legitimately needs, not 512 MiB.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

FD_RESERVE = 256  # descriptors kept for the process itself (files, the core channel, lanes' channels, logs)
GATEWAY_MAX_MESSAGE = 4 << 20  # gRPC's default, as --http-max-body-bytes: a 131k-token prompt is < 1 MiB
# The lanes' largest legitimate messages: a KvBlockChunk (one block of one layer) and a work batch
# (<= 4096 items / 131072 positions, lane_validate.py: token ids and block tables, a few MiB) are far below
# this; dense DraftProbs ([rows, vocab] float32) are no longer sent by draft lanes (docs/services.md).
LANE_MAX_MESSAGE = 64 << 20
LANE_MAX_SEND = 512 << 20  # replies and KV reads are ours: the old bound


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE raised to the hard limit (at most 1 << 20); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    want = min(want, 1 << 20)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int  # per public port (HTTP, gRPC)
    idle_timeout_s: float  # HTTP: headers of the first request; gRPC: the handshake
    grpc_idle_s: float = 300.0  # an established gRPC connection without calls

    @classmethod
    def for_this_process(cls, max_connections: int | None, idle_timeout_s: float, ports: int = 2) -> ConnectionLimits:
        """`max_connections` None: what the descriptor limit allows per port (after raising it)."""
        budget = max(16, (raise_fd_limit() - FD_RESERVE) // max(ports, 1))
        return cls(min(max_connections or budget, budget), idle_timeout_s)

    def gateway_grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", GATEWAY_MAX_MESSAGE),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.server_handshake_timeout_ms", int(self.idle_timeout_s * 1000)),
            ("grpc.max_connection_idle_ms", int(self.grpc_idle_s * 1000)),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.max_concurrent_streams", 1024),
            ("grpc.so_reuseport", 0),  # a taken port is an error, never a second server on it
        ]


DEFAULT_IDLE_TIMEOUT_S = 10.0
GATEWAY_GRPC_OPTIONS = ConnectionLimits(1024, DEFAULT_IDLE_TIMEOUT_S).gateway_grpc_options()  # in-process gateways
LANE_GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", LANE_MAX_MESSAGE),
    ("grpc.max_send_message_length", LANE_MAX_SEND),
    ("grpc.server_handshake_timeout_ms", int(DEFAULT_IDLE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.so_reuseport", 0),
]

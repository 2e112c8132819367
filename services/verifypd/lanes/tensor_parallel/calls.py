"""The calls rank 0 of a tensor-parallel target sends its followers (torch-free; numpy + struct).

One message per target forward, written to each follower's control socket (a socketpair inherited
by the follower process) before rank 0 issues the forward itself. No pickle: a fixed header of
eight little-endian int64, then five int64 arrays back to back, then an opaque payload:

    header   kind, logits_for, runs, tokens, blocks, draft_k, sequence number, payload bytes
    arrays   lens[runs], start_pos[runs], block_counts[runs], token_ids[tokens], block_ids[blocks]
    payload  IMPORT only: a serialized lanes_pb2.PoolDescriptor (the pool this rank opens)

Followers answer on the same socket only at start-up (once ready) and after IMPORT, with
`reply`: a length-prefixed message (protobuf bytes or empty; a negative length carries an error).

`kind` names the ModelRunner method the follower calls with the same runs (so it picks the same
layout, the same CUDA-graph bucket and issues the same collectives in the same order);
`draft_k` > 0 on a SCORE call: the drafts are on rank 0's device, and both sides take part in one
broadcast of a [runs, draft_k] int64 tensor right after this message (lanes/tensor_parallel/ranks.py).
The sequence number lets a follower detect a lost or repeated message (it exits).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import numpy as np

FORWARD, SCORE, LAST_LOGITS, IMPORT, STOP = 1, 2, 3, 4, 9
KINDS = {FORWARD: "forward", SCORE: "score", LAST_LOGITS: "last_logits", IMPORT: "import", STOP: "stop"}
LOGITS_FOR = {None: 0, "last": 1, "all": 2}
LOGITS_FOR_NAME = {v: k for k, v in LOGITS_FOR.items()}
HEADER = struct.Struct("<8q")
MAX_ELEMENTS = 1 << 26  # a sanity bound on any array (a corrupt header must not allocate terabytes)


@dataclass
class Call:
    kind: int
    runs: list  # layout.TokenRun (token_ids, start_pos, block_ids)
    logits_for: str | None = None
    draft_k: int = 0
    seq: int = 0
    payload: bytes = b""


def encode(call: Call) -> bytes:
    runs = call.runs
    lens = np.fromiter((len(r.token_ids) for r in runs), dtype=np.int64, count=len(runs))
    starts = np.fromiter((r.start_pos for r in runs), dtype=np.int64, count=len(runs))
    counts = np.fromiter((len(r.block_ids) for r in runs), dtype=np.int64, count=len(runs))
    tokens = np.fromiter((t for r in runs for t in r.token_ids), dtype=np.int64, count=int(lens.sum()))
    blocks = np.fromiter((b for r in runs for b in r.block_ids), dtype=np.int64, count=int(counts.sum()))
    header = HEADER.pack(
        call.kind,
        LOGITS_FOR[call.logits_for],
        len(runs),
        tokens.size,
        blocks.size,
        call.draft_k,
        call.seq,
        len(call.payload),
    )
    return b"".join(
        (header, lens.tobytes(), starts.tobytes(), counts.tobytes(), tokens.tobytes(), blocks.tobytes(), call.payload)
    )


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None at EOF before the first byte (the peer closed: rank 0 is gone)."""
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            if got:
                raise EOFError(f"control socket closed inside a message ({got} of {n} bytes)")
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def receive(sock: socket.socket, make_run) -> Call | None:
    """The next call from rank 0, or None at EOF. `make_run(token_ids, start_pos, block_ids)` builds
    a run (layout.TokenRun; passed in to keep this module torch-free)."""
    raw = _recv_exactly(sock, HEADER.size)
    if raw is None:
        return None
    kind, logits_for, n_runs, n_tokens, n_blocks, draft_k, seq, n_payload = HEADER.unpack(raw)
    if (
        kind not in KINDS
        or logits_for not in LOGITS_FOR_NAME
        or not all(0 <= n <= MAX_ELEMENTS for n in (n_runs, n_tokens, n_blocks, draft_k, n_payload))
    ):
        raise ValueError(f"malformed tensor-parallel call header {(kind, logits_for, n_runs, n_tokens, n_blocks)}")
    body = _recv_exactly(sock, 8 * (3 * n_runs + n_tokens + n_blocks)) if (n_runs or n_tokens or n_blocks) else b""
    if body is None:
        raise EOFError("control socket closed after a call header")
    flat = np.frombuffer(body, dtype=np.int64)
    lens, starts, counts = flat[:n_runs], flat[n_runs : 2 * n_runs], flat[2 * n_runs : 3 * n_runs]
    tokens, blocks = flat[3 * n_runs : 3 * n_runs + n_tokens], flat[3 * n_runs + n_tokens :]
    if int(lens.sum()) != n_tokens or int(counts.sum()) != n_blocks:
        raise ValueError("malformed tensor-parallel call: run lengths do not add up")
    tok_at = np.concatenate(([0], np.cumsum(lens))).tolist()
    blk_at = np.concatenate(([0], np.cumsum(counts))).tolist()
    runs = [
        make_run(
            tokens[tok_at[i] : tok_at[i + 1]].tolist(),
            int(starts[i]),
            tuple(blocks[blk_at[i] : blk_at[i + 1]].tolist()),
        )
        for i in range(n_runs)
    ]
    payload = _recv_exactly(sock, n_payload) if n_payload else b""
    if payload is None:
        raise EOFError("control socket closed before a call's payload")
    return Call(kind, runs, LOGITS_FOR_NAME[logits_for], draft_k, seq, payload)


REPLY = struct.Struct("<q")


def send_reply(sock: socket.socket, data: bytes = b"", error: str | None = None) -> None:
    """A follower's answer: `data`, or an error message (sent as a negative length)."""
    body = error.encode() if error is not None else data
    sock.sendall(REPLY.pack(-len(body) - 1 if error is not None else len(body)) + body)


def receive_reply(sock: socket.socket) -> bytes:
    """Rank 0's side of `send_reply`: the data; raises RuntimeError with the follower's error,
    EOFError when the follower is gone."""
    raw = _recv_exactly(sock, REPLY.size)
    if raw is None:
        raise EOFError("the follower closed its control socket")
    (n,) = REPLY.unpack(raw)
    size = n if n >= 0 else -n - 1
    if size > MAX_ELEMENTS:
        raise ValueError(f"malformed tensor-parallel reply length {n}")
    body = _recv_exactly(sock, size) if size else b""
    if body is None:
        raise EOFError("the follower closed its control socket inside a reply")
    if n < 0:
        raise RuntimeError(body.decode(errors="replace"))
    return body

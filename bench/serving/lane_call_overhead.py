"""What one lane call costs without model work: the split topology's per-call tax.

    PYTHONPATH=services python bench/serving/lane_call_overhead.py [--out FILE]

A verify lane server runs in a child process with a stub lane (answers every item at once: no
model, no device work) behind the real LaneServicer edge (validation, lock, conversion, both
transports). The parent calls it as the router does and reports medians in ms:
  * round_trip_empty:   a LaneCall with no items on the call channel (pure transport)
  * grpc_unary_empty:   the same over unary gRPC (Verify with no items)
  * call_B / grpc_B:    GrpcVerifyLane.verify of B items (k = 4, 16-block tables) over the call
                        channel / unary gRPC, end to end as the router sees it
  * encode_B, decode_B: the router side's share (build the message, read the reply)
  * server_B:           the lane side's share (validate + decode + encode the reply)
  * device sync (CUDA only): an idle torch.cuda.synchronize and an event record + wait
The transport share is round trip minus both sides' work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "services"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from verifypd.domain.lanes import KvHandle, LaneInfo, PoolInfo, VerifyItem, VerifyOutput  # noqa: E402
from verifypd.domain.requests import SamplingParams  # noqa: E402

POOL = PoolInfo("target-000000000001", 7, "target", 2, 8192, 16)
VOCAB, K, BLOCKS = 32000, 4, 16


class StubVerifyLane:
    """Accepts nothing, returns the pending token: the lane interface with no work behind it."""

    def describe(self):
        return LaneInfo("verify", (POOL,), VOCAB, 4096)

    def verify(self, items):
        return [VerifyOutput(i.request_id, 0, [i.pending_token]) for i in items]

    def verify_start(self, items, feed=None):
        from verifypd.domain.lanes import Finished

        return Finished(self.verify(items))


def stub_servicer():
    import threading

    import torch

    from verifypd.lanes.rpc.kv_transport import KvTransferServicer
    from verifypd.lanes.rpc.lane_server import LaneServicer

    s = LaneServicer.__new__(LaneServicer)  # the real edge, without loading a model
    s.role, s.secret, s.options, s.tls = "verify", None, None, None
    s.lock, s.verify_lane, s.device = threading.Lock(), StubVerifyLane(), torch.device("cpu")
    s.prefill_lane = s.draft_lane = None
    s.vocab_size, s.max_context, s.eos_token_ids = VOCAB, 4096, ()
    s.owned, s.pushers, s.call_server, s.kv_bytes_copied = {}, {}, None, 0
    s.transfer = KvTransferServicer({}, s.lock)
    geometry = SimpleNamespace(num_blocks=POOL.num_blocks, block_size=POOL.block_size)
    s.pools = {"target": SimpleNamespace(pool_id=POOL.pool_id, generation=POOL.generation, geometry=geometry)}
    s.options = type("O", (), {"target": "stub", "draft": "stub"})()
    return s


def serve() -> None:
    from verifypd.lanes.rpc.lane_ports import build_lane_server

    servicer = stub_servicer()
    server, port, _ = build_lane_server(servicer, "127.0.0.1", 0)
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin


def items(batch: int, step: int) -> list[VerifyItem]:
    return [
        VerifyItem(
            f"request-{i:08d}",
            5,
            100 + step,
            [1, 2, 3, 4][:K],
            KvHandle(POOL.pool_id, POOL.generation, tuple(range(i * BLOCKS, (i + 1) * BLOCKS)), 100 + step, 100 + step),
            SamplingParams(),
        )
        for i in range(batch)
    ]


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[n // 10 :]) * 1e3


def measure(port: int, batches: list[int], n: int) -> dict:
    from verifypd.lanes.rpc import call_codec as cc
    from verifypd.lanes.rpc import call_decode as cd
    from verifypd.lanes.rpc import lane_validate as lv
    from verifypd.lanes.rpc.lane_client import GrpcVerifyLane
    from verifypd.v1 import lanes_pb2

    addr = f"127.0.0.1:{port}"
    fast, unary = GrpcVerifyLane(addr), GrpcVerifyLane(addr, call_channel=False)
    fast.wait_ready(30)
    out = {}
    client = fast._connected_client()
    empty = lanes_pb2.LaneCall(method=lanes_pb2.LANE_METHOD_VERIFY)
    out["round_trip_empty_ms"] = median_ms(lambda: client.call(empty), n)
    out["grpc_unary_empty_ms"] = median_ms(lambda: unary.rpc("Verify", lanes_pb2.VerifyBatch()), n)
    limits = lv.LaneLimits(VOCAB, 4096, {"target": lv.PoolLimits(POOL.pool_id, POOL.generation, 8192, 16)})
    for b in batches:
        work = items(b, 0)
        fast.verify(work)  # introduce the requests: later calls carry no intros and no new blocks
        out[f"call_{b}_ms"] = median_ms(lambda: fast.verify(work), n)  # noqa: B023
        out[f"grpc_{b}_ms"] = median_ms(lambda: unary.verify(work), n)  # noqa: B023
        mirror, state = cc.ChannelMirror(), cd.ChannelState()
        first = lanes_pb2.LaneCall(method=lanes_pb2.LANE_METHOD_VERIFY, batch=cc.encode_verify(mirror, work, None))
        cd.decode(first.method, first.batch, state, limits)
        call = lanes_pb2.LaneCall(method=lanes_pb2.LANE_METHOD_VERIFY, batch=cc.encode_verify(mirror, work, None))
        data = call.SerializeToString()
        reply = cd.verify_reply([VerifyOutput(i.request_id, 0, [i.pending_token]) for i in work])
        reply_data = reply.SerializeToString()
        out[f"encode_{b}_ms"] = median_ms(
            lambda: lanes_pb2.LaneCall(method=3, batch=cc.encode_verify(mirror, work, None)).SerializeToString(),  # noqa: B023
            n,
        )
        reply_call = lambda: cc.decode_verify(work, lanes_pb2.LaneReply.FromString(reply_data))  # noqa: B023, E731
        out[f"decode_{b}_ms"] = median_ms(reply_call, n)

        def server_side():
            c = lanes_pb2.LaneCall.FromString(data)  # noqa: B023
            got = cd.decode(c.method, c.batch, state, limits)  # noqa: B023
            cd.verify_reply([VerifyOutput(i.request_id, 0, [i.pending_token]) for i in got]).SerializeToString()

        out[f"server_{b}_ms"] = median_ms(server_side, n)
        out[f"bytes_per_call_{b}"] = len(data) + len(reply_data)
        out[f"grpc_bytes_per_call_{b}"] = sum(
            len(m.SerializeToString())
            for m in (__import__("verifypd.lanes.rpc.lane_convert", fromlist=["x"]).verify_batch_to_pb(work), reply)
        )
    out.update(device_sync(n))
    fast.close()
    unary.close()
    return out


def device_sync(n: int) -> dict:
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {"device_sync": "no CUDA device"}
    torch.cuda.synchronize()
    event = torch.cuda.Event(interprocess=True)

    def record_wait():
        event.record()
        torch.cuda.current_stream().wait_event(event)

    return {
        "cuda_synchronize_idle_ms": median_ms(torch.cuda.synchronize, n),
        "cuda_ipc_event_record_wait_ms": median_ms(record_wait, n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args()
    if args.serve:
        return serve()
    from bench_meta import metadata  # command, device, git revision, date

    child = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    try:
        port = int(child.stdout.readline())
        result = {
            **metadata(),
            "what": "one verify lane call, stub lane in a child process, no model work; medians in ms",
            "target_ms": 0.3,
            **measure(port, [int(b) for b in args.batches.split(",")], args.calls),
        }
    finally:
        child.stdin.close()
        child.wait(10)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

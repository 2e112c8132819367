"""The peer KV transport's own copy path against the link: how fast the prefill lane's copier
(lanes/rpc/peer_copy.py) moves a prompt's KV from its staging pool on one GPU into a pool that another
process owns on another GPU (mapped by CUDA IPC), next to a plain `dst.copy_(src)` between the two GPUs
(cudaMemcpyPeer: what the link gives a bulk copy) and NVLink's nominal figure.

The owner is a child process (as the verify lane is): it allocates the pool, prints its descriptor
(hex protobuf, never pickle) and waits; this process maps it and copies blocks layer by layer through
PeerCopier, checks the bytes arrived, and times it. On the CPU (`--device cpu`, a smoke run) the owner's
pool is a /dev/shm file: the same code path, no link to speak of.

    python bench/serving/peer_copy_bandwidth.py --src cuda:0 --dst cuda:1 --out peer.json
    python bench/serving/peer_copy_bandwidth.py --src cpu --dst cpu --smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("services", "bench"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

# Llama-2-7B's KV: 32 layers x 32 kv heads x 128 dims, bf16; blocks of 16 tokens (512 KiB per token).
SHAPE_7B = dict(layers=32, kv_heads=32, head_dim=128, block_size=16)
SHAPE_SMOKE = dict(layers=2, kv_heads=2, head_dim=8, block_size=4)
# Per direction, as NVIDIA lists them (H100/H200 SXM: NVLink 4, 18 links, 900 GB/s both directions).
NVLINK_NOMINAL_GBPS = {"H100": 450.0, "H200": 450.0}


def geometry(shape: dict, num_blocks: int):
    from verifypd.model.kv_pool import PoolGeometry

    return PoolGeometry(shape["layers"], num_blocks, shape["block_size"], shape["kv_heads"], shape["head_dim"])


def owner(args) -> None:
    """Child: owns a pool on --dst, prints its descriptor, lives until stdin closes."""
    import torch

    from verifypd.lanes.rpc.kv_transport import describe_pool
    from verifypd.model.kv_pool import KvPool

    device = torch.device(args.dst)
    g = geometry(SHAPE_SMOKE if args.smoke else SHAPE_7B, args.pool_blocks)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    pool = KvPool.create_shared_cpu("target", g, dtype) if device.type == "cpu" else KvPool("target", g, dtype, device)
    print(describe_pool(pool).SerializeToString().hex(), flush=True)
    sys.stdin.read()
    pool.close()


def measure(src: str, dst: str, smoke: bool, block_counts: list[int], reps: int) -> dict:
    import torch

    from verifypd.lanes.rpc import peer_copy
    from verifypd.model.kv_pool import KvPool
    from verifypd.v1 import lanes_pb2

    pool_blocks = max(block_counts) + 8
    child = subprocess.Popen(
        [sys.executable, __file__, "--owner", "--dst", dst, "--pool-blocks", str(pool_blocks)]
        + (["--smoke"] if smoke else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        d = lanes_pb2.PoolDescriptor.FromString(bytes.fromhex(child.stdout.readline().strip()))
        device = torch.device(src)
        reason = peer_copy.unreachable(d, device)
        if reason is not None:
            return {"error": f"peer transport cannot reach the owner: {reason}"}
        target = peer_copy.open_owner_pool(d, device)
        staging = KvPool("target", target.geometry, target.dtype, device, pool_id=d.pool_id, owner=False)
        staging.tensor.normal_()
        copier = peer_copy.PeerCopier(staging, target)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        rows = []
        for n in block_counts:
            blocks = list(range(3, 3 + n))
            times = []
            for _ in range(reps + 1):  # the first is a warm-up
                sync()
                t0 = time.perf_counter()
                copier.begin(blocks)
                for layer in range(staging.geometry.num_layers):
                    copier.layer_written(layer)
                nbytes = copier.finish()
                sync()
                times.append(time.perf_counter() - t0)
            index = torch.tensor(blocks, device=device)
            arrived = bool(torch.equal(target.tensor.index_select(2, index), staging.tensor.index_select(2, index)))
            best = min(times[1:])
            rows.append(
                {
                    "blocks": n,
                    "tokens": n * staging.geometry.block_size,
                    "bytes": nbytes,
                    "seconds_best": best,
                    "GBps": nbytes / best / 1e9,
                    "bytes_arrived_intact": arrived,
                }
            )
        result = {"path": "PeerCopier: index_select + index_copy_ per layer into the IPC-mapped owner pool"}
        result["rows"] = rows
        if device.type == "cuda":
            result["memcpy_peer_GBps"] = memcpy_peer(device, torch.device(dst), rows[-1]["bytes"], reps)
            name = torch.cuda.get_device_name(device)
            nominal = next((v for k, v in NVLINK_NOMINAL_GBPS.items() if k in name), None)
            result["nvlink_nominal_GBps_per_direction"] = nominal
            result["p2p_access"] = torch.cuda.can_device_access_peer(device, torch.device(dst))
        return result
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(30)


def memcpy_peer(src, dst, nbytes: int, reps: int) -> float:
    """GB/s of one bulk `copy_` of nbytes from src to dst (the link's practical ceiling)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    best = float("inf")
    for _ in range(reps + 1):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        t0 = time.perf_counter()
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default="cuda:0", help="the prefill lane's device")
    p.add_argument("--dst", default="cuda:1", help="the owner's device")
    p.add_argument("--blocks", default="16,128,512", help="blocks per copy (16 tokens each: 256, 2048, 8192 tokens)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="a tiny geometry (CPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--owner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pool-blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.owner:
        owner(args)
        return 0
    from bench_meta import metadata

    counts = [4, 16] if args.smoke else [int(b) for b in args.blocks.split(",")]
    result = {**metadata(), **measure(args.src, args.dst, args.smoke, counts, 2 if args.smoke else args.reps)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())

"""A follower rank of a tensor-parallel target: `python -m verifypd.lanes.tensor_parallel.follower --control-fd N
--options JSON` (started by tp_ranks.LeaderRanks, never by hand).

It joins the group and loads its shard. Then, by `pool` in the options:
  * "private" (the co-located engine) / "shared" (the verify lane, whose prefill lane imports it):
    agrees num_blocks with the other ranks, builds its KV pool (its kv heads; "shared": /dev/shm on
    the CPU, CUDA IPC on GPUs) and its runner, captures the same CUDA graphs as rank 0, and answers
    "ready" with the shared pool's PoolDescriptor (b"" for a private one);
  * "import" (the prefill lane): answers "ready" at once; each IMPORT call carries the pool of the
    matching verify-lane rank, which it opens and runs eager forwards over (prefill never replays).
Then it runs rank 0's calls until rank 0 stops it or goes away.

Options (JSON, from rank 0): rank, world, init_file, device, parent_pid, pool, generation, target,
dtype, kv_cache_dtype, max_context, block_size, num_blocks, gpu_memory_fraction, cuda_graphs, graph_buckets, k_max,
tp_all_reduce.
The pool budget is this rank's own memory, as rank 0 computes its own; the ranks take the minimum.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING

import torch

from verifypd.lanes.tensor_parallel import calls as tp_calls

if TYPE_CHECKING:
    from verifypd.model.kv_pool import KvPool
    from verifypd.model.runner import ModelRunner

log = logging.getLogger("verifypd.tp")


def _exit_with_parent(parent: int) -> None:
    """Rank 0 gone (even by SIGKILL) while this rank waits inside a collective: exit."""

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def pool_budget(model, options: dict, device: torch.device, dtype: torch.dtype) -> int:
    """This rank's blocks, as model.build.make_pools / lane_setup.pool_blocks size rank 0's."""
    from verifypd.model.kv_pool import PoolGeometry

    if options.get("num_blocks") is not None:
        return options["num_blocks"]
    s = model.shape
    per_block = PoolGeometry(model.num_layers, 1, options["block_size"], s.num_kv_heads, s.head_dim).bytes_per_block(
        dtype
    )
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * options["gpu_memory_fraction"]) // per_block
    return min(4096, max(256, (1 << 30) // per_block))


class Follower:
    def __init__(self, sock: socket.socket, options: dict):
        from verifypd.lanes.tensor_parallel.ranks import init_group
        from verifypd.model.llama import PagedLlama
        from verifypd.model.tensor_parallel import load_target_shard, shard_shape

        self.sock, self.options = sock, options
        self.rank, world = options["rank"], options["world"]
        self.device = torch.device(options["device"])
        self.dtype = getattr(torch, options["dtype"])
        from verifypd.model.kv_quant import kv_cache_dtype

        self.kv_dtype = kv_cache_dtype(options.get("kv_cache_dtype", "auto"), self.dtype, self.device)
        self.group = init_group(
            self.rank, world, options["init_file"], self.device, options.get("tp_all_reduce", "auto")
        )
        loaded = load_target_shard(
            options["target"],
            self.rank,
            world,
            self.device,
            self.dtype,
            options["max_context"],
            options.get("quantization"),
        )
        self.model = PagedLlama(shard_shape(loaded.shape, world), loaded.weights)
        self.model.tp_group = self.group
        self.pool: KvPool | None = None
        self.runner: ModelRunner | None = None  # over the pool, once it is built or imported

    def own_pool(self) -> bytes:
        """Builds this rank's pool and runner ("private" / "shared"); returns the ready answer."""
        from verifypd.lanes.tensor_parallel.ranks import agree_blocks
        from verifypd.model.build import capture_graphs
        from verifypd.model.kv_pool import KvPool, PoolGeometry
        from verifypd.model.runner import ModelRunner

        o, s = self.options, self.model.shape
        blocks = agree_blocks(self.group, pool_budget(self.model, o, self.device, self.kv_dtype), self.device)
        geometry = PoolGeometry(self.model.num_layers, blocks, o["block_size"], s.num_kv_heads, s.head_dim)
        shared_cpu = o["pool"] == "shared" and self.device.type == "cpu"
        self.pool = pool = (
            KvPool.create_shared_cpu("target", geometry, self.kv_dtype)
            if shared_cpu
            else KvPool("target", geometry, self.kv_dtype, self.device)
        )
        pool.generation = o.get("generation", 1)
        buckets = tuple(o["graph_buckets"]) if o.get("graph_buckets") else None
        self.runner = runner = ModelRunner(
            self.model, pool, graphs=None if o["cuda_graphs"] else False, buckets=buckets
        )
        capture_graphs(runner, None, o["k_max"], prefill=False)
        log.info("tensor-parallel rank %d ready: %s", self.rank, pool.summary())
        if o["pool"] != "shared":
            return b""
        from verifypd.lanes.rpc.kv_transport import describe_pool

        return describe_pool(pool).SerializeToString()

    def import_pool(self, payload: bytes) -> None:
        """IMPORT: opens the matching owner rank's pool (same host and device only)."""
        from verifypd.lanes.rpc import kv_transport as kv
        from verifypd.model.runner import ModelRunner
        from verifypd.v1 import lanes_pb2

        d = lanes_pb2.PoolDescriptor.FromString(payload)
        if not kv.colocated(d, self.device):
            raise ValueError(f"pool {d.pool_id} is on another host or device than rank {self.rank} ({self.device})")
        s = self.model.shape
        if (d.num_layers, d.num_kv_heads, d.head_dim) != (self.model.num_layers, s.num_kv_heads, s.head_dim):
            raise ValueError(
                f"pool {d.pool_id} holds {d.num_kv_heads} kv heads x {d.head_dim} in {d.num_layers} "
                f"layers; rank {self.rank} computes {s.num_kv_heads} x {s.head_dim} in {self.model.num_layers}"
            )
        self.pool = pool = kv.open_pool(d)
        self.runner = ModelRunner(self.model, pool, graphs=False)  # prefill: eager forwards only

    def serve(self) -> int:
        """Runs rank 0's calls until STOP or EOF; returns the exit status."""
        from verifypd.model.layout import TokenRun

        expected = 1
        while True:
            call = tp_calls.receive(self.sock, TokenRun)
            if call is None or call.kind == tp_calls.STOP:
                return 0
            if call.seq != expected:
                log.error("tensor-parallel call %d arrived, expected %d: out of step with rank 0", call.seq, expected)
                return 1
            expected += 1
            if call.kind == tp_calls.IMPORT:
                try:
                    self.import_pool(call.payload)
                except (ValueError, OSError, RuntimeError) as exc:
                    tp_calls.send_reply(self.sock, error=str(exc))
                    continue
                tp_calls.send_reply(self.sock)
                continue
            if self.runner is None:
                raise RuntimeError(f"tensor-parallel call {call.seq} arrived before this rank had a pool (IMPORT)")
            if call.kind == tp_calls.FORWARD:
                self.runner.forward(call.runs, call.logits_for)
            elif call.kind == tp_calls.SCORE:
                ids = None
                if call.draft_k:
                    ids = torch.empty(len(call.runs), call.draft_k, dtype=torch.int64, device=self.device)
                    self.group.broadcast(ids, 0)
                self.runner.score(call.runs, ids)
            else:
                self.runner.last_logits(call.runs)

    def close(self) -> None:
        if self.pool is not None and self.pool.shm_path and self.options["pool"] == "shared":
            self.pool.close()  # removes this rank's /dev/shm file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verifypd.lanes.tensor_parallel.follower")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--options", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("VERIFYPD_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    options = json.loads(args.options)
    _exit_with_parent(options["parent_pid"])
    sock = socket.socket(fileno=args.control_fd)
    follower = None
    try:
        follower = Follower(sock, options)
        ready = follower.own_pool() if options["pool"] in ("private", "shared") else b""
        tp_calls.send_reply(sock, ready)
        return follower.serve()
    except Exception as exc:
        log.exception("tensor-parallel rank %s failed", options.get("rank"))
        try:
            tp_calls.send_reply(sock, error=f"{type(exc).__name__}: {exc}")
        except OSError:
            pass
        return 1
    finally:
        if follower is not None:
            follower.close()


if __name__ == "__main__":
    sys.exit(main())

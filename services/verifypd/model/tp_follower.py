"""A follower rank of a tensor-parallel target: `python -m verifypd.model.tp_follower --control-fd N
--options JSON` (started by tp_ranks.LeaderRanks, never by hand).

It joins the group, loads its shard, builds its KV pool (its kv heads; num_blocks agreed with the
other ranks) and its runner, captures the same CUDA graphs as rank 0, then runs rank 0's calls
(tp_ranks.serve_calls) until rank 0 stops it or goes away. Options (JSON, from rank 0): rank, world,
init_file, device, parent_pid, target, dtype, max_context, block_size, num_blocks,
gpu_memory_fraction, cuda_graphs, graph_buckets, k_max. This rank's pool budget is computed here
from its own memory, as rank 0 computes its own; the ranks then take the minimum.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading

import torch


def _exit_with_parent(parent: int) -> None:
    """Rank 0 gone (even by SIGKILL) while this rank waits inside a collective: exit."""
    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(0.5)
        os._exit(3)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def pool_budget(model, options: dict, device: torch.device, dtype: torch.dtype) -> int:
    """This rank's blocks, as local_engine.make_pools sizes rank 0's (without a draft pool)."""
    from verifypd.model.kv_pool import PoolGeometry

    if options.get("num_blocks") is not None:
        return options["num_blocks"]
    s = model.shape
    per_block = PoolGeometry(model.num_layers, 1, options["block_size"], s.num_kv_heads, s.head_dim).bytes_per_block(dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * options["gpu_memory_fraction"]) // per_block
    return min(4096, max(256, (1 << 30) // per_block))


def follower_main(sock: socket.socket, options: dict) -> int:
    from verifypd.local_engine import capture_graphs
    from verifypd.model.kv_pool import KvPool, PoolGeometry
    from verifypd.model.llama import PagedLlama
    from verifypd.model.runner import ModelRunner
    from verifypd.model.tensor_parallel import load_target_shard, shard_shape
    from verifypd.model.tp_ranks import agree_blocks, init_group, serve_calls

    rank, world = options["rank"], options["world"]
    device = torch.device(options["device"])
    dtype = getattr(torch, options["dtype"])
    group = init_group(rank, world, options["init_file"], device)
    loaded = load_target_shard(options["target"], rank, world, device, dtype, options["max_context"])
    model = PagedLlama(shard_shape(loaded.shape, world), loaded.weights)
    model.tp_group = group
    blocks = agree_blocks(group, pool_budget(model, options, device, dtype), device)
    s = model.shape
    pool = KvPool("target", PoolGeometry(model.num_layers, blocks, options["block_size"], s.num_kv_heads, s.head_dim),
                  dtype, device)
    buckets = tuple(options["graph_buckets"]) if options.get("graph_buckets") else None
    runner = ModelRunner(model, pool, graphs=None if options["cuda_graphs"] else False, buckets=buckets)
    capture_graphs(runner, None, options["k_max"])
    logging.getLogger("verifypd.tp").info("tensor-parallel rank %d of %d ready on %s (%d blocks)",
                                           rank, world, device, blocks)
    return serve_calls(runner, group, sock)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verifypd.model.tp_follower")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--options", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("VERIFYPD_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = json.loads(args.options)
    _exit_with_parent(options["parent_pid"])
    sock = socket.socket(fileno=args.control_fd)
    try:
        return follower_main(sock, options)
    except Exception:
        logging.getLogger("verifypd.tp").exception("tensor-parallel rank %s failed", options.get("rank"))
        return 1


if __name__ == "__main__":
    sys.exit(main())

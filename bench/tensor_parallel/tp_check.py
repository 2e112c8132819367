"""Tensor parallelism on the GPU, one rank per GPU, started by torchrun:

  * check: a small random Llama in float32, TP = N (NCCL, the Triton kernels, CUDA graphs when
    --graphs) against TP = 1 on rank 0's GPU: logits of a ragged prefill, 16 paged decode steps and a
    3-token verify (tolerance 1e-4; the Triton kernels sum in another order than the reference), and
    the greedy tokens, which must be identical;
  * time (--time-shape NAME, a loader.RANDOM_SHAPES name): k = 0 decode step (one token per
    sequence, graph replay) at each --batches, bf16, this world size; each rank holds only its own
    random shard (a 70B shape never exists whole on one GPU), so run it once with N = 1 and once with
    N = 2 to compare. Also a separate all-reduce time of one [B, hidden] tensor x 2 per layer (an
    estimate of the collectives' share of the step).

    torchrun --nproc-per-node 2 bench/tensor_parallel/tp_check.py --graphs --time-shape llama-2-7b --out bench/results
    torchrun --nproc-per-node 1 bench/tensor_parallel/tp_check.py --graphs --time-shape llama-2-7b --out bench/results
    torchrun --nproc-per-node 2 bench/tensor_parallel/tp_check.py --device cpu   # gloo + reference attention (CI smoke)

bench/tensor_parallel/tensor_parallel_targets.py runs it at world 1 and 2 and the engine part of the
tensor-parallel targets in one command. Not run on GPUs yet (no two-GPU machine was lent while it was written).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench_meta

from bench_meta import metadata, write_result

from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.layout import TokenRun
from verifypd.model.loader import RANDOM_SHAPES, random_model, random_shape
from verifypd.model.runner import ModelRunner
from verifypd.model.tensor_parallel import SingleRank, TorchDistributedGroup, shard_model, shard_shape

BLOCK_SIZE = 16
CHECK_SHAPE = dict(hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=4, vocab_size=1000)
PROMPTS = ([5, 17, 9, 33, 41, 8, 12], [3, 70, 22, 22, 61, 14, 90, 7, 45, 30, 11] * 3)


def make_runner(model, device, num_blocks: int, graphs: bool) -> ModelRunner:
    s = model.shape
    pool = KvPool(
        "target",
        PoolGeometry(s.num_layers, num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim),
        model.weights.embed.dtype,
        device,
    )
    return ModelRunner(model, pool, graphs=graphs)


def greedy_trace(runner: ModelRunner, steps: int = 16) -> dict:
    blocks = [tuple(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]  # 128 positions each
    prefill = runner.forward([TokenRun(list(p), 0, b) for p, b in zip(PROMPTS, blocks, strict=False)], "all")
    last = torch.tensor([len(PROMPTS[0]) - 1, len(PROMPTS[0]) + len(PROMPTS[1]) - 1], device=prefill.device)
    tokens = [prefill[last].argmax(-1).tolist()]
    positions, decode = [len(p) for p in PROMPTS], []
    for _ in range(steps):
        logits = runner.last_logits(
            [TokenRun([t], p, b) for t, p, b in zip(tokens[-1], positions, blocks, strict=False)]
        )
        decode.append(logits[: len(PROMPTS)].clone())
        tokens.append(decode[-1].argmax(-1).tolist())
        positions = [p + 1 for p in positions]
    verify = runner.score([TokenRun([t, 4, 50], p, b) for t, p, b in zip(tokens[-1], positions, blocks, strict=False)])
    return dict(prefill=prefill, decode=torch.stack(decode), verify=verify[: len(PROMPTS)].clone(), tokens=tokens)


def check(group, device, graphs: bool) -> dict:
    RANDOM_SHAPES["tp-check"] = CHECK_SHAPE
    loaded = random_model("tp-check", device, torch.float32, 256)  # same seed: the same full weights everywhere
    sharded = greedy_trace(make_runner(shard_model(loaded.shape, loaded.weights, group), device, 64, graphs))
    if group.rank != 0:
        return {}
    single = greedy_trace(make_runner(shard_model(loaded.shape, loaded.weights, SingleRank()), device, 64, graphs))
    diffs = {phase: float((sharded[phase] - single[phase]).abs().max()) for phase in ("prefill", "decode", "verify")}
    ok = all(d <= 1e-4 for d in diffs.values()) and sharded["tokens"] == single["tokens"]
    print(
        f"check world={group.world} graphs={graphs}: max |diff| {diffs}, tokens equal "
        f"{sharded['tokens'] == single['tokens']} -> {'OK' if ok else 'FAIL'}",
        flush=True,
    )
    return dict(max_abs_diff=diffs, tokens_equal=sharded["tokens"] == single["tokens"], ok=ok)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(group, device, name: str, batches: list[int], graphs: bool, context: int = 512) -> dict:
    """k = 0 decode step of this rank's random shard of `name`, bf16."""
    full, _ = random_shape(name, 4096)
    local = shard_shape(full, group.world)
    dims = {k: v for k, v in dataclasses.asdict(local).items() if k != "max_context"}
    RANDOM_SHAPES["tp-shard"] = dims
    loaded = random_model("tp-shard", device, torch.bfloat16, 4096, seed=group.rank)
    model = shard_model(local, loaded.weights, SingleRank())  # already a shard: attach the group by hand
    if group.world > 1:
        model.tp_group = group
    blocks_per_seq = -(-(context + 64) // BLOCK_SIZE)
    runner = make_runner(model, device, blocks_per_seq * max(batches), graphs)
    rows = {}
    for batch in batches:
        runs = [
            TokenRun([7], context, tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i in range(batch)
        ]
        for _ in range(3):
            runner.last_logits(runs)
        sync(device)
        dist.barrier()
        t0, reps = time.perf_counter(), 20
        for _ in range(reps):
            runner.last_logits(runs)
        sync(device)
        step = (time.perf_counter() - t0) / reps
        x = torch.zeros(batch, full.hidden_size, dtype=torch.bfloat16, device=device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            for _ in range(2 * full.num_layers):
                group.all_reduce(x)  # eager: the group's own path (NCCL, or the custom kernel)
        sync(device)
        reduce = (time.perf_counter() - t0) / reps if group.world > 1 else 0.0
        rows[batch] = dict(step_ms=step * 1e3, all_reduce_ms_per_step=reduce * 1e3)
        if group.rank == 0:
            print(
                f"{name} tp={group.world} batch {batch}: step {step * 1e3:.3f} ms, "
                f"all-reduce (separate) {reduce * 1e3:.3f} ms",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (NCCL collectives captured)")
    ap.add_argument("--time-shape", default=None, help="a random shape to time, e.g. llama-2-7b, llama-2-70b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out", default=None, help="directory for the result JSON (rank 0)")
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        os.environ["VERIFYPD_ATTENTION"] = "reference"
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    group = TorchDistributedGroup()
    dist.all_reduce(torch.zeros(1, device=device))  # creates the communicator before any capture
    result = dict(
        metadata(),
        world=group.world,
        graphs=args.graphs,
        check=check(group, device, args.graphs and args.device == "cuda"),
    )
    if args.time_shape:
        result["time"] = dict(
            shape=args.time_shape,
            dtype="bfloat16",
            context=512,
            rows=time_decode(
                group,
                device,
                args.time_shape,
                [int(b) for b in args.batches.split(",")],
                args.graphs and args.device == "cuda",
            ),
        )
    if group.rank == 0:
        write_result(args.out, f"tp_check_tp{group.world}", result)
    dist.destroy_process_group()
    if group.rank == 0 and not result["check"]["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

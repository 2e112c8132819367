"""The tensor-parallel all-reduce paths on one host: the custom one-shot / two-shot kernel
(model/custom_all_reduce.py) against NCCL. Starts its own ranks (one process per GPU) and writes one
JSON to --out:

  1. set-up: the custom path as `--tp-all-reduce custom` builds it (peer check, CUDA IPC mapping,
     self-check); its error, if any, is recorded and the rest runs with NCCL only;
  2. latency per message size (bf16, 8 KB .. 64 MB): NCCL, one-shot (<= the slot size), two-shot,
     and what the group picks ("custom" = the automatic choice), eager (host launch included) and
     as 50 calls captured in one CUDA graph (the serving case); each custom result is compared
     with NCCL's (max |diff|; 2 ranks: every element is one rounding of a + b, so equal);
  3. greedy agreement: a small random Llama, TP = N (each all-reduce path, CUDA graphs) against TP = 1
     in float32 and bf16: max logit difference and greedy-token agreement (bf16 sums in another
     order than one GPU's matmul, so logits differ by rounding and a near-tie can flip a token:
     reported, not asserted);
  4. k = 0 decode step of --shape (default llama-2-7b, random weights, bf16, context 512) at
     batch 1 and 64, TP = N with each path, then TP = 1 in a process of its own.
Targets (2 x H200): one-shot 8 KB in a graph <= 10 us; step TP2 <= 0.6 x TP1 at batch 1;
throughput TP2 >= 1.7 x TP1 at batch 64 (same batch: step(TP1) / step(TP2)).

    python bench/tensor_parallel/all_reduce.py --out bench/results/all_reduce_2gpu.json
    python bench/tensor_parallel/all_reduce.py --smoke --out /tmp/all_reduce_smoke.json   # CPU, gloo

Each section's result is written as soon as it exists: a section that fails records its error and
the rest still runs; a rank that hangs (a wait that never ends) is killed after --timeout-s and the
JSON says in which section. NVLink multicast stays off (the variables below are set if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in NO_MULTICAST.items():
    os.environ.setdefault(_name, _value)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "services"))
sys.path.insert(0, os.path.join(HERE, ".."))  # bench_meta
sys.path.insert(0, HERE)  # tp_check

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_meta import metadata  # noqa: E402

SIZES = [8 << 10 << i for i in range(14)]  # 8 KB .. 64 MB
SMOKE_SIZES = [8 << 10, 64 << 10]
PHASES = ("prefill", "decode", "verify")


def save(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def section(result: dict, name: str, path: str, rank: int, fn):
    """Runs one section; records its result or its error (rank 0 writes the partial JSON)."""
    result["running"] = name
    if rank == 0:
        save(path, result)
    try:
        result[name] = fn()
    except Exception as exc:  # recorded, and the next section runs
        traceback.print_exc()
        result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"all_reduce bench: section {name} failed on rank {rank}: {exc}", file=sys.stderr, flush=True)
    result.pop("running", None)
    if rank == 0:
        save(path, result)
    return result[name]


def time_calls(fn, device, calls: int, graph: bool) -> float:
    """Seconds per call of fn() (calls in a row; graph: captured once, replayed)."""
    if device.type != "cuda":
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls
    stream = torch.cuda.Stream()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(calls):
                fn()
        run = g.replay
        reps = 10
    else:

        def run():
            for _ in range(calls):
                fn()

        reps = 3
    run()
    torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / (reps * calls)


def latency(nccl, custom, device, sizes: list[int]) -> list[dict]:
    rows = []
    for nbytes in sizes:
        n = nbytes // 2
        x = torch.empty(n, dtype=torch.bfloat16, device=device)
        row: dict = dict(bytes=nbytes)
        paths = {"nccl": (nccl, None)}
        if custom is not None:
            paths["custom"] = (custom, custom.one_shot_max_bytes)  # the automatic choice
            if nbytes <= custom.max_bytes:
                paths["one-shot"] = (custom, 1 << 62)
                paths["two-shot"] = (custom, 0)
        reference = None
        for name, (group, one_shot_max) in paths.items():
            default = None if custom is None else custom.one_shot_max_bytes
            if one_shot_max is not None:
                custom.one_shot_max_bytes = one_shot_max
            try:
                gen = torch.Generator(device=device).manual_seed(7 + group.rank)
                x.copy_(torch.randn(n, generator=gen, device=device, dtype=torch.float32))
                group.all_reduce(x)
                if reference is None:
                    reference = x.clone()
                else:
                    row[f"{name}_max_abs_diff_vs_nccl"] = float((x.float() - reference.float()).abs().max())
                if name == "custom":
                    row["custom_path"] = custom.path(x)
                calls = 50 if nbytes <= (8 << 20) else 5

                def call(g=group, t=x) -> None:
                    g.all_reduce(t)

                row[f"{name}_eager_us"] = round(time_calls(call, device, calls, False) * 1e6, 2)
                if device.type == "cuda":
                    row[f"{name}_graph_us"] = round(time_calls(call, device, calls, True) * 1e6, 2)
            finally:
                if default is not None:
                    custom.one_shot_max_bytes = default
        if nccl.rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def greedy_agreement(groups: dict, device, graphs: bool) -> dict:
    from tp_check import CHECK_SHAPE, greedy_trace, make_runner

    from verifypd.model.loader import RANDOM_SHAPES, random_model
    from verifypd.model.tensor_parallel import SingleRank, shard_model

    RANDOM_SHAPES["tp-check"] = CHECK_SHAPE
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        loaded = random_model("tp-check", device, dtype, 256)  # the same full weights on every rank
        single = None
        rank = next(iter(groups.values())).rank
        if rank == 0:
            whole = shard_model(loaded.shape, loaded.weights, SingleRank())
            single = greedy_trace(make_runner(whole, device, 64, graphs))
        for name, group in groups.items():
            sharded = greedy_trace(make_runner(shard_model(loaded.shape, loaded.weights, group), device, 64, graphs))
            if single is None:
                continue
            diffs = {p: float((sharded[p].float() - single[p].float()).abs().max()) for p in PHASES}
            flat = [t for step in sharded["tokens"] for t in step], [t for step in single["tokens"] for t in step]
            agree = sum(a == b for a, b in zip(*flat, strict=True)) / len(flat[0])
            out[f"{name}_{str(dtype).removeprefix('torch.')}"] = dict(
                max_abs_logit_diff=diffs,
                greedy_tokens_equal=sharded["tokens"] == single["tokens"],
                token_agreement=agree,
            )
    return out


def rank_main(rank: int, world: int, args, work: str) -> None:
    from tp_check import time_decode

    from verifypd.lanes.tensor_parallel.all_reduce import choose_group
    from verifypd.model.tensor_parallel import TorchDistributedGroup

    cuda = not args.smoke
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        os.environ["VERIFYPD_ATTENTION"] = "reference"
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{work}/rendezvous{world}", rank=rank, world_size=world
    )
    path = os.path.join(work, f"world{world}.json")
    result: dict = dict(world=world)
    try:
        nccl = TorchDistributedGroup()
        nccl.all_reduce(torch.zeros(1, device=device))
        shape, batches = ("tp-check", [1, 2]) if args.smoke else (args.shape, [1, 64])
        if args.smoke:
            from tp_check import CHECK_SHAPE

            from verifypd.model.loader import RANDOM_SHAPES

            RANDOM_SHAPES["tp-check"] = CHECK_SHAPE
        if world == 1:
            section(result, "step_tp1", path, rank, lambda: time_decode(nccl, device, shape, batches, cuda))
            return
        made: list = []

        def setup() -> dict:
            made.append(choose_group(nccl, device, "custom"))  # ModelLoadError names why not
            c = made[0]
            return dict(ok=True, max_bytes=c.max_bytes, one_shot_max_bytes=c.one_shot_max_bytes, programs=len(c.state))

        section(result, "setup", path, rank, setup)
        custom = made[0] if made else None
        groups = {"nccl": nccl} if custom is None else {"nccl": nccl, "custom": custom}
        sizes = SMOKE_SIZES if args.smoke else SIZES
        section(result, "latency", path, rank, lambda: latency(nccl, custom, device, sizes))
        section(result, "greedy", path, rank, lambda: greedy_agreement(groups, device, cuda))
        for name, group in groups.items():

            def step(g=group) -> dict:
                return time_decode(g, device, shape, batches, cuda)

            section(result, f"step_tp{world}_{name}", path, rank, step)
    finally:
        if rank == 0:
            save(path, result)
        dist.destroy_process_group()


def spawn(world: int, args, work: str) -> str | None:
    """Runs `world` ranks; None, or why they did not finish."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(rank_main, args=(world, args, work), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + args.timeout_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                return f"timed out after {args.timeout_s} s"
    except Exception as exc:  # a rank raised or died (the others may wait for it forever)
        return f"{type(exc).__name__}: {str(exc)[-2000:]}"
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    return None


def verdicts(result: dict) -> dict:
    out: dict = {}
    rows = result.get("world2", {}).get("latency")
    if isinstance(rows, list) and rows and "one-shot_graph_us" in rows[0]:
        v = rows[0]["one-shot_graph_us"]
        out["one_shot_8kb_graph_us"] = dict(value=v, target="<= 10", met=v <= 10)
        best = {r["bytes"]: min(r.get("one-shot_graph_us", 1e9), r.get("two-shot_graph_us", 1e9)) for r in rows}
        nccl_wins = [r["bytes"] for r in rows if r.get("nccl_graph_us", 1e9) < best[r["bytes"]]]
        out["nccl_faster_from_bytes"] = min(nccl_wins) if nccl_wins else None
    tp1 = result.get("world1", {}).get("step_tp1", {})
    for name in ("custom", "nccl"):
        tp2 = result.get("world2", {}).get(f"step_tp2_{name}", {})
        if isinstance(tp2, dict) and 1 in tp2 and 1 in tp1:
            r1 = tp2[1]["step_ms"] / tp1[1]["step_ms"]
            out[f"step_ratio_b1_{name}"] = dict(value=round(r1, 3), target="<= 0.6", met=r1 <= 0.6)
        if isinstance(tp2, dict) and 64 in tp2 and 64 in tp1:
            r64 = tp1[64]["step_ms"] / tp2[64]["step_ms"]
            out[f"throughput_ratio_b64_{name}"] = dict(value=round(r64, 3), target=">= 1.7", met=r64 >= 1.7)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the result JSON's path")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shape", default="llama-2-7b", help="a loader.RANDOM_SHAPES name (random weights)")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny sizes: checks the plumbing, no timings")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per world size, then its ranks are killed")
    args = ap.parse_args()
    result: dict = dict(
        metadata(),
        weights="random",
        note="custom all-reduce (one-shot / two-shot over CUDA-IPC-mapped buffers) vs NCCL"
        + ("; SMOKE run on the CPU: gloo, the custom path is unavailable, timings meaningless" if args.smoke else ""),
    )
    if not args.smoke:
        if torch.cuda.device_count() < args.world:
            raise SystemExit(f"all_reduce.py: needs {args.world} visible GPUs, found {torch.cuda.device_count()}")
        result["devices"] = [torch.cuda.get_device_name(i) for i in range(args.world)]
    result["environment"] = {k: os.environ.get(k) for k in NO_MULTICAST}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    work = tempfile.mkdtemp(prefix="all-reduce-bench-")
    for world in (args.world, 1):
        error = spawn(world, args, work)
        part = os.path.join(work, f"world{world}.json")
        data = json.load(open(part)) if os.path.exists(part) else {}
        if error:
            data["error"] = error + (f" (in section {data['running']})" if "running" in data else "")
            print(f"all_reduce bench: world {world}: {data['error']}", file=sys.stderr, flush=True)
        result[f"world{world}"] = data
        save(args.out, result)
    result["targets"] = (
        "not evaluated: a CPU smoke run"
        if args.smoke
        else verdicts(json.loads(json.dumps(result), object_hook=int_keys))
    )
    print(json.dumps(result["targets"], indent=1))
    save(args.out, result)
    print("wrote", args.out)


def int_keys(d: dict) -> dict:
    """time_decode's rows are keyed by batch (ints, strings once in JSON)."""
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


if __name__ == "__main__":
    main()

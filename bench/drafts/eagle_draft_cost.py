"""Cost of feature drafts (`--draft eagle:`) on the GPU: a random-weight EAGLE-3 head on a real target
shape, one process, one run.

  * draft step: EagleRunner.draft with k = 1 and k = 5 on fake runs at a fixed context, synchronized;
    (t5 - t1) / 4 is one chain step (a CUDA-graph replay), t1 the catch-up + first choice + set-up;
    against the head's bytes floor (its weights read once per step / measured copy bandwidth);
  * end to end: tok/s of plain decoding (draft none, k = 0) and of the head with SIMULATED
    acceptance (random weights accept nothing real; each draft kept with probability alpha,
    seeded) and adaptive k, per batch, with the speed-up over plain.

    python bench/drafts/eagle_draft_cost.py --out bench/results/eagle_draft_cost_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench_meta
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engine"))  # engine_throughput

from bench_meta import metadata
from engine_throughput import LaneTimes, copy_bandwidth, draft_call_seconds, run_engine

from verifypd.domain.config import RuntimeConfig
from verifypd.engine import Engine, EngineOptions
from verifypd.model.build import load_models
from verifypd.model.eagle_draft import EagleModel, FeatureRun
from verifypd.model.eagle_head import random_eagle_head
from verifypd.model.loader import RANDOM_SHAPES


def head_bytes(model: EagleModel) -> int:
    """Weights one chain step reads (fc runs only in the catch-up)."""
    w = model.weights
    tensors = [w.layer.qkv, w.layer.o, w.layer.gate_up, w.layer.down, w.lm_head]
    return sum(t.numel() * t.element_size() for t in tensors)


def draft_step_times(engine: Engine, batches: list[int], bandwidth: float, context: int = 192) -> list[dict]:
    runner = engine.draft_lane.runner
    per_seq_draft = -(-(context + 8) // runner.block_size)
    per_seq_target = -(-(context + 8) // engine.target_pool.geometry.block_size)
    floor = head_bytes(runner.model) / bandwidth
    rows = []
    for b in batches:
        if (
            b * per_seq_draft > runner.pool.geometry.num_blocks
            or b * per_seq_target > engine.target_pool.geometry.num_blocks
        ):
            continue
        runs = [
            FeatureRun(
                [7],
                context,
                tuple(range(i * per_seq_draft, (i + 1) * per_seq_draft)),
                target_block_ids=tuple(range(i * per_seq_target, (i + 1) * per_seq_target)),
            )
            for i in range(b)
        ]
        t = draft_call_seconds(runner, runs)
        step = (t[5] - t[1]) / 4
        rows.append(
            {
                "batch": b,
                "draft_call_k1_s": round(t[1], 6),
                "draft_call_k5_s": round(t[5], 6),
                "chain_step_s": round(step, 6),
                "head_bytes_floor_s": round(floor, 6),
                "chain_step_over_bytes_floor": round(step / floor, 3),
                **graph_replay_times(runner, b),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def graph_replay_times(runner, batch: int, replays: int = 50) -> dict:
    """Device time of the call's graphs alone (CUDA events around back-to-back replays, after a
    k = 5 call loaded their inputs): the catch-up + first draft at Q = 1, and one chain step as
    (chain of 5 drafts - chain of 2) / 3."""
    graphs = runner.graphs
    if graphs is None:
        return {}
    rows = graphs.bucket(batch)
    keys = {
        "catch_up": ("catch_up", rows, 1, "greedy"),
        2: ("chain", rows, 2, "greedy"),
        5: ("chain", rows, 5, "greedy"),
    }
    if any(key not in graphs._graphs for key in keys.values()):
        return {}
    seconds = {}
    for name, key in keys.items():
        graph = graphs._graphs[key]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        seconds[name] = start.elapsed_time(end) / 1e3 / replays
    return {
        "catch_up_graph_s": round(seconds["catch_up"], 7),
        "chain_step_graph_s": round((seconds[5] - seconds[2]) / 3, 7),
    }


def profile_draft_calls(engine: Engine, out_dir: str, context: int = 192, calls: int = 10) -> dict:
    """torch.profiler over `calls` greedy draft calls at batch 1 with k = 1 and k = 5: CUDA kernels
    and their summed GPU time per call, host wall per call; (k5 - k1) / 4 is one chain step. Writes
    the kernel tables to OUT_DIR/eagle_profile_k{1,5}.txt."""
    from torch.profiler import ProfilerActivity, profile

    from verifypd.domain.requests import SamplingParams

    runner = engine.draft_lane.runner
    blocks = -(-(context + 8) // runner.block_size)
    target_blocks = -(-(context + 8) // engine.target_pool.geometry.block_size)
    runs = [FeatureRun([7], context, tuple(range(blocks)), target_block_ids=tuple(range(target_blocks)))]
    greedy = [SamplingParams()]
    summary = {}
    for k in (1, 5):
        for _ in range(3):  # warm (graph capture, allocations)
            runner.draft(runs, [k], greedy).tolist()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                runner.draft(runs, [k], greedy).tolist()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        pathlib.Path(out_dir, f"eagle_profile_k{k}.txt").write_text(table + "\n")
        summary[k] = {
            "kernels_per_call": len(kernels) / calls,
            "kernel_time_per_call_s": sum(e.time_range.elapsed_us() for e in kernels) / calls / 1e6,
        }
    step = {key: (summary[5][key] - summary[1][key]) / 4 for key in summary[1]}
    result = {"k1_call": summary[1], "k5_call": summary[5], "chain_step": step}
    print(json.dumps({"profile_batch_1": result}), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="llama-2-7b", choices=sorted(RANDOM_SHAPES))
    ap.add_argument("--draft-vocab", type=int, default=0, help="0 = the target's vocabulary (no map)")
    ap.add_argument("--intermediate-size", type=int, default=None, help="head MLP width (default: the target's)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--alphas", default="0.7,0.1", help="simulated acceptance rates (adaptive k)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--skip-engine", action="store_true", help="draft-step timings only")
    ap.add_argument("--profile", metavar="DIR", help="also profile the draft calls at batch 1 (kernel tables into DIR)")
    ap.add_argument("--out", default="eagle_draft_cost.json")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke run of the script
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results = {
        "bench": "eagle_draft_cost",
        **metadata(),
        "target_shape": args.target,
        "draft_vocab": args.draft_vocab or "target's",
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "rows": [],
    }
    bandwidth = copy_bandwidth()
    results["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
    max_blocks = max(batches) * (-(-(args.prompt_len + args.gen_len + 16) // 16) + 1) + 64
    base = dict(
        device=args.device,
        dtype="bfloat16",
        num_blocks=max_blocks,
        max_context=args.prompt_len + args.gen_len + 64,
        graph_buckets=tuple(batches),
    )
    plain_models = load_models(EngineOptions(target=f"random:{args.target}", draft="none", **base))
    target = plain_models.target
    config, weights = random_eagle_head(
        target.shape,
        seed=0,
        draft_vocab=args.draft_vocab or None,
        intermediate_size=args.intermediate_size,
        device=args.device,
        dtype=torch.bfloat16,
    )
    head = EagleModel(config, weights, target.weights.embed)
    results["head_weight_bytes_per_chain_step"] = head_bytes(head)
    eagle_models = dataclasses.replace(plain_models, draft_model=head, draft_name="eagle:random")
    adaptive = RuntimeConfig(k_min=0, k_max=8, k_initial=4, adaptive=True)
    engine = Engine(EngineOptions(config=adaptive, **base), models=eagle_models, simulated_acceptance=0.7)
    results["draft_steps"] = draft_step_times(
        engine, batches, bandwidth, context=min(192, args.prompt_len + args.gen_len // 2)
    )
    if args.profile:
        try:
            results["profile_batch_1"] = profile_draft_calls(
                engine, args.profile, context=min(192, args.prompt_len + args.gen_len // 2)
            )
        except Exception as exc:  # the timings above still count
            print(f"profile failed: {exc!r}", flush=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    del engine
    if args.skip_engine:
        return
    systems = [("k=0 (plain decoding, draft none)", None)] + [
        (f"eagle head, SIMULATED acceptance {a}, k=adaptive", float(a)) for a in args.alphas.split(",")
    ]
    for label, alpha in systems:
        plain_models.target_model.features = None  # the plain engine exports no features
        times = LaneTimes()
        if alpha is None:
            engine = Engine(
                EngineOptions(config=RuntimeConfig(k_min=0, k_max=8, k_initial=0, adaptive=False), **base),
                observer=times,
                models=plain_models,
            )
        else:
            engine = Engine(
                EngineOptions(config=adaptive, **base), observer=times, models=eagle_models, simulated_acceptance=alpha
            )
        for b in batches:
            run_engine(engine, times, b, args.prompt_len, 16, seed=1000 + b)  # warm-up
            r = run_engine(engine, times, b, args.prompt_len, args.gen_len, seed=b)
            row = {"system": label, "simulated_acceptance": alpha, "batch": b, **r}
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=2)
        del engine
        torch.cuda.empty_cache()
    plain = {r["batch"]: r["tok_per_s"] for r in results["rows"] if r["simulated_acceptance"] is None}
    for row in results["rows"]:
        row["speedup_vs_k0"] = round(row["tok_per_s"] / plain[row["batch"]], 3)
        print(
            f"{row['system']:48s} batch {row['batch']:>3d}  {row['tok_per_s']:>9.1f} tok/s  "
            f"x{row['speedup_vs_k0']:.2f}  mean k {row['mean_k']}"
        )
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()

"""The tensor-parallel targets (docs/engine.md) in one command, on a machine with two GPUs of one host
(device kind nvidia-h200-x2). NOT RUN YET on two GPUs: no such machine was lent while this was built.

    python bench/tensor_parallel/tensor_parallel_targets.py --out bench/results

Runs, each as its own process, and writes one JSON (bench/results/tensor_parallel_targets_<gpu>.json)
with the command, devices, git revision, date, every sub-result and each target's verdict:

  1. bench/tensor_parallel/tp_check.py, world 1 and world 2 (torch.distributed.run, NCCL, CUDA graphs): greedy
     TP = 2 equals TP = 1 in float32 on a small random Llama (logits within 1e-4, tokens identical),
     and the k = 0 decode step of the Llama-2-7B shape (bf16, context 512) at batch 1 and 64, with a
     separately timed all-reduce of [B, hidden] x 2 per layer (the collectives' share of a step).
       targets: step(TP2) <= 0.62 x step(TP1) at batch 1; throughput TP2 >= 1.6 x TP1 at batch 64
       (same batch, so the throughput ratio is step(TP1) / step(TP2)).
  2. bench/engine/engine_throughput.py --tensor-parallel 2: the engine (rank 0 in this process, one
     follower) with the Llama-2-70B shape target and a TinyLlama-shape draft on cuda:0, k = 0 and
     SIMULATED acceptance 0.7 with adaptive k, batches 1 and 32, prompt 128, 128 generated.
       targets: k = 0 step <= 1.25 x the same run's matmul floor at batch 1 (rank 0's shard's
       GEMMs in one graph, no attention, no all-reduce); SIMULATED alpha 0.7 adaptive >= 1.8 x
       its own k = 0 at batch 1 and >= 1.2 x at batch 32.

`--device cpu --target DIR --draft DIR` is a smoke run of the same driver (gloo, tiny local
models, no timings worth reading, no verdicts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # bench_meta

from bench_meta import metadata  # noqa: E402


def run(cmd: list[str], env: dict) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(HERE, "tp_check.py"),
        *args,
    ]


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def verdicts(tp1: dict, tp2: dict, engine: dict) -> dict:
    out = {"tp2_equals_tp1_fp32": tp2["check"]["ok"]}
    s1, s2 = tp1["time"]["rows"], tp2["time"]["rows"]
    b1 = s2["1"]["step_ms"] / s1["1"]["step_ms"]
    b64 = s1["64"]["step_ms"] / s2["64"]["step_ms"]
    out["llama2_7b_step_ratio_b1"] = dict(value=round(b1, 3), target="<= 0.62", met=b1 <= 0.62)
    out["llama2_7b_throughput_ratio_b64"] = dict(value=round(b64, 3), target=">= 1.6", met=b64 >= 1.6)
    out["llama2_7b_all_reduce_ms_per_step"] = {b: s2[b]["all_reduce_ms_per_step"] for b in s2}
    rows = engine["rows"]
    plain = {r["batch"]: r for r in rows if r["system"].startswith("k=0")}
    spec = {r["batch"]: r for r in rows if r["system"].startswith("SIMULATED acceptance 0.7, k=adaptive")}
    floor = plain[1].get("decode_step_over_matmul_floor")
    out["llama2_70b_k0_step_over_matmul_floor_b1"] = dict(
        value=floor, target="<= 1.25", met=floor is not None and floor <= 1.25
    )
    for batch, target in ((1, 1.8), (32, 1.2)):
        ratio = spec[batch]["tok_per_s"] / plain[batch]["tok_per_s"]
        out[f"llama2_70b_simulated_a07_vs_k0_b{batch}"] = dict(
            value=round(ratio, 3), target=f">= {target}", met=ratio >= target, label="SIMULATED acceptance 0.7"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--target", default="llama-2-70b", help="engine part: a random shape or (cpu) a model dir")
    ap.add_argument("--draft", default="tinyllama-1.1b")
    ap.add_argument("--time-shape", default="llama-2-7b")
    args = ap.parse_args()
    result = dict(metadata(), note="tensor-parallel targets; acceptance in the engine part is SIMULATED (alpha 0.7)")
    cuda = args.device == "cuda"
    if cuda:
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit("tensor_parallel_targets.py: needs two visible GPUs (device kind nvidia-h200-x2)")
        result["devices"] = [torch.cuda.get_device_name(i) for i in range(2)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    work = tempfile.mkdtemp(prefix="tp-targets-")
    check = ["--graphs", "--time-shape", args.time_shape, "--batches", "1,64"] if cuda else ["--device", "cpu"]
    for world in (1, 2):
        run(torchrun(world, *check, "--out", os.path.join(work, f"tp{world}")), env)
    suffix = "cpu" if not cuda else result["device"].split()[-1].lower()
    tp1, tp2 = (load(os.path.join(work, f"tp{w}", f"tp_check_tp{w}_{suffix}.json")) for w in (1, 2))
    engine_out = os.path.join(work, "engine.json")
    run(
        [
            sys.executable,
            os.path.join(HERE, "..", "engine", "engine_throughput.py"),
            "--target",
            args.target,
            "--draft",
            args.draft,
            "--device",
            args.device,
            "--tensor-parallel",
            "2",
            "--rows",
            "plain,simulated",
            "--alphas",
            "0.7",
            "--ks",
            "adaptive",
            "--fallback-alphas",
            "",
            "--batches",
            "1,32" if cuda else "1,2",
            "--prompt-len",
            "128" if cuda else "16",
            "--gen-len",
            "128" if cuda else "8",
            "--out",
            engine_out,
        ],
        env,
    )
    engine = load(engine_out)
    result.update(tp_check_tp1=tp1, tp_check_tp2=tp2, engine_tp2=engine)
    result["targets"] = verdicts(tp1, tp2, engine) if cuda else {"tp2_equals_tp1_fp32": tp2["check"]["ok"]}
    print(json.dumps(result["targets"], indent=1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"tensor_parallel_targets_{suffix}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()

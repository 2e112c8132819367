"""Is in-process pdv pipelining safe on the GPU? Repeats one greedy workload through one engine with
the draft call of one group running beside the verify call of the other (two threads, two CUDA
streams, CUDA graphs of two models) and checks that every repetition gives the same tokens.

Every repetition schedules exactly the same batches (fixed k, all requests at once, greedy), and the
engine is deterministic run to run on one GPU (bench/results/determinism_h100.json), so any
difference between repetitions is a concurrency fault. With VERIFYPD_SHARED_CAPTURE_STREAM=1 the
graphs are captured as before the fix (on torch's one default capture stream, so both models'
graphs use one cuBLAS workspace); `--both` runs that too, in a subprocess, for comparison.

    python bench/correctness/pipeline_race.py --out bench/results/pipeline_race_h200.json --both
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "services"))
sys.path.insert(0, str(ROOT / "bench"))


def run(args) -> dict:
    import torch

    from verifypd.domain.config import RuntimeConfig
    from verifypd.domain.requests import RequestSpec
    from verifypd.engine import Engine, EngineOptions

    config = RuntimeConfig(k_min=0, k_max=args.k, k_initial=args.k, adaptive=False, schedule="pdv", pipeline=True)
    engine = Engine(
        EngineOptions(
            target=args.target,
            draft=args.draft,
            dtype=args.dtype,
            config=config,
            max_context=512,
            graph_buckets=(1, 2, 4, 8, 16, 32, 64),
        )
    )
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(100, 31000) for _ in range(args.prompt_tokens)) for _ in range(args.requests)]
    outputs, seconds = [], []
    for rep in range(args.repeats):
        specs = [
            RequestSpec(p, max_tokens=args.max_tokens, stop_at_eos=False, request_id=f"rep{rep}-{i}")
            for i, p in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        done = engine.generate(specs)
        seconds.append(round(time.perf_counter() - t0, 3))
        outputs.append([done[s.request_id].token_ids for s in specs])
    first = outputs[0]
    differing = [rep for rep, out in enumerate(outputs) if out != first]
    requests_differing = sum(any(out[i] != first[i] for out in outputs) for i in range(len(first)))
    return {
        "shared_capture_stream": os.environ.get("VERIFYPD_SHARED_CAPTURE_STREAM") == "1",
        "repeats": args.repeats,
        "repeats_differing_from_first": differing,
        "requests_differing_in_any_repeat": requests_differing,
        "requests": args.requests,
        "seconds_per_repeat": seconds,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="random:llama-2-7b")
    ap.add_argument("--draft", default="random:tinyllama-1.1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--both", action="store_true", help="also run with VERIFYPD_SHARED_CAPTURE_STREAM=1 (subprocess)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run(args)))
        return 0
    from bench_meta import git_revision

    child = [
        sys.executable,
        __file__,
        "--child",
        "--target",
        args.target,
        "--draft",
        args.draft,
        "--dtype",
        args.dtype,
        "--k",
        str(args.k),
        "--requests",
        str(args.requests),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--max-tokens",
        str(args.max_tokens),
        "--repeats",
        str(args.repeats),
    ]
    results = {
        "command": " ".join(["python"] + sys.argv),
        "git_revision": git_revision(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "what": "identical greedy workloads through in-process pipelined pdv (fixed k, random weights); "
        "a repetition that differs from the first is a concurrency fault",
        "runs": [],
    }
    for shared in [False, True] if args.both else [False]:
        env = dict(os.environ, VERIFYPD_SHARED_CAPTURE_STREAM="1" if shared else "0")
        proc = subprocess.run(child, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            results["runs"].append({"shared_capture_stream": shared, "error": proc.stderr[-3000:]})
        else:
            results["runs"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

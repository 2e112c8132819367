"""Host time of one CUDA graph launch (`CUDAGraph.replay`), and whether it depends on what is in flight:
the GPU idle, another graph in flight, or the same graph (the same executable) still in flight. A speculative
step launched ahead (engine.spec_ahead) replays the verify graph of a shape while its previous replay may
still run. Each graph is `--nodes` small kernels in one stream (the embedded model's verify graph holds
~300). Runs on a GPU only.

    python bench/engine/graph_launch.py --nodes 30,300 --out graph_launch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_meta
from bench_meta import metadata


def capture(nodes: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm the kernels outside the capture
            x.mul_(1.0001)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(nodes):
                x.mul_(1.0001)  # one small kernel a node
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def host_us(launch, before=None, reps: int = 50) -> list[float]:
    """Host microseconds of `launch()` after `before()` (what is in flight at that moment)."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if before is not None:
            before()
        t0 = time.perf_counter()
        launch()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="30,300")
    ap.add_argument("--elements", type=int, default=1 << 20, help="elements each kernel scales (sets its GPU time)")
    ap.add_argument("--out", default="graph_launch.json")
    args = ap.parse_args()
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        x = torch.ones(args.elements, device="cuda")
        a, b = capture(nodes, x), capture(nodes, x.clone())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            a.replay()
        torch.cuda.synchronize()
        gpu_ms = (time.perf_counter() - t0) / 20 * 1e3
        cases = {
            "idle": host_us(a.replay),
            "other_in_flight": host_us(b.replay, a.replay),
            "same_in_flight": host_us(a.replay, a.replay),
        }
        row = {
            "nodes": nodes,
            "graph_ms": round(gpu_ms, 3),
            **{f"{k}_us_median": round(statistics.median(v), 1) for k, v in cases.items()},
            **{f"{k}_us_max": round(max(v), 1) for k, v in cases.items()},
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({**metadata(), "device_name": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

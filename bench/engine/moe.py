"""One MoE layer (model.moe) timed at real shapes, RANDOM weights and a random router: the expert
paths against the floor of the ACTIVE parameters.

Paths per (shape, batch of T tokens):
    reference        the loop over experts hit (host-synced; eager only)
    grouped          the block schedule + grouped-GEMM Triton kernel: eager `us`, and `graph_us` captured
                     in one CUDA graph and replayed (the capture itself proves it has no host sync)
    torch_grouped_mm torch._grouped_mm over the pairs sorted by expert (when torch has it), eager and graph
Floors: the bytes of the experts the batch actually touches (3 * I * H each, plus the router) over the
measured device copy bandwidth, and 2 * T * k * 3 * I * H FLOPs over a measured large-matmul rate;
`floor_us` is the larger; `x_floor` = time / floor. `rel_err_vs_reference`: each path's output
(the graph's replay where there is one) against the reference loop's.

    python bench/engine/moe.py --out moe.json                  # GPU: Mixtral-8x7B and Qwen3-30B-A3B layers
    python bench/engine/moe.py --smoke --out moe_smoke.json    # CPU: tiny shapes, Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:  # the Triton kernel on the CPU: its interpreter, chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_meta
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "services"))
from bench_meta import metadata  # noqa: E402

from verifypd.model.moe import MoeWeights, moe_forward, route  # noqa: E402

# (hidden, expert intermediate, experts, top_k, renormalise, float32 routing weights)
SHAPES = {
    "mixtral-8x7b": (4096, 14336, 8, 2, True, True),
    "qwen3-30b-a3b": (2048, 768, 128, 8, True, False),
}
SMOKE_SHAPES = {"tiny-8x2": (64, 96, 8, 2, True, True), "tiny-32x4": (64, 32, 32, 4, True, False)}


def patch_interpreter() -> None:
    """Triton 3.6's interpreter vs numpy >= 2.4 (as tests/conftest.py): read a 1-element bound's element."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def timer(fn, iters: int, cuda: bool) -> float:
    """Median microseconds of fn() (CUDA events around each call on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def graphed(fn):
    """fn captured in a CUDA graph (static inputs are fn's closure); returns (replay, its output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph.replay, out


def grouped_mm_path(x, w: MoeWeights, top_k, normalize, float32_weights):
    """torch._grouped_mm over the pairs sorted by expert (offsets from device counts: no host sync)."""
    weights, ids = route(x, w.router, top_k, normalize, float32_weights)
    flat = ids.flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(w.router.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    token = order // top_k
    h = torch._grouped_mm(x[token], w.gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm((torch.nn.functional.silu(gate) * up).contiguous(), w.down.transpose(1, 2), offs=offs)
    y = (y * weights.flatten()[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def measured_rates(device: torch.device, dtype: torch.dtype, smoke: bool) -> tuple[float, float]:
    """(copy bandwidth bytes/s counting read + write, matmul FLOP/s) measured on `device`."""
    cuda = device.type == "cuda"
    n = (1 << 24) if smoke else (1 << 30)  # bytes of the copied buffer
    src = torch.empty(n // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    copy_us = timer(lambda: dst.copy_(src), 5 if smoke else 20, cuda)
    m = 512 if smoke else 8192
    a = torch.randn(m, m, dtype=dtype, device=device)
    b = torch.randn(m, m, dtype=dtype, device=device)
    mm_us = timer(lambda: a @ b, 3 if smoke else 20, cuda)
    return 2 * n / (copy_us * 1e-6), 2 * m**3 / (mm_us * 1e-6)


def run_shape(name, dims, batches, device, dtype, rates, iters, smoke) -> list[dict]:
    hidden, inter, experts, top_k, normalize, f32 = dims
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return (torch.randn(*size, generator=gen, device=device) * size[-1] ** -0.5).to(dtype)

    w = MoeWeights(rand(experts, hidden), rand(experts, 2 * inter, hidden), rand(experts, hidden, inter))
    bandwidth, flops = rates
    elem = torch.finfo(dtype).bits // 8
    rows = []
    for tokens in batches:
        x = rand(tokens, hidden)
        args = (x, w, top_k, normalize, "silu")
        ids = route(x, w.router, top_k, normalize, f32)[1]
        touched = int(torch.unique(ids).numel())
        active_bytes = (touched * 3 * inter * hidden + experts * hidden) * elem
        floor_us = max(active_bytes / bandwidth, 2 * tokens * top_k * 3 * inter * hidden / flops) * 1e6
        ref = moe_forward(*args, float32_weights=f32, path="reference")
        paths = {
            "reference": partial(moe_forward, *args, float32_weights=f32, path="reference"),
            "grouped": partial(moe_forward, *args, float32_weights=f32, path="grouped"),
        }
        if hasattr(torch, "_grouped_mm") and cuda:
            paths["torch_grouped_mm"] = partial(grouped_mm_path, x, w, top_k, normalize, f32)
        row = dict(
            shape=name,
            tokens=tokens,
            hidden=hidden,
            intermediate=inter,
            experts=experts,
            top_k=top_k,
            experts_touched=touched,
            active_bytes=active_bytes,
            floor_us=round(floor_us, 2),
            paths={},
        )
        for label, fn in list(paths.items()):
            entry: dict = {}
            try:
                out = fn()
                entry["us"] = round(timer(fn, iters, cuda), 2)
                entry["x_floor"] = round(entry["us"] / floor_us, 2)
                if cuda and label != "reference":  # captured once, replayed: the serving path
                    replay, out = graphed(fn)
                    out.zero_()
                    replay()
                    entry["graph_us"] = round(timer(replay, iters, cuda), 2)
                    entry["graph_x_floor"] = round(entry["graph_us"] / floor_us, 2)
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                entry["rel_err_vs_reference"] = float(f"{err:.3g}")
            except Exception as exc:  # an unsupported op on this device/torch: recorded, not fatal
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            row["paths"][label] = entry
        rows.append(row)
        print(json.dumps(row))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--batches", default=None, help="tokens per step (default 1,16,64,256; smoke 1,8)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("no GPU: run with --smoke for the CPU check")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    if args.smoke:
        patch_interpreter()
    table = SMOKE_SHAPES if args.smoke else SHAPES
    names = args.shapes.split(",") if args.shapes else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        sys.exit(f"unknown shape {unknown[0]!r}; known: {', '.join(table)}")
    batches = [int(b) for b in (args.batches or ("1,8" if args.smoke else "1,16,64,256")).split(",")]
    iters = args.iters or (3 if args.smoke else 50)
    rates = measured_rates(device, dtype, args.smoke)
    rows = [r for n in names for r in run_shape(n, table[n], batches, device, dtype, rates, iters, args.smoke)]
    result = {
        **metadata(),
        "labels": ["random weights", "random router (routing not a trained model's)"]
        + (["SMOKE: tiny shapes on CPU, Triton interpreter: times mean nothing"] if args.smoke else []),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "copy_bandwidth_gbps": round(rates[0] / 1e9, 1),
        "matmul_tflops": float(f"{rates[1] / 1e12:.3g}"),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()

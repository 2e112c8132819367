"""Engine throughput on the GPU against same-run hardware floors (one process, one run).

Models: real *shapes* with random bf16 weights. Random weights give ~0 acceptance between two
different models, so speculative rows use SIMULATED ACCEPTANCE (real draft and verify compute,
each draft token kept with probability alpha, seeded) and say so in every row; "draft = target"
rows use the target itself as draft (real acceptance, ~1 by construction: the overhead check).

Floors measured in the same run:
  * matmul floor: every weight matrix of the model once, batch B, in one CUDA graph (no attention);
  * bytes floor: (weight bytes + KV bytes read at the mean context) / measured device copy bandwidth.
Rows report end-to-end tok/s (B requests, prompt P, exactly G generated, prefill included) and
the median lane-call times of the decode phase against those floors. In-process draft calls
return before their GPU work ends (tokens stay on the device), so "verify ms" of a speculative
row is the whole draft + verify step and "draft ms" only the draft call's host time; the draft
step itself is timed on its own (draft_steps).

    python bench/engine/engine_throughput.py --out bench/results/engine_throughput_h100.json

Adaptive k at low acceptance against plain decoding (the target: >= 0.98 x k = 0), with
an alpha 0.7 adaptive row to show drafting still pays:

    python bench/engine/engine_throughput.py --rows plain,simulated --alphas 0.7 --ks adaptive --fallback-alphas 0.1 \
        --batches 1,16,64 --gen-len 128 --out bench/results/engine_throughput_h200.json

(`--alphas ''` leaves the alpha 0.7 row out.)

The peer of the k = 0 row, the same weights as a torch.compile'd static-batch decoder
(bench/engine/static_decoder.py; every row then carries over_compiled_decoder):

    python bench/engine/engine_throughput.py --rows plain,simulated,compiled --alphas 0.7 --ks adaptive \
        --fallback-alphas 0.1 --batches 1,16,64 --gen-len 128

Each row splits its wall time into steps that ran a prefill call and decode-only steps (median of
those, the slowest steps): where a gap to k = 0 or to the peer sits. `--draft none` runs plain rows
without a draft; `--prefill-budget` sets RuntimeConfig.prefill_token_budget; `--overlap on` (the default, as
in `serve`) sets RuntimeConfig.overlap (overlapped plain decoding, docs/engine.md "Overlapped
scheduling") for every row, `--overlap off` clears it, `--overlap both` runs the plain rows without
and with it and the others with it; rows count the steps launched ahead
(`overlap_steps`).

Rows also count the router's k decisions: how many drafted on their merits and how many were
probes (k = 1 for requests whose draft needs no catch-up). `--device cpu` with local model
directories as --target/--draft is a smoke run (no floors, no draft-step timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # static_decoder
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench_meta

# determinism.py, draft_acceptance.py and self_draft_acceptance.py import git_revision from here.
from bench_meta import git_revision

from verifypd.core.assembly import load_stack_models
from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec
from verifypd.engine import Engine, EngineOptions
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import RANDOM_SHAPES
from verifypd.router.router import EngineObserver


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(256 * 1024 * 1024, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(times[2:])


def matmul_floor(model, batch: int) -> float:
    """Seconds for every weight matrix once at this batch, replayed from one CUDA graph."""
    w = model.weights
    x = torch.randn(batch, model.shape.hidden_size, device="cuda", dtype=w.embed.dtype)
    inter = torch.randn(batch, model.shape.intermediate_size, device="cuda", dtype=w.embed.dtype)
    attn = torch.randn(batch, model.shape.num_heads * model.shape.head_dim, device="cuda", dtype=w.embed.dtype)

    def run():
        for layer in w.layers[: model.num_layers]:
            torch.mm(x, layer.qkv.t())
            torch.mm(attn, layer.o.t())
            torch.mm(x, layer.gate_up.t())
            torch.mm(inter, layer.down.t())
        torch.mm(x, w.lm_head.t())

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return _median_replay(graph)


def _median_replay(graph, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times[3:])


def weight_bytes(model) -> int:
    w = model.weights
    mats = [t for layer in w.layers[: model.num_layers] for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return sum(t.numel() * t.element_size() for t in mats + [w.lm_head])


def kv_bytes(model, batch: int, context: int) -> int:
    s = model.shape
    return batch * context * model.num_layers * 2 * s.num_kv_heads * s.head_dim * 2


class LaneTimes(EngineObserver):
    def __init__(self):
        self.calls: list[tuple[str, float, int]] = []

    def on_lane_step(self, lane: str, seconds: float, batch: int) -> None:
        self.calls.append((lane, seconds, batch))


def random_prompts(count: int, length: int, seed: int, vocab: int = 31000) -> list[tuple[int, ...]]:
    """`count` prompts of `length` random token ids in [100, 31000) (a smaller vocabulary: its upper
    half), reproducible by seed."""
    gen = torch.Generator().manual_seed(seed)
    low, high = min(100, vocab // 2), min(31000, vocab)
    return [tuple(torch.randint(low, high, (length,), generator=gen).tolist()) for _ in range(count)]


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def model_spec(name: str) -> str:
    """A random-weight shape name, or a local model directory (tiny checkpoints for a CPU smoke run)."""
    if os.path.isdir(name) or name == "none":  # none: no draft (plain rows only)
        return name
    if name not in RANDOM_SHAPES:
        raise SystemExit(
            f"engine_throughput.py: error: {name!r} is neither a shape ({', '.join(sorted(RANDOM_SHAPES))}) "
            f"nor a model directory"
        )
    return f"random:{name}"


def run_engine(engine: Engine, times: LaneTimes, batch: int, prompt_len: int, gen_len: int, seed: int) -> dict:
    router = engine.router
    for i, prompt in enumerate(random_prompts(batch, prompt_len, seed, router.vocab_size)):
        router.add_request(RequestSpec(prompt, max_tokens=gen_len, stop_at_eos=False, request_id=f"s{seed}-{i}"))
    times.calls.clear()
    probes = router.scheduler.probes  # the draft-length policy's decisions (draft_length.ProbeSchedule)
    decisions0 = (probes.decisions, probes.drafting, probes.probes)
    synchronize()
    t0 = time.perf_counter()
    produced = drafted = accepted = steps = 0
    ks = []
    step_s, prefill_step = [], []  # each step's wall time, and whether it ran a prefill call
    while router.has_work():
        steps += 1
        calls0, t_step = len(times.calls), time.perf_counter()
        for out in router.step():
            produced += len(out.token_ids)
            ks.append(out.applied_k)
            if out.finished:
                drafted += out.stats.draft_tokens
                accepted += out.stats.accepted_tokens
        step_s.append(time.perf_counter() - t_step)
        prefill_step.append(any(name == "prefill" for name, _, _ in times.calls[calls0:]))
    seconds = time.perf_counter() - t0

    def median(lane):
        xs = [s for name, s, b in times.calls if name == lane and b == batch]
        return statistics.median(xs) if xs else None

    draft_calls = [s for name, s, b in times.calls if name == "draft"]
    decisions, drafting, probed = (
        now - then for now, then in zip((probes.decisions, probes.drafting, probes.probes), decisions0, strict=False)
    )
    return {
        "tokens": produced,
        "seconds": round(seconds, 4),
        "tok_per_s": round(produced / seconds, 1),
        "steps": steps,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_k": round(sum(ks) / len(ks), 3) if ks else 0,
        "verify_call_s": median("verify"),
        "draft_call_s": median("draft"),
        # every draft call, whatever its batch (a probe may draft for part of the batch)
        "draft_calls": len(draft_calls),
        "draft_call_max_s": max(draft_calls) if draft_calls else None,
        "k_decisions": decisions,
        "drafting_decisions": drafting,
        "probe_decisions": probed,
        **step_split(step_s, prefill_step),
    }


def step_split(step_s: list[float], prefill_step: list[bool]) -> dict:
    """Where a row's wall time went: steps that ran a prefill call (prompts entering, chunked by the
    prefill token budget) against decode-only steps, and the slowest steps."""
    with_prefill = [s for s, p in zip(step_s, prefill_step, strict=False) if p]
    decode_only = [s for s, p in zip(step_s, prefill_step, strict=False) if not p]
    return {
        "prefill_steps": len(with_prefill),
        "prefill_steps_s": round(sum(with_prefill), 4),
        "decode_only_steps": len(decode_only),
        "decode_only_steps_s": round(sum(decode_only), 4),
        "decode_only_step_median_s": round(statistics.median(decode_only), 6) if decode_only else None,
        "slowest_steps_s": [round(s, 4) for s in sorted(step_s)[-3:]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--target",
        default="llama-2-7b",
        help=f"a random-weight shape ({', '.join(sorted(RANDOM_SHAPES))}) or a local model directory",
    )
    ap.add_argument("--draft", default="tinyllama-1.1b", help="as --target")
    ap.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: a smoke run of the rows (no hardware floors, no draft-step timing)",
    )
    ap.add_argument("--batches", default="1,4,16,64,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--alphas", default="0.5,0.7,0.9", help="simulated acceptance rates")
    ap.add_argument("--ks", default="1,2,3,4,5,6,adaptive")
    ap.add_argument(
        "--fallback-alphas",
        default="0.1",
        help="simulated acceptance rates run with adaptive k only (must fall back to plain decoding)",
    )
    ap.add_argument(
        "--rows",
        default="plain,simulated,self",
        help="which row families to run (plain, simulated, self; compiled: the torch.compile'd "
        "static-batch decoder of bench/engine/static_decoder.py, the peer of k = 0, CUDA only)",
    )
    ap.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="the target over N GPUs (cuda:0..N-1; this process is rank 0, the draft stays on cuda:0); "
        "floors are then rank 0's shard's; the self rows are left out",
    )
    ap.add_argument("--tp-all-reduce", choices=("auto", "custom", "nccl"), default="auto", help="the ranks' all-reduce")
    ap.add_argument(
        "--memory-test",
        action="store_true",
        help="only: 128 concurrent requests of 1000 + 1000 tokens, KV pools sized from free memory",
    )
    ap.add_argument(
        "--prefill-budget",
        type=int,
        default=RuntimeConfig().prefill_token_budget,
        help="prompt tokens prefilled per engine step (RuntimeConfig.prefill_token_budget)",
    )
    ap.add_argument(
        "--overlap",
        choices=("on", "off", "both"),
        default="on",
        help="RuntimeConfig.overlap for every engine row (overlapped plain decoding); both: the "
        "plain rows twice, without and with it (the other rows with it, the serving default)",
    )
    ap.add_argument("--out", default="engine_throughput.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    families = args.rows.split(",")
    if args.tensor_parallel > 1:  # a self-draft or the compiled peer would run rank 0's shard alone
        families = [f for f in families if f not in ("self", "compiled")]
    cuda = args.device == "cuda"
    results = {
        "command": " ".join(["python"] + sys.argv),
        "git_revision": git_revision(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "weights": "random (bf16)",
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "target_shape": args.target,
        "draft_shape": args.draft,
        "tensor_parallel": args.tensor_parallel,
        "tp_all_reduce": args.tp_all_reduce,
        "devices": [torch.cuda.get_device_name(i) for i in range(args.tensor_parallel)] if cuda else ["cpu"],
        "prefill_token_budget": args.prefill_budget,
        "overlap": args.overlap,
        "rows": [],
    }
    if args.memory_test:
        return memory_test(args, results)
    max_blocks = max(batches) * (-(-(args.prompt_len + args.gen_len + 16) // 16) + 1) + 64
    base = dict(
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        num_blocks=max_blocks,
        max_context=args.prompt_len + args.gen_len + 64,
        graph_buckets=tuple(batches) if cuda else None,
        tensor_parallel=args.tensor_parallel,
        tp_all_reduce=args.tp_all_reduce,
    )
    t0 = time.perf_counter()
    target_models = load_stack_models(
        EngineOptions(target=model_spec(args.target), draft=model_spec(args.draft), **base)
    )
    results["load_seconds"] = round(time.perf_counter() - t0, 1)
    tm, dm = target_models.target_model, target_models.draft_model
    floors = {}
    if cuda:
        bandwidth = copy_bandwidth()
        results["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
        for b in batches:
            ctx = args.prompt_len + args.gen_len // 2
            floors[b] = {
                "target_matmul_s": matmul_floor(tm, b),
                "target_bytes_s": (weight_bytes(tm) + kv_bytes(tm, b, ctx)) / bandwidth,
            }
            if dm is not None:  # --draft none: no draft
                floors[b].update(
                    draft_matmul_s=matmul_floor(dm, b),
                    draft_bytes_s=(weight_bytes(dm) + kv_bytes(dm, b, ctx)) / bandwidth,
                )
        results["floors"] = {str(b): {k: round(v * 1e3, 3) for k, v in f.items()} for b, f in floors.items()}
        results["floors_unit"] = "ms per step"
        print(
            f"# {results['device']}  copy {results['copy_bandwidth_GBps']} GB/s  (rev {results['git_revision'][:10]})"
        )
        print("# floors (ms):", json.dumps(results["floors"]), flush=True)

    configs = []
    if "plain" in families:  # --overlap both: the plain rows without, then with overlapped steps
        for overlap in {"off": [False], "on": [True], "both": [False, True]}[args.overlap]:
            configs.append(
                (
                    PLAIN + (OVERLAPPED if overlap else ""),
                    None,
                    RuntimeConfig(
                        k_min=0,
                        k_max=8,
                        k_initial=0,
                        adaptive=False,
                        overlap=overlap,
                        prefill_token_budget=args.prefill_budget,
                    ),
                    False,
                )
            )
    if "simulated" in families:
        for alpha in [float(a) for a in args.alphas.split(",") if a]:
            for k in args.ks.split(","):
                cfg = (
                    RuntimeConfig(k_min=0, k_max=8, k_initial=4, adaptive=True)
                    if k == "adaptive"
                    else RuntimeConfig(k_min=0, k_max=max(int(k), 1), k_initial=int(k), adaptive=False)
                )
                cfg = dataclasses.replace(cfg, prefill_token_budget=args.prefill_budget)
                configs.append((f"SIMULATED acceptance {alpha}, k={k}", alpha, cfg, False))
        for alpha in [float(a) for a in args.fallback_alphas.split(",") if a]:
            configs.append(
                (
                    f"SIMULATED acceptance {alpha}, k=adaptive",
                    alpha,
                    RuntimeConfig(
                        k_min=0, k_max=8, k_initial=4, adaptive=True, prefill_token_budget=args.prefill_budget
                    ),
                    False,
                )
            )
    if "self" in families:
        configs.append(
            (
                "draft = target (real acceptance), k=4",
                None,
                RuntimeConfig(k_min=0, k_max=4, k_initial=4, adaptive=False),
                True,
            )
        )
    for label, alpha, cfg, self_draft in configs:
        if not label.startswith(PLAIN):
            cfg = dataclasses.replace(cfg, overlap=args.overlap in ("on", "both"))
        models = target_models
        if self_draft:  # the target's own weights as draft (no second copy), with its own KV pool
            models = dataclasses.replace(
                target_models, draft_model=PagedLlama(tm.shape, tm.weights), draft_name=f"self:{tm.shape.num_layers}"
            )
        times = LaneTimes()
        opts = dict(base)
        if self_draft:  # two target-sized pools: half the blocks each, batches up to 64
            opts["num_blocks"] = max_blocks // 2
        engine = Engine(EngineOptions(config=cfg, **opts), observer=times, models=models, simulated_acceptance=alpha)
        if label == PLAIN and cuda and dm is not None:
            results["draft_steps"] = draft_step_times(engine, batches, floors)
        for b in batches:
            if self_draft and b > 64:
                continue
            run_engine(engine, times, b, args.prompt_len, 16, seed=1000 + b)  # warm-up (lazy graphs, allocator)
            ahead0 = engine.router.overlap.steps
            r = run_engine(engine, times, b, args.prompt_len, args.gen_len, seed=b)
            r["overlap_steps"] = engine.router.overlap.steps - ahead0
            f = floors.get(b)
            row = {
                "system": label,
                "simulated_acceptance": alpha,
                "batch": b,
                **r,
                "graph_capture_s": round(engine.startup_capture_seconds, 2),
            }
            if f and r["verify_call_s"] and cfg.k_initial == 0 and not cfg.adaptive and not cfg.overlap:
                row["decode_step_over_matmul_floor"] = round(r["verify_call_s"] / f["target_matmul_s"], 3)
                row["decode_step_over_bytes_floor"] = round(r["verify_call_s"] / f["target_bytes_s"], 3)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as fh:  # after every row: a run cut short keeps what it measured
                json.dump(results, fh, indent=2)
        del engine
        if cuda:
            torch.cuda.empty_cache()
    if "compiled" in families and cuda:
        for b in batches:
            row = compiled_row(tm, b, args.prompt_len, args.gen_len, floors.get(b))
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=2)
    plain = {r["batch"]: r["tok_per_s"] for r in results["rows"] if r["system"] == PLAIN}
    plain = plain or {r["batch"]: r["tok_per_s"] for r in results["rows"] if r["system"].startswith(PLAIN)}
    peer = {r["batch"]: r["tok_per_s"] for r in results["rows"] if r["system"].startswith(COMPILED)}
    for row in results["rows"]:
        if row["batch"] in plain:
            row["speedup_vs_k0"] = round(row["tok_per_s"] / plain[row["batch"]], 3)
        if row["batch"] in peer:
            row["over_compiled_decoder"] = round(row["tok_per_s"] / peer[row["batch"]], 3)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print_table(results)


COMPILED = "compiled static-batch decoder (peer)"
PLAIN, OVERLAPPED = "k=0 (plain decoding)", ", overlapped"


def compiled_row(model, batch: int, prompt_len: int, gen_len: int, floor: dict | None) -> dict:
    """The peer (bench/engine/static_decoder.py): the same weights as a torch.compile'd static-batch decoder,
    all prompts prefilled in one forward, then gen_len - 1 graphed decode steps of the whole batch.
    Timed as the engine rows are (prefill included, exactly gen_len tokens per request), on the
    same random prompts; its decode step alone is timed from graph replays."""
    from static_decoder import StaticDecoder

    dec = StaticDecoder(model, batch, prompt_len + gen_len)
    dec.capture()
    prompts = torch.tensor(random_prompts(batch, prompt_len, batch, model.shape.vocab_size), device="cuda")
    dec.generate(prompts, 16)  # warm-up (the eager prefill's kernels, allocator)
    synchronize()
    t0 = time.perf_counter()
    tokens = dec.generate(prompts, gen_len)
    synchronize()
    seconds = time.perf_counter() - t0
    dec.prefill(prompts)  # decode steps alone, at the positions the timed run decoded
    step = _median_replay(dec.graph, reps=min(40, gen_len - 1))
    t1 = time.perf_counter()
    dec.prefill(prompts)
    synchronize()
    row = {
        "system": COMPILED,
        "simulated_acceptance": None,
        "batch": batch,
        "tokens": tokens.numel(),
        "seconds": round(seconds, 4),
        "tok_per_s": round(tokens.numel() / seconds, 1),
        "steps": gen_len,
        "acceptance_rate": None,
        "mean_k": 0,
        "verify_call_s": step,
        "draft_call_s": None,
        "k_decisions": 0,
        "drafting_decisions": 0,
        "probe_decisions": 0,
        "prefill_s": round(time.perf_counter() - t1, 4),
        "compile_and_capture_s": round(dec.compile_seconds, 1),
        "note": "torch.compile (per layer, Inductor) + one CUDA graph per decode step; contiguous static KV "
        "cache attended over its whole length with a position mask; one prefill forward of all prompts",
    }
    if floor:
        row["decode_step_over_matmul_floor"] = round(step / floor["target_matmul_s"], 3)
        row["decode_step_over_bytes_floor"] = round(step / floor["target_bytes_s"], 3)
    del dec
    torch.cuda.empty_cache()
    return row


def memory_test(args, results: dict) -> None:
    """128 requests of 2,000 tokens at once (prompt 1000, 1000 generated) on the target shape, with the
    draft (SIMULATED acceptance 0.7, adaptive k): must finish with no out-of-memory error; the router
    queues and preempts when the pools run out."""
    opts = EngineOptions(
        target=model_spec(args.target),
        draft=model_spec(args.draft),
        device="cuda",
        dtype="bfloat16",
        max_context=2048,
        config=RuntimeConfig(k_min=0, k_max=6, k_initial=3),
    )
    times = LaneTimes()
    engine = Engine(opts, observer=times, simulated_acceptance=0.7)
    gen = torch.Generator().manual_seed(0)
    for i in range(128):
        prompt = tuple(torch.randint(100, 31000, (1000,), generator=gen).tolist())
        engine.router.add_request(RequestSpec(prompt, max_tokens=1000, stop_at_eos=False, request_id=f"m{i}"))
    t0 = time.perf_counter()
    finished, tokens, preemptions, reasons = 0, 0, 0, {}
    while engine.router.has_work():
        for out in engine.router.step():
            tokens += len(out.token_ids)
            if out.finished:
                finished += 1
                preemptions += out.stats.preemptions
                reasons[out.finish_reason.value] = reasons.get(out.finish_reason.value, 0) + 1
    seconds = time.perf_counter() - t0
    results["memory_test"] = {
        "requests": 128,
        "prompt_len": 1000,
        "gen_len": 1000,
        "finished": finished,
        "finish_reasons": reasons,
        "generated_tokens": tokens,
        "seconds": round(seconds, 1),
        "tok_per_s": round(tokens / seconds, 1),
        "preemptions": preemptions,
        "kv_blocks_per_pool": engine.target_pool.geometry.num_blocks,
        "max_memory_allocated_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "gpu_memory_GiB": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "simulated_acceptance": 0.7,
    }
    print(json.dumps(results["memory_test"]), flush=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)


def draft_step_times(engine: Engine, batches: list[int], floors: dict, context: int = 192) -> list[dict]:
    """One draft step on its own: an in-process draft call returns before its GPU work ends, so
    lane timings cannot show it. Times ModelRunner.draft with k = 1 and k = 5 (synchronized) on
    fake runs at `context`; (t5 - t1) / 4 is one graphed loop step, t1 the first step + call set-up."""
    from verifypd.model.runner import TokenRun

    runner = engine.draft_lane.runner
    per_seq = -(-(context + 8) // runner.block_size)
    rows = []
    for b in batches:
        if b * per_seq > runner.pool.geometry.num_blocks:
            continue
        runs = [TokenRun([7], context, tuple(range(i * per_seq, (i + 1) * per_seq))) for i in range(b)]
        t = draft_call_seconds(runner, runs)
        step = (t[5] - t[1]) / 4
        rows.append(
            {
                "batch": b,
                "draft_call_k1_s": round(t[1], 6),
                "draft_call_k5_s": round(t[5], 6),
                "loop_step_s": round(step, 6),
                "loop_step_over_matmul_floor": round(step / floors[b]["draft_matmul_s"], 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def draft_call_seconds(runner, runs, ks=(1, 5)) -> dict[int, float]:
    """Median seconds of one greedy draft call of these runs (synchronized), per k."""
    from verifypd.domain.requests import SamplingParams

    greedy = [SamplingParams()] * len(runs)

    def call(k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.draft(runs, [k] * len(runs), greedy).tolist()
        return time.perf_counter() - t0

    return {k: statistics.median([call(k) for _ in range(12)][2:]) for k in ks}


def print_table(results: dict) -> None:
    print(
        f"\n{'system':48s} {'batch':>5s} {'tok/s':>9s} {'x k=0':>6s} {'acc':>5s} {'k':>5s} {'verify ms':>9s} "
        f"{'draft ms':>8s} "
        f"{'drafting/probes/steps':>21s} {'x peer':>6s}"
    )
    for r in results["rows"]:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        v = "-" if not r["verify_call_s"] else f"{r['verify_call_s'] * 1e3:.2f}"
        d = "-" if not r["draft_call_s"] else f"{r['draft_call_s'] * 1e3:.2f}"
        decisions = f"{r['drafting_decisions']}/{r['probe_decisions']}/{r['k_decisions']}"
        print(
            f"{r['system']:48s} {r['batch']:5d} {r['tok_per_s']:9.1f} {r.get('speedup_vs_k0', 0):6.2f} {acc:>5s} "
            f"{r['mean_k']:5.2f} {v:>9s} {d:>8s} {decisions:>21s} {r.get('over_compiled_decoder', 0):6.2f}"
        )


if __name__ == "__main__":
    main()

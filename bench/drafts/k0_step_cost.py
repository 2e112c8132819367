"""What a k = 0 step costs with a draft attached, against a `--no-speculation` step: host time and
Python calls per decode step, at one batch size, in one process.

Rows (every row's outputs must equal plain decoding's; greedy):
  * `none`: plain decoding (`--no-speculation`);
  * `<draft> k_max 0`: the draft attached (a feature draft: the target writes its feature rows in
    every forward), the policy fixed off: what attaching the draft costs a plain step;
  * `<draft> held at 0 (SIMULATED acceptance 0)`: the served adaptive policy, every draft rejected
    by a simulated verdict (real compute, Bernoulli(0) acceptance: labelled), so the batch drafts
    only in its opening steps and is then held at k = 0 (Scheduler's k = 0 hold; `held_steps`);
    the same for the head mixed with prompt lookup (`eagle+ngram:`);
  * `ngram (adaptive, real acceptance)`: prompt lookup under the served policy (pool-less: held
    until a periodic probe may run; on these random prompts the tiny model's output may repeat, so
    lookup may draft: not a k = 0 row, and it varies with the engine's history);
  * `ngram held at 0 (SIMULATED acceptance 0)`: prompt lookup, every proposal rejected: the k = 0
    hold of a pool-less draft;
  * `self:N k_max 0` and `self:N held at 0 (...)`: the same for a model draft, the target's first N
    layers (`--self-layers`: 1 of the tiny 2-layer target, 12 of the embedded model by default).
Requests end one by one by default (`--lengths varied`: max tokens uniform in [max/2, max], seeded),
as chat requests end at EOS, so the batch shrinks through smaller batch sizes; the warm runs are
the same batch (every batch size's plain cost measured, as draft_acceptance's --warm-batches).
`extra_calls_per_step`: the functions a row calls more per step than `none` (where the host work goes).
Per row: CPU ms per decode step of this single-threaded process (median run of --repeats, runs
interleaved), wall ms per step, and Python function calls per decode step counted in one more run
(deterministic: no load on a shared machine moves it), k decisions, held and chained steps.
`--profile`: one more run per row under cProfile, `extra_host_time` the functions whose own host
time per step exceeds `none`'s most, with their callers (a Triton launch or torch op on a GPU path
shows there, where python call counts miss it).

CPU (default): a tiny random Llama (2 layers, hidden 32, vocabulary 512) and a random EAGLE head,
written to a temp dir (the tests' writers); its forward is about as cheap as a step's host work.
GPU: `--device cuda --target PATH.gguf` (the embedded SmolLM2-135M; drafts `eagle:smollm2`, `self:12`).

    python bench/drafts/k0_step_cost.py --out bench/results/k0_step_cost_cpu.json
    python bench/drafts/k0_step_cost.py --smoke --out /tmp/k0_step_cost_smoke.json
    python bench/drafts/k0_step_cost.py --device cuda --target $G --out k0_step_cost_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import tempfile
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench_meta
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "support"))  # tiny checkpoints

from bench_meta import metadata

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec
from verifypd.engine import Engine, EngineOptions

VOCAB = 512
# --no-speculation; with a draft attached: the draft loaded (its feature rows written), never asked
OFF = RuntimeConfig(k_min=0, k_max=0, k_initial=0, adaptive=False)


def tiny_models(root: str) -> tuple[str, str]:
    """A tiny target checkpoint and a random EAGLE head for it (the tests' writers)."""
    import pathlib

    from engine_cases import write_head
    from engine_helpers import write_tiny_llama

    target = write_tiny_llama(pathlib.Path(root) / "target", seed=1, layers=2, hidden=32, vocab=VOCAB)
    return str(target), write_head((str(target),), os.path.join(root, "head"))


def make_engine(target: str, draft: str, config: RuntimeConfig, device: str, simulated: float | None) -> Engine:
    dtype = "bfloat16" if device == "cuda" else "float32"
    options = EngineOptions(
        target=target, draft=draft, num_blocks=1024, block_size=16, dtype=dtype, device=device, config=config
    )
    return Engine(options, simulated_acceptance=simulated)


def specs(prompts: list[list[int]], tag: str, lengths: list[int]) -> list[RequestSpec]:
    return [
        RequestSpec(tuple(p), max_tokens=n, request_id=f"{tag}-{i}", stop_at_eos=False)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]


def run_once(engine: Engine, batch: list[RequestSpec], count_calls: bool = False) -> dict:
    router = engine.router
    sched = router.scheduler
    before = (dict(sched.probes.k_counts), getattr(sched, "held_steps", 0), router.overlap.steps)
    calls = [0]
    by_function: Counter[str] = Counter()

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1
            code = frame.f_code
            by_function[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1

    t0, c0 = time.perf_counter(), time.process_time()
    if count_calls:
        sys.setprofile(profile)
    try:
        done = engine.generate(batch)
    finally:
        sys.setprofile(None)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = max(c.usage["verify_steps"] for c in done.values())
    k_counts = sched.probes.k_counts
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "decode_steps": steps,
        "python_calls": calls[0],
        "calls_by_function": by_function,
        "k_decisions": {k: n - before[0].get(k, 0) for k, n in sorted(k_counts.items()) if n > before[0].get(k, 0)},
        "held_steps": getattr(sched, "held_steps", 0) - before[1],  # (0 before the hold existed)
        "chained_steps": router.overlap.steps - before[2],
        "drafted": sum(c.usage["draft_tokens"] for c in done.values()),
        "outputs": [done[s.request_id].token_ids for s in batch],
    }


def profile_once(engine: Engine, batch: list[RequestSpec]) -> dict:
    """One more run under cProfile: host seconds per decode step by function (its own time, C
    functions too: a Triton launch or a torch op shows as the call that made it), with the function
    that called it most."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        done = engine.generate(batch)
    finally:
        profiler.disable()
    steps = max(c.usage["verify_steps"] for c in done.values())
    out = {}
    for (path, line, name), (_, _, tottime, _, callers) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        caller = max(callers.items(), key=lambda kv: kv[1][3], default=None)
        out[f"{os.path.basename(path)}:{line}:{name}"] = (
            tottime / steps,
            f"{os.path.basename(caller[0][0])}:{caller[0][2]}" if caller else "",
        )
    return out


def extra_time(row: dict, base: dict, top: int = 15) -> list[dict]:
    """The functions whose own host time per step (under cProfile, which inflates every call alike)
    exceeds plain decoding's most: where a row's extra host time goes, GPU paths included."""
    extra = [(t - base.get(name, (0.0, ""))[0], name, caller) for name, (t, caller) in row.items()]
    return [
        {"function": name, "extra_us_per_step": round(1e6 * e, 1), "called_from": caller}
        for e, name, caller in sorted(extra, reverse=True)[:top]
    ]


def extra_calls(row: dict, base: dict, top: int = 12) -> dict[str, float]:
    """The functions called more per decode step than in plain decoding (`base`), most first: where
    a row's extra host work goes (file:function -> extra calls per step)."""
    mine, theirs = row["calls_by_function"], base["calls_by_function"]
    extra = {name: n / row["decode_steps"] - theirs.get(name, 0) / base["decode_steps"] for name, n in mine.items()}
    ranked = sorted((e, name) for name, e in extra.items() if e >= 0.05)[::-1][:top]
    return {name: round(e, 2) for e, name in ranked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--target", default=None, help="the target (default: a tiny random Llama written to a temp dir)")
    ap.add_argument("--draft", default=None, help="default: a random EAGLE head (tiny), eagle:smollm2 (--target)")
    ap.add_argument("--self-layers", type=int, default=None, help="the model draft's layers (self:N; 1 tiny, 12 GPU)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--lengths",
        default="varied",
        choices=("varied", "fixed"),
        help="max tokens per request: uniform in [max/2, max] (seeded), or all --max-tokens",
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per row (interleaved); the median is kept")
    ap.add_argument("--smoke", action="store_true", help="a quick run (2 repeats, 32 tokens, batch 4)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also one cProfile run per row: the functions whose host time per step exceeds none's most",
    )
    ap.add_argument(
        "--rows", default=None, help="comma list of words: only the rows whose name holds one (none is always run)"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.batch < 1 or args.max_tokens < 2 or args.repeats < 1:
        ap.error("--batch >= 1, --max-tokens >= 2, --repeats >= 1")
    if args.self_layers is None:
        args.self_layers = 1 if args.target is None else 12
    if args.smoke:
        args.repeats, args.max_tokens, args.batch = 2, 32, 4
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    torch.set_num_threads(1)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as root:
        if args.target is None:
            target, head = tiny_models(root)
            vocab, draft = VOCAB, args.draft or head
            label = "eagle:<random head>" if draft == head else draft
        else:
            target, draft = args.target, args.draft or "eagle:smollm2"
            vocab, label = 32000, draft
        prompts = [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(args.batch)]
        # varied: requests end one by one (as chat requests end at EOS), so the batch shrinks
        lengths = [args.max_tokens] * args.batch
        if args.lengths == "varied":
            lengths = [rng.randrange(args.max_tokens // 2, args.max_tokens + 1) for _ in range(args.batch)]
        mix = draft.replace("eagle:", "eagle+ngram:", 1) if draft.startswith("eagle:") else f"eagle+ngram:{draft}"
        mix_label = label.replace("eagle:", "eagle+ngram:", 1)
        # a model draft: the target's first layers (self:1 of the tiny 2-layer target; --self-layers)
        model = f"self:{args.self_layers}"
        cases = [  # (row, draft, config, simulated acceptance)
            ("none", "none", OFF, None),
            (f"{label} k_max 0", draft, OFF, None),
            (f"{label} held at 0 (SIMULATED acceptance 0)", draft, RuntimeConfig(), 0.0),
            (f"{mix_label} held at 0 (SIMULATED acceptance 0)", mix, RuntimeConfig(), 0.0),
            (f"{model} k_max 0", model, OFF, None),
            (f"{model} held at 0 (SIMULATED acceptance 0)", model, RuntimeConfig(), 0.0),
            # pool-less: held until a periodic probe may run
            ("ngram (adaptive, real acceptance)", "ngram", RuntimeConfig(), None),
            ("ngram held at 0 (SIMULATED acceptance 0)", "ngram", RuntimeConfig(), 0.0),
        ]
        if args.rows:
            words = [w.strip() for w in args.rows.split(",") if w.strip()]
            cases = [c for c in cases if c[0] == "none" or any(w in c[0] for w in words)]
        labels = {"none": "none", draft: label, mix: mix_label, model: model, "ngram": "ngram"}
        engines = {name: make_engine(target, d, c, args.device, sim) for name, d, c, sim in cases}
        for name in engines:  # warm: first calls, graphs, and the policy's costs at this batch
            for w in range(2):
                engines[name].generate(specs(prompts, f"warm{w}", lengths))
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for repeat in range(args.repeats):  # interleaved, so load from elsewhere spreads over every row
            for name in engines:
                runs[name].append(run_once(engines[name], specs(prompts, f"r{repeat}", lengths)))
        counted = {name: run_once(engines[name], specs(prompts, "calls", lengths), True) for name in engines}
        profiled = (
            {name: profile_once(engines[name], specs(prompts, "prof", lengths)) for name in engines}
            if args.profile
            else {}
        )
    rows = []
    base = sorted(runs["none"], key=lambda x: x["cpu_seconds"])[(args.repeats - 1) // 2]
    base_calls = counted["none"]["python_calls"] / counted["none"]["decode_steps"]
    for name, d, _, sim in cases:
        chosen = sorted(runs[name], key=lambda x: x["cpu_seconds"])[(args.repeats - 1) // 2]
        host_ms = 1e3 * chosen["cpu_seconds"] / chosen["decode_steps"]
        calls = counted[name]["python_calls"] / counted[name]["decode_steps"]
        rows.append(
            {
                "row": name,
                "draft": labels[d],
                "simulated_acceptance": sim,
                "host_ms_per_step": host_ms,
                "host_vs_none": host_ms / (1e3 * base["cpu_seconds"] / base["decode_steps"]),
                "wall_ms_per_step": 1e3 * chosen["seconds"] / chosen["decode_steps"],
                "python_calls_per_step": calls,
                "python_calls_vs_none": calls / base_calls,
                "same_output_as_no_speculation": all(r["outputs"] == runs["none"][0]["outputs"] for r in runs[name]),
                **{k: chosen[k] for k in ("decode_steps", "k_decisions", "held_steps", "chained_steps", "drafted")},
                "cpu_seconds_all": [round(x["cpu_seconds"], 5) for x in runs[name]],
                "extra_calls_per_step": extra_calls(counted[name], counted["none"]),
            }
        )
        if profiled:
            rows[-1]["extra_host_time"] = extra_time(profiled[name], profiled["none"])
    result = {
        **metadata(),
        "what": (
            "host work of k = 0 steps with a draft attached vs --no-speculation; "
            f"target {'tiny random Llama (2 layers, hidden 32, vocab 512)' if args.target is None else args.target}"
        ),
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "lengths": args.lengths,
        "repeats": args.repeats,
        "smoke": args.smoke,
        "threads": 1,
        "note": "median run by CPU time of this single-threaded process; python_calls from one more run, profiled",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    for r in rows:
        print(
            f"{r['row']:52s} host {r['host_ms_per_step']:.3f} ms/step ({r['host_vs_none']:.3f}x) "
            f"calls {r['python_calls_per_step']:.0f}/step ({r['python_calls_vs_none']:.3f}x) "
            f"held {r['held_steps']} chained {r['chained_steps']}/{r['decode_steps']} k {r['k_decisions']} "
            f"same {r['same_output_as_no_speculation']}"
        )


if __name__ == "__main__":
    main()

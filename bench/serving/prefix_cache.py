"""Prefix caching: time to first token of requests sharing a long prompt prefix, cache on and off.

The in-process engine (the same router and lanes `verifypd serve` runs colocated) over the embedded
model (smollm2, real weights) by default. Per mode (`--no-prefix-cache` off, default on), one engine:
a warm-up request (an unrelated short prompt), then, one at a time:
  first   PREFIX + SUFFIX_A   (nothing cached)
  second  PREFIX + SUFFIX_B   (shares PREFIX: with the cache, only the suffix is prefilled)
  repeat  PREFIX + SUFFIX_A   (the first again: all but the last block cached)
Each row: TTFT (s, the engine's stats: arrival to first token), cached prompt tokens, and the
generated tokens (cached and uncached must agree: greedy). The target: second / first TTFT <= 0.3 on
the CPU, <= 0.1 on a GPU. PREFIX is seeded random token ids of the model's vocabulary.

    python bench/serving/prefix_cache.py --out bench/results                      # CPU, 1,500-token prefix
    python bench/serving/prefix_cache.py --device cuda --out bench/results        # GPU
    python bench/serving/prefix_cache.py --smoke --target TINY_DIR --draft ngram --out /tmp/x  (CPU test)
    python bench/serving/prefix_cache.py --device cuda --target $G --also random:llama-2-7b --out bench/results
    python bench/serving/prefix_cache.py --device cuda --target $G --also random:llama-2-7b --breakdown --out /tmp/o

Each mode first warms up on an unrelated prompt of the measured length too, so `first` pays its
prefill, not the one-time costs of a new shape (kernel compilation, allocator growth).

`--also random:llama-2-7b` repeats the measurement over Llama-2-7B's shape with RANDOM weights
(the result's `also`, labelled so): a realistic prefill cost for a 1,500-token prefix, which the 135M
embedded model's tiny prefill hides behind fixed per-request costs. Caching is by token ids, so
random weights measure it exactly; the generated tokens mean nothing.

`--breakdown` (per target, `ttft_breakdown` in the result; prefix_ttft_breakdown.py): the cached request's
TTFT split into host phases and GPU kernels (busy / idle), with split-KV attention (model.split_kv) on
and off on the same engine, and the floor: the target's weight bytes / the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("services", "bench"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from bench_meta import metadata, write_result  # noqa: E402


def run_mode(models, options, prompts: dict[str, list[int]], max_tokens: int, after=None) -> list[dict]:
    """`after(engine)`: called on the engine once the rows are measured, before it is closed."""
    from verifypd.domain.requests import RequestSpec
    from verifypd.engine import Engine

    engine = Engine(options, models=models)
    rows = []
    for name, prompt in prompts.items():
        spec = RequestSpec(tuple(prompt), max_tokens=max_tokens, stop_at_eos=False, request_id=name)
        done = engine.generate([spec])[name]
        rows.append(
            {
                "request": name,
                "prompt_tokens": len(prompt),
                "ttft_s": done.ttft_s,
                "cached_tokens": done.usage["cached_tokens"],
                "token_ids": done.token_ids,
            }
        )
        print(f"  {name:8s} prompt {len(prompt):5d}  cached {rows[-1]['cached_tokens']:5d}  ttft {done.ttft_s:.3f} s")
    if after is not None:
        after(engine)
    engine.router.close()
    return rows


def measure(args, target: str, draft: str) -> dict:
    """Both modes over one target: the rows, the TTFT ratios and whether the tokens agree."""
    from verifypd.core.assembly import load_stack_models
    from verifypd.domain.options import EngineOptions

    base = EngineOptions(target=target, draft=draft, device=args.device, num_blocks=args.num_blocks)
    base.max_context = max(4096, args.prefix + args.suffix + args.max_tokens + 16)
    models = load_stack_models(base)
    vocab = models.target.shape.vocab_size
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    prefix, suffix_a, suffix_b = ids(args.prefix), ids(args.suffix), ids(args.suffix)
    prompts = {"first": prefix + suffix_a, "second": prefix + suffix_b, "repeat": prefix + suffix_a}
    # a short and a full-length unrelated prompt: the shapes `first` will run are warm
    warmup = {"warmup": ids(32), "warmup_long": ids(args.prefix + args.suffix)}

    details: dict = {}

    def explain(engine) -> None:  # --breakdown, on the cached mode's engine (no second start-up)
        from prefix_ttft_breakdown import breakdown

        print(f"{target} breakdown of the cached request's TTFT:")
        details.update(breakdown(engine, prefix, lambda: ids(args.suffix), args.breakdown_requests, args.max_tokens))
        print(json.dumps({k: v for k, v in details.items() if not k.startswith("split_kv")}, default=str))
        for side in ("split_kv_on", "split_kv_off"):
            d = details[side]
            print(f"  {side}: ttft {d['ttft_ms_median']:.3f} ms, host {d['host_phase_ms_median']}, gpu {d['gpu']}")

    modes = {}
    for mode, on in (("uncached", False), ("cached", True)):
        print(f"{target} {mode}:")
        options = EngineOptions(**{**base.__dict__, "prefix_cache": on})
        after = explain if on and args.breakdown else None
        rows = run_mode(models, options, {**warmup, **prompts}, args.max_tokens, after)
        modes[mode] = [r for r in rows if not r["request"].startswith("warmup")]
    del models
    cached = {r["request"]: r for r in modes["cached"]}
    uncached = {r["request"]: r for r in modes["uncached"]}
    return {
        "target": target,
        "draft": draft,
        "modes": modes,
        "second_over_first_ttft_cached": cached["second"]["ttft_s"] / cached["first"]["ttft_s"],
        "second_over_first_ttft_uncached": uncached["second"]["ttft_s"] / uncached["first"]["ttft_s"],
        "second_cached_over_uncached_ttft": cached["second"]["ttft_s"] / uncached["second"]["ttft_s"],
        "same_tokens": all(cached[n]["token_ids"] == uncached[n]["token_ids"] for n in prompts),
        **({"ttft_breakdown": details} if details else {}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2", help="target model (default: the embedded smollm2)")
    p.add_argument("--draft", default="ngram", help="--draft of the engine (default ngram)")
    p.add_argument("--device", default="auto")
    p.add_argument("--prefix", type=int, default=1500, help="shared prefix length in tokens")
    p.add_argument("--suffix", type=int, default=6, help="tokens after the prefix, different per request")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--also", default=None, help="a second target measured the same way (e.g. random:llama-2-7b)")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also where a cache hit's TTFT goes: host phases, GPU kernels / busy / idle, split-KV on vs off, "
        "the weight-bytes floor (prefix_ttft_breakdown.py)",
    )
    p.add_argument("--breakdown-requests", type=int, default=8, help="cached requests per --breakdown side")
    p.add_argument("--smoke", action="store_true", help="small sizes (a CPU test of the script)")
    p.add_argument("--out", default=None, help="directory for prefix_cache_<device>.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.prefix, args.max_tokens = min(args.prefix, 64), min(args.max_tokens, 2)
        args.breakdown_requests = min(args.breakdown_requests, 2)

    main_run = measure(args, args.target, args.draft)
    gpu = not metadata()["device"].startswith("cpu")
    goal = 0.1 if gpu else 0.3
    result = {
        **metadata(),
        "what": "TTFT of requests sharing a prompt prefix, in-process engine, prefix cache on vs off",
        "weights": "real" if args.target == "smollm2" else f"as given: {args.target}",
        "prompts": "seeded random token ids",
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "smoke": args.smoke,
        **main_run,
        "goal": f"second / first TTFT <= {goal} ({'GPU' if gpu else 'CPU'})",
        "goal_met": main_run["second_over_first_ttft_cached"] <= goal,
    }
    ok = main_run["same_tokens"]
    if args.also:
        also = measure(args, args.also, "ngram")
        random_weights = args.also.startswith("random:")
        result["also"] = {
            "weights": "RANDOM (the shape only): real prefill cost, meaningless tokens"
            if random_weights
            else f"as given: {args.also}",
            **also,
            "goal_met": also["second_over_first_ttft_cached"] <= goal,
        }
        ok = ok and also["same_tokens"]
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}, indent=1, default=str)[:4000])
    write_result(args.out, "prefix_cache", result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""What sampling controls and logprobs cost: engine decode throughput of one batch of requests, plain
against the same requests with penalties + logit_bias + min_tokens, and with logprobs (top 5), each
with speculation (--draft) and without (k = 0). Also checks that the controlled outputs equal
plain decoding's (--draft none) token for token, and reports acceptance (controls the draft does not
apply lower it).

    python bench/engine/sampling_controls.py --out bench/results/sampling_controls_h100.json
    python bench/engine/sampling_controls.py --smoke --out /tmp/sc.json    # CPU, a few seconds

The default target is the embedded model (SmolLM2-135M, real weights); `--draft` as the CLI's.
Timed after one warm-up pass of the same batch; tokens/s = generated tokens / wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench_meta

from bench_meta import metadata

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.engine import Engine, EngineOptions

VARIANTS = {
    "plain": {},
    "controls": dict(
        frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1, min_tokens=8, logit_bias=((13, 1.5),)
    ),
    "logprobs": dict(logprobs=True, top_logprobs=5),
}


def specs(variant: str, batch: int, max_tokens: int, vocab: int, sampled: bool) -> list[RequestSpec]:
    rng = random.Random(0)
    out = []
    for i in range(batch):
        base = [rng.randrange(100, min(vocab, 20000)) for _ in range(rng.randrange(8, 32))]
        prompt = tuple(base + base)  # quotes itself: prompt lookup has matches to propose
        choice = {"temperature": 0.8, "seed": 1000 + i} if sampled else {}
        out.append(
            RequestSpec(
                prompt,
                max_tokens=max_tokens,
                stop_at_eos=False,
                request_id=f"{variant}-{i}",
                sampling=SamplingParams(**choice, **VARIANTS[variant]),
            )
        )
    return out


def run(engine: Engine, batch: list[RequestSpec]) -> tuple[dict[str, list[int]], float, dict]:
    router = engine.router
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for spec in batch:
        router.add_request(spec)
    drafted = accepted = 0
    while router.has_work():
        for out in router.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                drafted += out.stats.draft_tokens
                accepted += out.stats.accepted_tokens
    seconds = time.perf_counter() - t0
    return tokens, seconds, {"draft_tokens": drafted, "accepted_tokens": accepted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="model spec (default: the embedded model)")
    parser.add_argument("--draft", default="ngram", help="draft spec for the speculative runs")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.max_tokens = 2, 6
    results = []
    reference: dict[str, dict[str, list[int]]] = {}
    for sampled in (False, True):
        for draft, k in (("none", 0), (args.draft, args.k)):
            options = dict(draft=draft, device=args.device, config=RuntimeConfig(k_min=0, k_max=max(k, 1), k_initial=k))
            if args.target:
                options["target"] = args.target
            engine = Engine(EngineOptions(**options))
            vocab = engine.router.vocab_size
            for variant in VARIANTS:
                batch = specs(variant, args.batch, args.max_tokens, vocab, sampled)
                run(engine, batch)  # warm-up (graphs, allocator)
                tokens, seconds, stats = run(engine, batch)
                key = f"{variant}-{'seeded' if sampled else 'greedy'}"
                if draft == "none":
                    reference[key] = tokens
                generated = sum(len(t) for t in tokens.values())
                results.append(
                    {
                        "variant": variant,
                        "sampling": "seeded" if sampled else "greedy",
                        "draft": draft,
                        "k": k,
                        "batch": args.batch,
                        "generated_tokens": generated,
                        "seconds": round(seconds, 4),
                        "tokens_per_s": round(generated / seconds, 1),
                        **stats,
                        "equal_to_no_speculation": tokens == reference[key],
                    }
                )
                print(json.dumps(results[-1]), flush=True)
            engine.router.close()
    report = {
        **metadata(),
        "benchmark": "sampling_controls",
        "model": args.target or "embedded SmolLM2-135M-Instruct (real weights)",
        "smoke": args.smoke,
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    bad = [r for r in results if not r["equal_to_no_speculation"]]
    if bad:
        raise SystemExit(f"outputs differ from plain decoding: {bad}")


if __name__ == "__main__":
    main()

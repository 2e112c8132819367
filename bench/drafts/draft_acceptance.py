"""Draft acceptance and speed-up on the embedded SmolLM2-135M-Instruct, per draft and task family.

Real model, real acceptance (no simulation), greedy, --batch requests at a time (1: the latency
case speculation is for), the engine's default runtime config (adaptive k) unless --k is given.
Every draft is compared with plain decoding (`--no-speculation`: draft `none`, k = 0) measured in
the same run, on the same prompts. Prompts: bench/prompts/draft_acceptance.jsonl (our own; see
bench/drafts/make_draft_prompts.py), the first --per-family of each family.

    python bench/drafts/draft_acceptance.py --drafts ngram,self:12,self:24 --per-family 4 --batch 4 \\
        --max-tokens 48 --out bench/results/draft_acceptance_cpu.json

On a GPU (`--device cuda`: bf16, CUDA graphs), e.g. the prompt-lookup case (the
adaptive policy must not lose to plain decoding where drafts are rarely accepted):

    python bench/drafts/draft_acceptance.py --device cuda --drafts ngram --per-family 16 --batch 16 \\
        --max-tokens 128 --out bench/results/draft_acceptance_ngram_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))  # engine_throughput

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench_meta
from bench_meta import metadata

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.drafts import parse_draft
from verifypd.domain.heap import freeze_startup_heap
from verifypd.domain.requests import RequestSpec
from verifypd.domain.tokenizer import TextCodec
from verifypd.engine import Engine, EngineOptions
from verifypd.model.build import Models, load_draft_model
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import load_model

PROMPTS = pathlib.Path(__file__).resolve().parents[1] / "prompts" / "draft_acceptance.jsonl"


def load_prompts(per_family: int) -> dict[str, list[dict]]:
    families: dict[str, list[dict]] = {}
    for line in PROMPTS.read_text().splitlines():
        row = json.loads(line)
        families.setdefault(row["family"], []).append(row)
    return {f: rows[:per_family] for f, rows in families.items()}


# Suffixes of a draft's name (--compare-draft-after): the same draft with engine.spec_ahead off, and with
# engine.draft_after off too (its drafts made in their own step; spec_ahead needs draft_after).
NO_AHEAD, NO_DRAFT_AFTER = "#no-ahead", "#no-draft-after"
# ... and with engine.spec_ahead's verify calls launched only once the verdict before them is on the host
NO_FIT = "#no-fit"


def make_engine(target, name: str, k: int | None, device: torch.device, dtype: torch.dtype) -> Engine:
    draft = name.removesuffix(NO_DRAFT_AFTER).removesuffix(NO_AHEAD).removesuffix(NO_FIT)
    models = Models(
        target,
        PagedLlama(target.shape, target.weights),
        load_draft_model(parse_draft(draft), target, device, dtype, 2048),
        draft,
        device,
        dtype,
    )
    if draft == "none":
        config = RuntimeConfig(k_min=0, k_max=0, k_initial=0, adaptive=False)
    elif k is not None:
        config = RuntimeConfig(k_min=0, k_max=k, k_initial=k, adaptive=False)
    else:
        config = RuntimeConfig()
    engine = Engine(EngineOptions(num_blocks=256, device=device.type, config=config), models=models)
    engine.router.draft_after.enabled = not name.endswith(NO_DRAFT_AFTER)
    engine.router.ahead.enabled = not name.endswith((NO_DRAFT_AFTER, NO_AHEAD))
    engine.router.ahead.fit = not name.endswith(NO_FIT)
    return engine


def summarize_runs(runs: list[dict]) -> dict:
    """Repeats of one family on one engine: the run of median wall time is reported (`seconds_all`:
    every run's), and its tokens must be every run's (else `outputs` is None: a mismatch). The repeats
    run on the same engine, so the draft-length policy's state (measured step costs, acceptance
    estimate, probe schedule) carries from one into the next: `k_decisions_all` and `drafted_all` give
    each run's, which is where repeats of an adaptive draft differ."""
    chosen = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]
    same = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    return {
        **chosen,
        "seconds_all": [round(r["seconds"], 5) for r in runs],
        "k_decisions_all": [r["k_decisions"] for r in runs],
        "drafted_all": [r["drafted"] for r in runs],
        "outputs": chosen["outputs"] if same else None,
    }


def _run_family_once(engine: Engine, family: str, ids: list[tuple[int, ...]], max_tokens: int, batch: int) -> dict:
    totals = dict(drafted=0, accepted=0, verify_steps=0, tokens=0, seconds=0.0, cpu_seconds=0.0)
    outputs = []
    probes = engine.router.scheduler.probes
    k_before, probes_before = dict(probes.k_counts), probes.probes
    for start in range(0, len(ids), batch):
        specs = [
            RequestSpec(p, max_tokens=max_tokens, request_id=f"{family}-{start + i}")
            for i, p in enumerate(ids[start : start + batch])
        ]
        t0, c0 = time.perf_counter(), time.process_time()
        done = engine.generate(specs)
        # Wall time is what a user sees; CPU time of this (single-threaded) process is much less
        # sensitive to other work on a shared machine.
        totals["seconds"] += time.perf_counter() - t0
        totals["cpu_seconds"] += time.process_time() - c0
        for s in specs:
            c = done[s.request_id]
            totals["drafted"] += c.usage["draft_tokens"]
            totals["accepted"] += c.usage["accepted_tokens"]
            totals["verify_steps"] += c.usage["verify_steps"]
            totals["tokens"] += c.usage["completion_tokens"]
            outputs.append(c.token_ids)
    d, a, steps = totals["drafted"], totals["accepted"], totals["verify_steps"]
    # The policy's batch k decisions in this run (a decision per step of the batch), and its probes.
    k_decisions = {k: n - k_before.get(k, 0) for k, n in sorted(probes.k_counts.items()) if n > k_before.get(k, 0)}
    return {
        **totals,
        "k_decisions": k_decisions,
        "probe_steps": probes.probes - probes_before,
        "acceptance_rate": a / d if d else None,
        "accepted_per_step": a / steps if steps else 0.0,
        "tok_per_s": totals["tokens"] / totals["seconds"],
        "tok_per_cpu_s": totals["tokens"] / totals["cpu_seconds"],
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="ngram,self:12,self:24")
    ap.add_argument("--target", default="smollm2", help="the embedded model's spec, or a path to its GGUF")
    ap.add_argument("--per-family", type=int, default=4, help="prompts per family (the first N of the JSONL)")
    ap.add_argument(
        "--families", default=None, help="comma list of the prompt families to run (default: every family), e.g. chat"
    )
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=None, help="fixed k (default: the adaptive policy, as served)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: CPU time measures work)")
    ap.add_argument("--batch", type=int, default=1, help="requests generated together (1: one at a time)")
    ap.add_argument(
        "--batches",
        default=None,
        help="comma list of batch sizes measured in one run and one JSON (overrides --batch), e.g. 1,16",
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: bf16 weights, CUDA graphs")
    ap.add_argument("--out", default="draft_acceptance.json")
    ap.add_argument(
        "--warm-runs",
        type=int,
        default=0,
        help="before timing, generate every family this many times per draft and batch at the measured "
        "size, untimed (a server that has served this workload: each kernel variant an eager path "
        "meets, e.g. a feature draft's long catch-up after a k = 0 hold, compiled or loaded once per "
        "process, and the policy's costs measured); their wall times are kept in the JSON",
    )
    ap.add_argument(
        "--warm-batches",
        action="store_true",
        help="before timing, also run each measured batch size once over each family's first prompts "
        "(32 tokens): the adaptive policy has measured its step costs there, as a server that has "
        "run a while has (default: only one request per family, 16 tokens)",
    )
    ap.add_argument(
        "--compare-draft-after",
        action="store_true",
        help=f"also each feature draft with verify calls launched only once the verdict before "
        f"them is on the host (DRAFT{NO_FIT}), without steps launched before the previous one "
        f"streams (engine.spec_ahead off; DRAFT{NO_AHEAD}) and with its drafts made in their own "
        f"step too (engine.draft_after off; DRAFT{NO_DRAFT_AFTER})",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="generate each family this many times per draft and batch; report the run of median "
        "wall time (a 16-prompt batch of the embedded model runs ~0.1 s: one run is noisy)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(args.target, device, dtype, 2048)
    codec = TextCodec(target.tokenizer)
    rows = load_prompts(args.per_family)
    if args.families:
        wanted = [f.strip() for f in args.families.split(",") if f.strip()]
        unknown = [f for f in wanted if f not in rows]
        if unknown or not wanted:
            ap.error(f"--families: unknown family {', '.join(unknown) or '(none given)'}; known: {', '.join(rows)}")
        rows = {f: rows[f] for f in wanted}
    prompts = {
        f: [tuple(codec.encode_chat([{"role": "user", "content": r["prompt"]}])) for r in rs] for f, rs in rows.items()
    }
    drafts = ["none"] + [d for d in args.drafts.split(",") if d and d != "none"]
    if args.compare_draft_after:
        drafts += [
            d + suffix
            for suffix in (NO_FIT, NO_AHEAD, NO_DRAFT_AFTER)
            for d in drafts
            if d.startswith(("eagle:", "eagle+ngram:"))
        ]
    engines = {d: make_engine(target, d, args.k, device, dtype) for d in drafts}
    for engine in engines.values():  # first-call allocations and kernel compiles outside the timings:
        for family, ids in prompts.items():  # a prompt of each family (lengths differ), a few drafting steps
            engine.generate([RequestSpec(ids[0], max_tokens=16, request_id=f"warm-{family}")])
    freeze_startup_heap()  # as serve's engine core does once started (domain/heap.py)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    if any(b < 1 for b in batches):
        ap.error("--batches: each batch size must be >= 1")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.warm_batches:
        for engine in engines.values():
            for batch in batches:
                for family, ids in prompts.items():
                    engine.generate(
                        [
                            RequestSpec(p, max_tokens=32, request_id=f"warm-{family}-{batch}-{i}")
                            for i, p in enumerate(ids[:batch])
                        ]
                    )
    if args.warm_runs < 0:
        ap.error("--warm-runs must be >= 0")
    table = []
    for batch in batches:
        table += measure(engines, drafts, prompts, args.max_tokens, batch, args.repeats, args.warm_runs)
    result = {
        **metadata(),
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "target": f"{args.target} (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized {str(dtype).removeprefix('torch.')})",
        "greedy": True,
        "batch": batches[0] if len(batches) == 1 else batches,
        "policy": f"fixed k={args.k}" if args.k is not None else "adaptive (RuntimeConfig defaults)",
        "max_tokens": args.max_tokens,
        "prompts_per_family": args.per_family,
        "warm_batches": args.warm_batches,
        "warm_runs": args.warm_runs,
        "repeats": args.repeats,
        "policy_state": "one engine per draft for the warm-up, every batch size and every repeat: the "
        "adaptive policy's measured step costs, acceptance estimate and probe schedule carry from each "
        "run into the next (rows: k_decisions_all, drafted_all per repeat)",
        "order": "round-robin: each repeat (and warm run) runs every draft once, the order rotated per "
        "family and repeat",
        "prompts_file": str(PROMPTS.relative_to(PROMPTS.parent.parent.parent)),
        "families": list(prompts),
        "rows": table,
        "totals": totals(table) + totals(table, per_family=True),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(markdown(table))
    print(markdown_totals(result["totals"]))


def measure(
    engines: dict, drafts: list[str], prompts: dict, max_tokens: int, batch: int, repeats: int = 1, warm_runs: int = 0
) -> list[dict]:
    results: dict[str, dict] = {d: {} for d in drafts}
    for n, (family, ids) in enumerate(prompts.items()):
        # Round-robin: each repeat runs every draft once, in an order rotated per family and per
        # repeat, so that drift and load from other work on the machine spread over all drafts
        # rather than biasing the ones that ran together (all repeats of one draft back to back let
        # two engines doing the same k = 0 work read 7 % apart on an H200).
        def order(shift: int) -> list[str]:
            return drafts[shift % len(drafts) :] + drafts[: shift % len(drafts)]

        warm: dict[str, list[dict]] = {d: [] for d in drafts}
        for _ in range(warm_runs):
            for draft in order(n):
                warm[draft].append(_run_family_once(engines[draft], family, ids, max_tokens, batch))
        runs: dict[str, list[dict]] = {d: [] for d in drafts}
        for repeat in range(repeats):
            for draft in order(n + repeat):
                runs[draft].append(_run_family_once(engines[draft], family, ids, max_tokens, batch))
        for draft in order(n):
            results[draft][family] = r = summarize_runs(runs[draft])
            r["warm_seconds"] = [round(w["seconds"], 5) for w in warm[draft]]
            print(
                json.dumps(
                    {"draft": draft, "family": family, "batch": batch, **{k: v for k, v in r.items() if k != "outputs"}}
                ),
                flush=True,
            )
    table = []
    base = results["none"]
    for draft, fams in results.items():
        for family, r in fams.items():
            # Speculation is lossless: every draft must give plain decoding's exact tokens.
            same = r["outputs"] is not None and r["outputs"] == base[family]["outputs"]
            table.append(
                {
                    "draft": draft,
                    "family": family,
                    "batch": batch,
                    "prompts": len(prompts[family]),
                    "drafted": r["drafted"],
                    "accepted": r["accepted"],
                    "acceptance_rate": r["acceptance_rate"],
                    "accepted_per_step": r["accepted_per_step"],
                    "tok_per_s": r["tok_per_s"],
                    "speedup_vs_no_speculation": r["tok_per_s"] / base[family]["tok_per_s"],
                    "tok_per_cpu_s": r["tok_per_cpu_s"],
                    "cpu_speedup_vs_no_speculation": r["tok_per_cpu_s"] / base[family]["tok_per_cpu_s"],
                    "same_output_as_no_speculation": same,
                    "tokens": r["tokens"],
                    "verify_steps": r["verify_steps"],
                    "seconds": r["seconds"],
                    "cpu_seconds": r["cpu_seconds"],
                    "seconds_all": r["seconds_all"],
                    "warm_seconds": r["warm_seconds"],
                    "k_decisions_all": r["k_decisions_all"],
                    "drafted_all": r["drafted_all"],
                    "k_decisions": r["k_decisions"],
                    "probe_steps": r["probe_steps"],
                }
            )
    return table


def totals(table: list[dict], per_family: bool = False) -> list[dict]:
    """All families together (`family` "all"), or each family alone (`per_family`), per (draft,
    batch): tokens per verify step (accepted + 1; plain decoding's steps count 1 token each) and wall
    / CPU time speed-up over plain decoding."""
    sums: dict[tuple, dict] = {}
    for r in table:
        t = sums.setdefault(
            (r["draft"], r["batch"], r["family"] if per_family else "all"),
            dict(accepted=0, verify_steps=0, tokens=0, seconds=0.0, cpu_seconds=0.0, same=True),
        )
        for key in ("accepted", "verify_steps", "tokens", "seconds", "cpu_seconds"):
            t[key] += r[key]
        t["same"] &= r["same_output_as_no_speculation"]
    out = []
    for (draft, batch, family), t in sums.items():
        base = sums[("none", batch, family)]
        out.append(
            {
                "draft": draft,
                "batch": batch,
                "family": family,
                "tokens": t["tokens"],
                "tokens_per_verify_step": (t["accepted"] + t["verify_steps"]) / t["verify_steps"]
                if t["verify_steps"]
                else None,
                "tok_per_s": t["tokens"] / t["seconds"],
                "speedup_vs_no_speculation": (t["tokens"] / t["seconds"]) / (base["tokens"] / base["seconds"]),
                "cpu_speedup_vs_no_speculation": (t["tokens"] / t["cpu_seconds"])
                / (base["tokens"] / base["cpu_seconds"]),
                "same_output_as_no_speculation": t["same"],
            }
        )
    return out


def markdown_totals(rows: list[dict]) -> str:
    lines = [
        "| draft | batch | family | tokens / verify step | tok/s (wall) | vs no-spec | CPU-time vs no-spec "
        "| same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tps = "–" if r["tokens_per_verify_step"] is None else f"{r['tokens_per_verify_step']:.2f}"
        lines.append(
            f"| {r['draft']} | {r['batch']} | {r['family']} | {tps} | {r['tok_per_s']:.1f} | "
            f"{r['speedup_vs_no_speculation']:.2f}x | {r['cpu_speedup_vs_no_speculation']:.2f}x | "
            f"{'yes' if r['same_output_as_no_speculation'] else 'NO'} |"
        )
    return "\n".join(lines)


def markdown(table: list[dict]) -> str:
    lines = [
        "| draft | batch | family | acceptance (accepted/drafted) | accepted / step | tok/s (wall) | vs no-spec "
        "| tok per CPU-s | vs no-spec | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        acc = "–" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%} ({r['accepted']}/{r['drafted']})"
        lines.append(
            f"| {r['draft']} | {r['batch']} | {r['family']} | {acc} | {r['accepted_per_step']:.2f} | "
            f"{r['tok_per_s']:.1f} | "
            f"{r['speedup_vs_no_speculation']:.2f}x | {r['tok_per_cpu_s']:.1f} | "
            f"{r['cpu_speedup_vs_no_speculation']:.2f}x | {'yes' if r['same_output_as_no_speculation'] else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

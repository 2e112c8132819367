"""EAGLE over a tensor-parallel target against plain decoding over the same ranks (random weights).

Two systems, each in a process of its own (a process is rank 0 of one process group; each starts its
N - 1 followers), on the same target shape, `--tensor-parallel N`, bf16, CUDA graphs:

  * `--no-speculation`: draft none, k = 0;
  * a random-weight EAGLE-3 head of the target's shape (built in memory, whole on rank 0; it reads the
    features rank 0's forwards write). Random weights accept nothing real, so its rows keep each draft
    with probability alpha (SIMULATED acceptance, seeded: real draft and verify compute, output NOT the
    target's distribution), fixed k and adaptive k; plus one row at REAL acceptance (~0 with random
    weights: what drafting costs when nothing is accepted, adaptive k).

Rows: tok/s of B requests (prompt P, exactly G generated each, prefill included) per batch, the median
decode-only step, the speed-up over `--no-speculation` at the same batch. On CUDA the head's own call is
timed too (synchronized draft calls at k = 1 and k = 5 on rank 0: the chain step), and
`head_share_of_step_k3` bounds what sharding the head over the N ranks could save at k = 3: the head's
call × (1 − 1/N) over the k = 3 step, ignoring the two all-reduces per chain step a sharded head adds.

    python bench/tensor_parallel/eagle_tp.py --target llama-2-7b --tensor-parallel 2 \\
        --out bench/results/eagle_tp_llama2_7b.json
    python bench/tensor_parallel/eagle_tp.py --target llama-2-70b --tensor-parallel 2 --batches 1,16 \\
        --out bench/results/eagle_tp_llama2_70b.json        # H200 x2 (a 70B shard is ~70 GB a rank)

`--smoke`: the CPU (gloo), a tiny random checkpoint written to a temp dir, two small batches; no timing
worth reading.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # bench_meta
sys.path.insert(0, os.path.join(HERE, "..", "engine"))  # engine_throughput
sys.path.insert(0, os.path.join(HERE, "..", "drafts"))  # eagle_draft_cost
sys.path.insert(0, os.path.join(HERE, "..", "..", "services"))

from bench_meta import metadata  # noqa: E402

NONE = "--no-speculation (draft none, k = 0)"
K_MAX = 8  # every engine of a rank set: the followers capture the graphs of the k_max they were started with


def system_rows(args) -> list[tuple[str, float | None, dict]]:
    """(label, simulated acceptance or None, RuntimeConfig fields) of the head's rows."""
    rows = []
    for alpha in [float(a) for a in args.alphas.split(",") if a]:
        for k in args.ks.split(","):
            fields = dict(k_initial=4, adaptive=True) if k == "adaptive" else dict(k_initial=int(k), adaptive=False)
            rows.append((f"EAGLE head (random weights), SIMULATED acceptance {alpha}, k={k}", alpha, fields))
    rows.append(
        ("EAGLE head (random weights), REAL acceptance (~0), k=adaptive", None, dict(k_initial=4, adaptive=True))
    )
    return rows


def child(args) -> None:
    """One system over its own rank set; writes {"rows": [...], "draft_steps": [...]} to --child-out."""
    import dataclasses

    import torch
    from engine_throughput import LaneTimes, run_engine

    from verifypd.core.assembly import load_stack_models
    from verifypd.domain.config import RuntimeConfig
    from verifypd.engine import Engine, EngineOptions
    from verifypd.model.eagle_draft import EagleModel
    from verifypd.model.eagle_head import random_eagle_head

    cuda = args.device == "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    max_blocks = max(batches) * (-(-(args.prompt_len + args.gen_len + 16) // 16) + 1) + 64
    base = dict(
        target=args.target_spec,
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        num_blocks=max_blocks,
        max_context=args.prompt_len + args.gen_len + 64,
        graph_buckets=tuple(batches) if cuda else None,
        tensor_parallel=args.tensor_parallel,
    )
    config = RuntimeConfig(k_min=0, k_max=K_MAX, k_initial=0, adaptive=False)
    models = load_stack_models(EngineOptions(draft="none", config=config, **base))
    out: dict = {"rows": []}
    if args.child == "none":
        systems = [(NONE, None, dict(k_initial=0, adaptive=False))]
    else:
        target = models.target
        head_config, weights = random_eagle_head(
            target.shape,
            seed=0,
            draft_vocab=args.draft_vocab or None,
            device=models.device,
            dtype=models.dtype,
        )
        head = EagleModel(head_config, weights, target.weights.embed)
        models = dataclasses.replace(models, draft_model=head, draft_name="eagle:random")
        out["head_weight_bytes"] = sum(
            t.numel() * t.element_size()
            for t in (weights.fc, weights.layer.qkv, weights.layer.o, weights.layer.gate_up, weights.layer.down)
        ) + (weights.lm_head.numel() * weights.lm_head.element_size())
        systems = system_rows(args)
    try:
        for n, (label, alpha, fields) in enumerate(systems):
            cfg = dataclasses.replace(config, **fields)
            times = LaneTimes()
            engine = Engine(
                EngineOptions(draft=models.draft_name, config=cfg, **base),
                observer=times,
                models=models,
                simulated_acceptance=alpha,
            )
            if n == 0 and args.child == "eagle" and cuda:  # the head's call alone, rank 0 (no collectives)
                from eagle_draft_cost import draft_step_times
                from engine_throughput import copy_bandwidth

                out["draft_steps"] = draft_step_times(
                    engine, batches, copy_bandwidth(), context=min(192, args.prompt_len + args.gen_len // 2)
                )
            for b in batches:
                run_engine(engine, times, b, args.prompt_len, 16, seed=1000 + b)  # warm-up
                r = run_engine(engine, times, b, args.prompt_len, args.gen_len, seed=b)
                row = {"system": label, "simulated_acceptance": alpha, "batch": b, **r}
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
            del engine
            if cuda:
                torch.cuda.empty_cache()
    finally:
        if models.ranks is not None:
            models.ranks.close()
    with open(args.child_out, "w") as f:
        json.dump(out, f)


def write_tiny_checkpoint(root: pathlib.Path) -> str:
    """A tiny random Llama (hidden 64, 4 layers, 4 heads, 2 kv heads) with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = 96
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(root)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        root
    )
    return str(root)


def summarize(results: dict) -> None:
    """Speed-ups over --no-speculation per batch, and the head's share of a k = 3 step."""
    plain = {r["batch"]: r for r in results["rows"] if r["system"] == NONE}
    for row in results["rows"]:
        if row["batch"] in plain:
            row["speedup_vs_no_speculation"] = round(row["tok_per_s"] / plain[row["batch"]]["tok_per_s"], 3)
    world = results["tensor_parallel"]
    shares = {}
    for step in results.get("draft_steps", []):
        k3 = next(
            (
                r
                for r in results["rows"]
                if r["batch"] == step["batch"] and r["system"].endswith("k=3") and r["decode_only_step_median_s"]
            ),
            None,
        )
        if k3 is None:
            continue
        head_call = step["draft_call_k1_s"] + 2 * step["chain_step_s"]  # k = 3: catch-up + 2 chain steps
        shares[str(step["batch"])] = {
            "head_call_k3_s": round(head_call, 6),
            "step_k3_s": k3["decode_only_step_median_s"],
            "head_share_of_step_k3": round(head_call / k3["decode_only_step_median_s"], 3),
            "sharded_head_saves_at_most": round(head_call * (1 - 1 / world) / k3["decode_only_step_median_s"], 3),
        }
    if shares:
        results["head_share_of_step_k3"] = shares
    for row in results["rows"]:
        print(
            f"{row['system']:72s} batch {row['batch']:>3d}  {row['tok_per_s']:>9.1f} tok/s  "
            f"x{row.get('speedup_vs_no_speculation', float('nan')):.2f}  mean k {row['mean_k']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="llama-2-7b", help="a loader.RANDOM_SHAPES name")
    ap.add_argument("--tensor-parallel", type=int, default=2)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--alphas", default="0.7", help="SIMULATED acceptance rates of the head's rows")
    ap.add_argument("--ks", default="3,adaptive")
    ap.add_argument("--draft-vocab", type=int, default=0, help="the head's draft vocabulary (0: the target's)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny random checkpoint, two small batches")
    ap.add_argument("--out", required=True, help="the JSON result")
    ap.add_argument("--child", choices=("none", "eagle"), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--target-spec", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory(prefix="eagle-tp-") as tmp:
        passed = sys.argv[1:]
        if args.smoke:
            spec = write_tiny_checkpoint(pathlib.Path(tmp) / "target")
            passed += ["--device", "cpu", "--batches", "1,2", "--prompt-len", "8", "--gen-len", "8"]
            args.batches, args.device = "1,2", "cpu"
        else:
            spec = f"random:{args.target}"
        results = {
            **metadata(),
            "bench": "eagle_tp",
            "weights": "random (target and head)"
            + (" float32, CPU smoke: timings not meaningful" if args.smoke else ", bf16"),
            "acceptance": "SIMULATED (seeded coin per draft token) unless the row says REAL",
            "target_shape": "tiny random checkpoint" if args.smoke else args.target,
            "tensor_parallel": args.tensor_parallel,
            "prompt_len": 8 if args.smoke else args.prompt_len,
            "gen_len": 8 if args.smoke else args.gen_len,
            "rows": [],
        }
        for system in ("none", "eagle"):
            part = os.path.join(tmp, f"{system}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *passed, "--child", system, "--child-out", part]
            cmd += ["--target-spec", spec]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            with open(part) as f:
                got = json.load(f)
            results["rows"] += got["rows"]
            for key in ("draft_steps", "head_weight_bytes"):
                if key in got:
                    results[key] = got[key]
        summarize(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()

"""The trained head's real acceptance, one command: the engine at temperature 0 with a fixed k on the
held-out prompts (bench/prompts/draft_acceptance.jsonl: chat, rewrite, edit_code, extract; none of
them in the head's training data, which the target wrote itself), against ngram on the same
prompts: mean tokens per verify step (accepted drafts + 1), per family and overall.

    python bench/drafts/eagle_acceptance.py --device cuda --out bench/results/eagle_acceptance_h200.json
    python bench/drafts/eagle_acceptance.py --device cpu --per-family 4 --max-tokens 64    # a short CPU run

--head defaults to the head shipped for the embedded model (`smollm2`: services/verifypd/heads/smollm2_eagle;
2.50 on the H200, bench/results/eagle_acceptance_h200.json); a head is a shipped head's name or a directory;
repeat --head to measure several heads in the same run; --draft adds other drafts (e.g. the head mixed
with prompt lookup, eagle+ngram:DIR), --no-ngram leaves the ngram baseline out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench_meta

from bench_meta import metadata

from verifypd.distill.evaluate import compare_drafts

BENCH = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2", help="the embedded model, or a path to its GGUF")
    ap.add_argument(
        "--head",
        action="append",
        default=None,
        help="a head directory or a shipped head's name; repeat to measure several in one run (default: "
        "smollm2, the head shipped for the embedded model)",
    )
    ap.add_argument(
        "--draft",
        action="append",
        default=[],
        help="another draft to measure beside the heads, e.g. eagle+ngram:DIR (repeatable)",
    )
    ap.add_argument("--no-ngram", action="store_true", help="leave ngram out (on the CPU it decodes ~plainly: slow)")
    ap.add_argument("--prompts", default=str(BENCH / "prompts" / "draft_acceptance.jsonl"))
    ap.add_argument("--per-family", type=int, default=0, help="the first N prompts of each family (0: all)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.k < 1 or args.max_tokens < 1 or args.per_family < 0:
        ap.error("--k and --max-tokens must be >= 1, --per-family >= 0")
    prompts = args.prompts
    if args.per_family:
        seen: dict[str, int] = {}
        lines = []
        for line in pathlib.Path(args.prompts).read_text().splitlines():
            family = json.loads(line).get("family", "all")
            seen[family] = seen.get(family, 0) + 1
            if seen[family] <= args.per_family:
                lines.append(line)
        tmp = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
        tmp.write("\n".join(lines) + "\n")
        tmp.close()
        prompts = tmp.name
    heads = args.head or ["smollm2"]
    drafts = [f"eagle:{h}" for h in heads] + args.draft + ([] if args.no_ngram else ["ngram"])
    results = compare_drafts(args.target, drafts, prompts, k=args.k, max_tokens=args.max_tokens, device=args.device)
    results = {
        **metadata(),
        "head": heads[0] if len(heads) == 1 else heads,
        "per_family": args.per_family or "all",
        **results,
    }
    print("| draft | " + " | ".join(sorted(results["drafts"][0]["families"])) + " |")
    for r in results["drafts"]:
        fams = r["families"]
        print(
            f"| {r['draft']} | " + " | ".join(f"{fams[f]['tokens_per_verify_step']:.2f}" for f in sorted(fams)) + " |"
        )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

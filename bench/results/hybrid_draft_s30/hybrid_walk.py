"""Counterfactual k = 4 greedy walks (CPU analysis, session 30): the committed head, prompt lookup, and a
hybrid that takes prompt lookup's proposal when its match is at least L tokens long, the head's otherwise.

Input: the head's teacher-forced top-5 drafts per chain step over the 96 held-out prompts' greedy answers
(`bench/results/smollm2_eagle_limits_19v/analyze.py --dump`). Exact for greedy data, as that directory's
counterfactual.py: after an accepted prefix the chain's inputs are the target's own tokens, so the head's
step-j draft at anchor p is the dump's; prompt lookup's proposal is a function of the context alone.
The walk is the engine's: a step at anchor p accepts a drafts (a run of matches) and moves to p + a + 1.

    python3 bench/results/hybrid_draft_s30/hybrid_walk.py --dump top5_eval.jsonl --out hybrid_walk.json
"""

import argparse
import json
from collections import defaultdict

from verifypd.lanes.ngram import propose  # the engine's prompt lookup (longest match first, overlapping copy)

K = 4


def walk(row, choose):
    """(accepted, verify steps) of one answer; choose(row, p) -> list of K booleans (draft j right)."""
    seq, plen = row["seq"], row["plen"]
    p, last = plen - 1, len(seq) - 2
    acc = steps = 0
    while p < last:
        a = 0
        for ok in choose(row, p)[: max(0, len(seq) - 2 - p)]:  # no draft past the answer's end
            if not ok:
                break
            a += 1
        acc, steps, p = acc + a, steps + 1, p + a + 1
    return acc, steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--min-n", type=int, default=2)
    ap.add_argument("--max-n", type=int, default=8)
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.dump)]
    cache = {}

    def lookup(row, p, min_n, max_n=args.max_n):
        """Prompt lookup's K tokens at anchor p: the longest repeated suffix of at least min_n tokens."""
        key = (id(row), p, min_n, max_n)
        if key not in cache:
            cache[key] = propose(row["seq"][: p + 2], K, min_n, max_n)
        return cache[key]

    def head(row, p):
        return [
            row["top5"][j][p + j][0] == row["seq"][p + 2 + j] if p + 2 + j < len(row["seq"]) else False
            for j in range(K)
        ]

    def matches(row, p, out):
        return [p + 2 + j < len(row["seq"]) and t == row["seq"][p + 2 + j] for j, t in enumerate(out)]

    def run(rule):
        tot = defaultdict(lambda: [0, 0])
        for row in rows:
            a, s = walk(row, rule)
            for key in (row["family"], "all"):
                tot[key][0] += a
                tot[key][1] += s
        return {f: round(1 + a / s, 3) for f, (a, s) in sorted(tot.items())}

    results = {
        "head": run(head),
        "ngram:2-4 (the default draft)": run(lambda r, p: matches(r, p, lookup(r, p, 2, 4))),
        f"ngram:{args.min_n}-{args.max_n}": run(lambda r, p: matches(r, p, lookup(r, p, args.min_n))),
    }
    for L in range(args.min_n, args.max_n + 1):  # lookup where its match is >= L tokens, else the head
        results[f"hybrid:L>={L}"] = run(
            lambda r, p, L=L: matches(r, p, lookup(r, p, L)) if lookup(r, p, L) else head(r, p)
        )

    def oracle(r, p):  # the better of the two at every step: an upper bound no rule reaches
        h, g = head(r, p), matches(r, p, lookup(r, p, args.min_n))
        count = lambda x: next((i for i, ok in enumerate(x) if not ok), len(x))  # noqa: E731
        return h if count(h) >= count(g) else g

    results["oracle(best of both per step)"] = run(oracle)
    json.dump(
        {"k": K, "dump": args.dump, "min_n": args.min_n, "max_n": args.max_n, "tokens_per_verify_step": results},
        open(args.out, "w"),
        indent=1,
    )
    for name, r in results.items():
        print(f"{name:32s}", " ".join(f"{f} {v:.3f}" for f, v in r.items()))


if __name__ == "__main__":
    main()

"""Scratch (issue 19v): counterfactual k = 4 greedy walks over the committed head's teacher-forced top-5
drafts (analyze.py --dump). Exact for greedy data: the chain's drafts after an accepted prefix are the
teacher-forced rows'. Tokens per verify step per family for:
  head         : the head as is (top-1 == the target's token)           [checks analyze.py]
  bound:V      : every token in vocabulary V accepted, every other rejected
  opt:V        : the head, plus every token outside its 8,192-token vocabulary but inside V accepted
                 (optimistic: a larger vocabulary with the head always right on the new tokens)
  est:V        : the same, the new tokens accepted at the head's own rate on in-vocabulary tokens of the
                 same family, chain position and kind (copied from the prompt or not); mean of 200 draws
  tree:w1-w2-w3-w4 : the target's token within the head's top-w_j at chain position j (a tree of those widths)
"""

import argparse
import json
import random
from collections import defaultdict

import torch
from safetensors import safe_open

K = 4
ap = argparse.ArgumentParser()
ap.add_argument("--dump", required=True)
ap.add_argument("--head", default="bench/results/smollm2_eagle_h200_8k")  # the head analysed (weights: its WEIGHTS.md)
ap.add_argument("--vocab", action="append", default=[], help="NAME=FILE (JSON list of target ids)")
ap.add_argument("--out", required=True)
args = ap.parse_args()
d2t = safe_open(f"{args.head}/model.safetensors", "pt").get_tensor("d2t")
head_vocab = set((d2t + torch.arange(len(d2t))).tolist())  # published d2t: target id minus draft id
vocabs = {"8192(head)": head_vocab}
for spec in args.vocab:
    name, path = spec.split("=", 1)
    vocabs[name] = set(json.load(open(path)))
vocabs["full"] = None
rows = [json.loads(l) for l in open(args.dump)]


def walk(row, accept):
    seq, plen = row["seq"], row["plen"]
    first, last = plen - 1, len(seq) - 2
    acc = steps = 0
    p = first
    while p < last:
        a = 0
        for j in range(K):
            if p + 2 + j > len(seq) - 1 or not accept(row, p, j):
                break
            a += 1
        acc, steps, p = acc + a, steps + 1, p + a + 1
    return acc, steps


def target(row, p, j):
    return row["seq"][p + 2 + j]


def head_ok(row, p, j):
    return row["top5"][j][p + j][0] == target(row, p, j)


# the head's rate on in-vocabulary tokens, per (family, position, copied from the prompt), along its own walk
hits = defaultdict(lambda: [0, 0])
for row in rows:
    prompt = set(row["seq"][: row["plen"]])

    def record(row, p, j, prompt=prompt):
        t = target(row, p, j)
        ok = head_ok(row, p, j)
        if t in head_vocab:
            h = hits[(row["family"], j, t in prompt)]
            h[0] += ok
            h[1] += 1
        return ok

    walk(row, record)
rate = {key: a / n for key, (a, n) in hits.items()}

results = defaultdict(dict)


def totals(accept_for):
    """{family and "all": [accepted, verify steps]} of walking every row with accept_for(row)."""
    tot = defaultdict(lambda: [0, 0])
    for row in rows:
        a, s = walk(row, accept_for(row))
        for key in (row["family"], "all"):
            tot[key][0] += a
            tot[key][1] += s
    return tot


def run(name, accept_for):
    for key, (a, s) in totals(accept_for).items():
        results[key][name] = round((a + s) / s, 3)


run("head", lambda row: head_ok)
for vname, V in vocabs.items():
    inside = (lambda t: True) if V is None else (lambda t, V=V: t in V)
    if vname != "8192(head)":
        run(
            f"opt:{vname}",
            lambda row, inside=inside: (
                lambda r, p, j: head_ok(r, p, j) or (target(r, p, j) not in head_vocab and inside(target(r, p, j)))
            ),
        )
        draws = defaultdict(list)
        for seed in range(200):
            rng = random.Random(seed)

            def est(row, inside=inside, rng=rng):
                prompt = set(row["seq"][: row["plen"]])

                def accept(r, p, j):
                    t = target(r, p, j)
                    if t in head_vocab:
                        return head_ok(r, p, j)
                    return inside(t) and rng.random() < rate.get((r["family"], j, t in prompt), 0.0)

                return accept

            for key, (a, s) in totals(est).items():
                draws[key].append((a + s) / s)
        for key, v in draws.items():
            results[key][f"est:{vname}"] = round(sum(v) / len(v), 3)
    if V is not None:
        run(f"bound:{vname}", lambda row, V=V: lambda r, p, j: target(r, p, j) in V)
for widths in ((2, 1, 1, 1), (3, 1, 1, 1), (5, 1, 1, 1), (2, 2, 1, 1), (2, 2, 2, 2), (5, 5, 5, 5)):
    run(
        "tree:" + "-".join(map(str, widths)),
        lambda row, w=widths: lambda r, p, j: target(r, p, j) in r["top5"][j][p + j][: w[j]],
    )
out = {
    "rates_in_vocab_by_family_position_copied": {
        f"{f}|pos{j + 1}|{'copied' if c else 'new'}": [round(rate[(f, j, c)], 3), hits[(f, j, c)][1]]
        for (f, j, c) in sorted(rate)
    },
    "tokens_per_verify_step": results,
    "vocab_sizes": {k: (len(v) if v else 49152) for k, v in vocabs.items()},
}
open(args.out, "w").write(json.dumps(out, indent=1) + "\n")
for fam in ("all", "chat", "rewrite", "extract", "edit_code"):
    print(fam, results[fam])

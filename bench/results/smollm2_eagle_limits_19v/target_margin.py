"""Scratch (issue 19v): how sure is the TARGET of its greedy token where the head misses? For each
row of the committed head's walk (top5_eval.jsonl from analyze.py --dump), the target's probability of
its own greedy token (softmax of its logits, captured as in training), split by hit / miss per family and
chain position. Low target confidence at misses = genuine ambiguity a better chain head can hardly fix."""

import json
import statistics
import sys
from collections import defaultdict

import torch

from verifypd.distill.capture import TargetCapture
from verifypd.local_engine import EngineOptions, load_models

torch.set_grad_enabled(False)
rows = [json.loads(l) for l in open(sys.argv[1])]
models = load_models(EngineOptions(target="smollm2", draft="none", device="cpu"))
t = models.target
cap = TargetCapture(t, (1, 14, 26), models.device, max(len(r["seq"]) for r in rows) + 64)
K = 4
vals = defaultdict(list)
for r in rows:
    seq, plen = r["seq"], r["plen"]
    b = cap([seq], [plen])
    prob = b.labels[0].float().softmax(-1)  # [T, V]: row t predicts seq[t + 2]
    p, last = plen - 1, len(seq) - 2
    while p < last:
        a = 0
        for j in range(K):
            if p + 2 + j > len(seq) - 1:
                break
            want = seq[p + 2 + j]
            q = float(prob[p + j, want])
            hit = r["top5"][j][p + j][0] == want
            vals[(r["family"], j + 1, "hit" if hit else "miss")].append(q)
            if not hit:
                break
            a += 1
        p += a + 1
out = {}
for (fam, j, kind), v in sorted(vals.items()):
    out[f"{fam}|pos{j}|{kind}"] = {
        "n": len(v),
        "median_target_p": round(statistics.median(v), 3),
        "share_p_below_0.5": round(sum(x < 0.5 for x in v) / len(v), 3),
    }
json.dump(out, open(sys.argv[2], "w"), indent=1)
for k, v in out.items():
    print(k, v)

"""Scratch (issue 19v): larger draft vocabularies chosen the way `verifypd distill --draft-vocab N` chooses
(the N most frequent tokens of the training sequences, prompts and answers: distill/cli.py), approximated
without the committed head's training data (it stayed on the GPU machine): counts from the target's greedy
answers to a DIFFERENT prompt set (own_answers.jsonl: distill.data.own_prompts, committed generator
"seeds", seed 7; the evaluation prompts are never used). Two approximations per N:
  own<N>    : the N most frequent tokens of that data alone (fewer when the data has fewer distinct tokens)
  head+<N>  : the committed head's 8,192 (the rule's real output on 2.89 M tokens) plus the most frequent
              other tokens of that data, up to N
Also: distinct tokens against tokens counted (Heaps' law fit, extrapolated to the 2.89 M of the real data).
"""

import json
import math
import sys
from collections import Counter

import torch
from safetensors import safe_open

own = [json.loads(l) for l in open(sys.argv[1])]
outdir = sys.argv[2]
d2t = safe_open("bench/results/smollm2_eagle_h200_8k/model.safetensors", "pt").get_tensor("d2t")
head = set((d2t + torch.arange(len(d2t))).tolist())
stream = [t for r in own for t in r["prompt_ids"] + r["answer_ids"]]
counts = Counter(stream)
info = {"own_sequences": len(own), "own_tokens": len(stream), "own_distinct": len(counts)}
seen, pts = set(), []
for i, t in enumerate(stream, 1):
    seen.add(t)
    if i in (len(stream) // 8, len(stream) // 4, len(stream) // 2, len(stream)):
        pts.append((i, len(seen)))
xs, ys = [math.log(a) for a, _ in pts], [math.log(b) for _, b in pts]
beta = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
info["heaps_points"] = pts
info["heaps_beta"] = round(beta, 3)
info["distinct_extrapolated_to_2.89M_tokens"] = round(pts[-1][1] * (2.89e6 / pts[-1][0]) ** beta)
ranked = [t for t, _ in counts.most_common()]
info["own_top8192_overlap_with_head_vocab"] = len(set(ranked[:8192]) & head)
for n in (8192, 16384, 32768):
    own_n = ranked[:n]
    json.dump(sorted(own_n), open(f"{outdir}/vocab_own{n}.json", "w"))
    extra = [t for t in ranked if t not in head][: max(0, n - len(head))]
    hybrid = sorted(head | set(extra))
    json.dump(hybrid, open(f"{outdir}/vocab_head+{n}.json", "w"))
    info[f"own{n}_size"], info[f"head+{n}_size"] = len(own_n), len(hybrid)
json.dump(info, open(f"{outdir}/vocab_sets.json", "w"), indent=1)
print(json.dumps(info, indent=1))

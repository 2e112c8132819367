"""Scratch (19v): of the eval answers' tokens outside the committed 8,192, how many occur at all in fresh
own-sample data (a different prompt set)? Usage: oov_seen.py OWN.jsonl [OWN2.jsonl ...]"""

import json
import sys

import torch
from safetensors import safe_open

d2t = safe_open("bench/results/smollm2_eagle_h200_8k/model.safetensors", "pt").get_tensor("d2t")
head = set((d2t + torch.arange(len(d2t))).tolist())
own = set()
n = 0
for f in sys.argv[1:]:
    for l in open(f):
        r = json.loads(l)
        own.update(r["prompt_ids"] + r["answer_ids"])
        n += len(r["prompt_ids"]) + len(r["answer_ids"])
ev = [json.loads(l) for l in open("bench/results/smollm2_eagle_limits_19v/eval_answers.jsonl")]
print(f"own tokens {n}, distinct {len(own)}, outside the head's 8192: {len(own - head)}")
for fam in ("chat", "rewrite", "extract", "edit_code", None):
    oov = [t for r in ev if fam in (None, r["family"]) for t in r["answer_ids"] if t not in head]
    print(fam or "all", "eval OOV occurrences", len(oov), "of which seen in own data", sum(t in own for t in oov))

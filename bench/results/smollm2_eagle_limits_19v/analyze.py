"""Scratch (issue 19v): what limits the committed EAGLE head on the 96 held-out prompts (CPU).

Input: the target's greedy answers (gen_answers.py eval). For each sequence, the target's features are
captured by its serving forward (distill.capture.TargetCapture, as training does) and the head is run
teacher-forced over its k = 4 chain (distill.head_train.TrainableHead, the training module that matches
the paged chain). On greedy data, the drafts the chain would make at every anchor are exactly those of
the teacher-forced rows whose earlier steps matched (distill.head_train.accepted_length's argument).
Walked as the engine walks (first anchor = the first answer token's row; a + 1 rows on after a step).

Reports per family: draft-vocabulary coverage of answer tokens, the vocabulary-only upper bound
(every in-vocabulary token accepted, every other rejected; chain), the head's tokens per verify step,
where the rejections fall (chain position 1..4), and whether the target's token at a rejected position
is in the head's top-2/3/5 (target ids), or outside the draft vocabulary.
"""

import argparse
import json
import sys
import time
from collections import defaultdict

import torch

from verifypd.distill.capture import TargetCapture
from verifypd.distill.head_train import TrainableHead
from verifypd.local_engine import EngineOptions, load_models
from verifypd.model.eagle_head import load_eagle_head

K = 4
ap = argparse.ArgumentParser()
ap.add_argument("--answers", required=True)
ap.add_argument("--head", default="bench/results/smollm2_eagle_h200_8k")  # the head analysed (weights: its WEIGHTS.md)
ap.add_argument(
    "--vocab", action="append", default=[], help="extra draft vocabularies to bound: NAME=FILE (JSON list of ids)"
)
ap.add_argument("--out", required=True)
ap.add_argument("--limit", type=int, default=0)
ap.add_argument(
    "--dump", default=None, help="also write per-sequence top-5 drafts (target ids) per chain step: JSON lines"
)
args = ap.parse_args()
torch.set_grad_enabled(False)
t0 = time.monotonic()
rows = [json.loads(l) for l in open(args.answers)]
if args.limit:
    rows = rows[: args.limit]
models = load_models(EngineOptions(target="smollm2", draft="none", device="cpu"))
target = models.target
config, weights = load_eagle_head(args.head, target.shape, target.weights.lm_head, models.device, torch.float32)
head = TrainableHead(config, weights, target.weights.embed, train_lm_head=False)
d2t = weights.draft_to_target
if d2t is None:  # a whole-vocabulary head (no map, session 29's): draft id = target id
    d2t = torch.arange(target.shape.vocab_size)
vocabs = {"head": set(d2t.tolist())}
for spec in args.vocab:
    name, path = spec.split("=", 1)
    vocabs[name] = set(json.load(open(path)))
longest = max(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows)
capture = TargetCapture(target, config.aux_layer_ids, models.device, longest + 64)
eos = set(target.eos_token_ids)

stat = defaultdict(lambda: defaultdict(float))
dump_rows = []


def walk(first: int, last: int, accepted_at) -> tuple[int, int]:
    """Engine walk over rows first..last: returns (accepted drafts, verify steps)."""
    acc = steps = 0
    p = first
    while p < last:
        a = accepted_at(p)
        acc, steps, p = acc + a, steps + 1, p + a + 1
    return acc, steps


for n, r in enumerate(rows):
    fam = r["family"]
    seq = r["prompt_ids"] + r["answer_ids"]
    plen = len(r["prompt_ids"])
    b = capture([seq], [plen])
    logits = head(b.tokens, b.features.float(), K)  # K x [1, T, Vd]
    T = b.tokens.shape[1]
    # row t predicts token t + 2; answer tokens are seq[plen:]; rows plen-1 .. len(seq)-2 are "greedy"
    first, last = plen - 1, len(seq) - 2
    top = [d2t[lg[0].topk(5, -1).indices] for lg in logits]  # K x [T, 5] target ids
    if args.dump:
        dump_rows.append(
            {"family": fam, "plen": plen, "seq": seq, "top5": [t[: len(seq) - 1].tolist() for t in top]}
        )  # K x [rows, 5]

    def drafted_ok(p, j):  # step j of anchor p predicts seq[p + 2 + j]; the engine drafts only tokens it may still emit
        return p + 2 + j <= len(seq) - 1

    def head_accepts(p):
        a = 0
        for j in range(K):
            if not drafted_ok(p, j) or int(top[j][p + j, 0]) != seq[p + 2 + j]:
                break
            a += 1
        return a

    for name, vocab in vocabs.items():

        def vocab_accepts(p, vocab=vocab):
            a = 0
            for j in range(K):
                if not drafted_ok(p, j) or seq[p + 2 + j] not in vocab:
                    break
                a += 1
            return a

        acc, steps = walk(first, last, vocab_accepts)
        for key in (fam, "all"):
            stat[key][f"bound_{name}_acc"] += acc
            stat[key][f"bound_{name}_steps"] += steps
            stat[key][f"oov_{name}"] += sum(t not in vocab for t in r["answer_ids"])
    answer = r["answer_ids"]
    # the head's own walk, with rejection analysis
    p = first
    while p < last:
        a = head_accepts(p)
        for key in (fam, "all"):
            s = stat[key]
            s["acc"] += a
            s["steps"] += 1
            s[f"acc_hist_{a}"] += 1
        j = a
        if j < K and drafted_ok(p, j):  # a rejection at chain position j + 1
            want = seq[p + 2 + j]
            ranks = top[j][p + j].tolist()
            for key in (fam, "all"):
                s = stat[key]
                s["rej"] += 1
                s[f"rej_pos{j + 1}"] += 1
                s["rej_oov"] += want not in vocabs["head"]
                s[f"rej_pos{j + 1}_oov"] += want not in vocabs["head"]
                for w in (2, 3, 5):
                    s[f"rej_top{w}"] += want in ranks[:w]
                    s[f"rej_pos{j + 1}_top{w}"] += want in ranks[:w]
        p += a + 1
    for key in (fam, "all"):
        stat[key]["answer_tokens"] += len(answer)
        stat[key]["sequences"] += 1
    if n % 8 == 7:
        print(f"{n + 1}/{len(rows)} {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

if args.dump:
    open(args.dump, "w").write("".join(json.dumps(r) + "\n" for r in dump_rows))
report = {}
for fam, s in sorted(stat.items()):
    out = {
        "sequences": int(s["sequences"]),
        "answer_tokens": int(s["answer_tokens"]),
        "head_tokens_per_verify_step": (s["acc"] + s["steps"]) / s["steps"],
        "verify_steps": int(s["steps"]),
        "accepted_histogram": {a: int(s[f"acc_hist_{a}"]) for a in range(K + 1)},
        "rejections": int(s["rej"]),
        "rejections_by_position": {j: int(s[f"rej_pos{j}"]) for j in range(1, K + 1)},
        "rejected_token_outside_draft_vocab": int(s["rej_oov"]),
        "rejected_token_in_head_top": {w: int(s[f"rej_top{w}"]) for w in (2, 3, 5)},
        "by_position": {
            j: {
                "rejections": int(s[f"rej_pos{j}"]),
                "oov": int(s[f"rej_pos{j}_oov"]),
                "top2": int(s[f"rej_pos{j}_top2"]),
                "top5": int(s[f"rej_pos{j}_top5"]),
            }
            for j in range(1, K + 1)
        },
    }
    for name in vocabs:
        out[f"vocab_{name}"] = {
            "size": len(vocabs[name]),
            "answer_tokens_outside": s[f"oov_{name}"] / s["answer_tokens"],
            "upper_bound_tokens_per_verify_step": (s[f"bound_{name}_acc"] + s[f"bound_{name}_steps"])
            / s[f"bound_{name}_steps"],
            "upper_bound_verify_steps": int(s[f"bound_{name}_steps"]),
        }
    report[fam] = out
report["_meta"] = {
    "answers": args.answers,
    "head": args.head,
    "k": K,
    "cpu_seconds_wall": round(time.monotonic() - t0, 1),
    "command": " ".join(sys.argv),
}
open(args.out, "w").write(json.dumps(report, indent=1) + "\n")
for fam, o in report.items():
    if fam.startswith("_"):
        continue
    print(
        fam,
        round(o["head_tokens_per_verify_step"], 3),
        o["verify_steps"],
        "oov",
        round(o["vocab_head"]["answer_tokens_outside"], 4),
        "bound",
        round(o["vocab_head"]["upper_bound_tokens_per_verify_step"], 3),
        "rejpos",
        o["rejections_by_position"],
        "top",
        o["rejected_token_in_head_top"],
        "rej_oov",
        o["rejected_token_outside_draft_vocab"],
    )

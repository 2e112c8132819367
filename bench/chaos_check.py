"""Why does a chaos output differ from the reference? (bench/chaos.py's classification.)

An output that differs from the fault-free reference is either a *numerical* divergence (a near-tie
decided the other way because a different batch mix, verify width or dtype rounds differently) or
*wrong* (a token no rounding explains: a recovery bug, KV reused after a crash, a corrupted
stream). To tell them apart, the output is re-scored alone: the target in float32 (its weights
first rounded to the serving dtype, so it is the same function the server approximates), batch 1,
no speculation, one forward over prompt + output. At each output position the token the server
emitted must be the rescored choice, or lose to it by at most the tie tolerance:

    gap_t = score_t(best) - score_t(emitted)        in logit units
    greedy:  score = logits                          (the choice is argmax)
    sampled: score = logits + T * G(seed, pos, v)    (the seeded race of model/sampler.py in
             Gumbel form: argmax log U / p = argmax log p - log(-log U); times T to stay in logits)

    tolerance_t = max(epsilon, ulps * ulp of the serving dtype at the position's largest |logit|)

An output whose every position from the first divergence on has gap <= tolerance is numerical; any
position beyond it makes the output wrong. So a numerical first divergence cannot hide a corrupted
token later: every token after it is checked against its own (diverged) prefix. Top-p truncation
is checked with the same tolerance on probability mass: a token just outside the fp32 nucleus
(cumulative mass before it < top_p + epsilon) may be emitted, one further out may not.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from verifypd.domain.requests import SamplingParams
from verifypd.model import sampler
from verifypd.model.build import resolve_device, resolve_dtype
from verifypd.model.layout import TokenRun, build_layout
from verifypd.model.llama import BatchLayout, PagedLlama
from verifypd.model.loader import load_model

DEFAULT_EPSILON = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
BLOCK = 16
LANE_FAULTS = ("kill", "stop")


@dataclass
class Completion:
    """One OK response of the load: which request, when (monotonic s), what tokens."""

    index: int
    start: float
    end: float
    ids: list[int]


@dataclass
class FaultWindow:
    """When a fault acted: [start, end] monotonic s (a kill is an instant; a stop lasts --stop-s)."""

    kind: str
    lane: str | None
    start: float
    end: float


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def faults_during(c: Completion, windows: list[FaultWindow]) -> list[str]:
    """The faults that acted while the request was in flight ("kill:verify", "flood", ...)."""
    return [f"{w.kind}:{w.lane}" if w.lane else w.kind for w in windows if w.start <= c.end and w.end >= c.start]


def _to_float32(obj):
    """A copy of a weights dataclass tree with every floating tensor in float32."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_float32(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    if isinstance(obj, list):
        return [_to_float32(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_float32(v) for k, v in obj.items()}
    return obj


class Rescorer:
    """The target in float32, batch 1, no speculation, torch reference attention (no Triton)."""

    def __init__(self, target: str, device: str, serve_dtype: str, max_context: int):
        self.device = resolve_device(device)
        self.serve_dtype = resolve_dtype(serve_dtype, self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
        loaded = load_model(target, self.device, self.serve_dtype, max_context)
        self.model = PagedLlama(loaded.shape, _to_float32(loaded.weights), attention="reference")
        del loaded

    def logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), V] float32: the next-token logits after each prefix of `ids`."""
        s = self.model.shape
        blocks = -(-len(ids) // BLOCK)
        pool = torch.zeros(2, self.model.num_layers, blocks, BLOCK, s.num_kv_heads, s.head_dim, device=self.device)
        lay = build_layout([TokenRun(list(ids), 0, tuple(range(blocks)))], BLOCK)

        def to(a, dtype=torch.long):
            return torch.as_tensor(a, dtype=dtype, device=self.device)

        batch = BatchLayout(
            to(lay.ids),
            to(lay.positions),
            to(lay.slots),
            to(lay.tables, torch.int32),
            to(lay.query_start, torch.int32),
            lay.max_query,
        )
        return self.model.forward(pool, batch, torch.arange(len(ids), device=self.device)).float()

    def tolerance(self, logits: torch.Tensor, epsilon: float, ulps: float) -> torch.Tensor:
        """[T]: max(epsilon, ulps x the serving dtype's spacing at each row's largest |logit|)."""
        top = logits.abs().amax(-1).clamp_min(1e-30)
        spacing = torch.finfo(self.serve_dtype).eps * torch.exp2(torch.floor(torch.log2(top)))
        return torch.clamp(ulps * spacing, min=epsilon)


def choice_scores(
    logits: torch.Tensor, sampling: SamplingParams, positions: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, V] float32 -> (scores [T, V] in logit units, robust [T, V] bool, allowed [T, V] bool).
    robust: surely inside the nucleus (mass before it < top_p - epsilon); allowed: possibly inside
    (< top_p + epsilon). The best robust score is the one an emitted allowed token must reach."""
    if sampling.greedy:
        full = torch.ones_like(logits, dtype=torch.bool)
        return logits, full, full
    T = sampling.temperature
    seeds = sampler.seed_tensor([sampling.seed] * len(positions), logits.device)
    log_u = sampler.race_log_uniforms(seeds, positions, logits.shape[-1])
    scores = logits + T * -torch.log(-log_u)
    probs = torch.softmax(logits / T, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.cumsum(-1) - sorted_probs)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(probs.shape[-1], device=probs.device).expand_as(order)
    )
    in_k = rank < (sampling.top_k if sampling.top_k > 0 else probs.shape[-1])
    robust = in_k & (before < sampling.top_p - epsilon)
    robust[torch.arange(len(rank)), order[:, 0]] = True  # the top token is always kept
    allowed = in_k & (before < sampling.top_p + epsilon)
    return scores, robust, allowed


def check_output(
    rescorer: Rescorer,
    prompt: list[int],
    output: list[int],
    sampling: SamplingParams,
    start: int,
    epsilon: float,
    ulps: float,
) -> dict:
    """Gaps of output[start:] against the float32 batch-1 choice; see the module doc."""
    logits = rescorer.logits(prompt + output[:-1])[len(prompt) - 1 :]  # row t chooses output[t]
    positions = torch.arange(len(prompt), len(prompt) + len(output), device=logits.device)
    scores, robust, allowed = choice_scores(logits, sampling, positions, epsilon)
    emitted = torch.tensor(output, device=logits.device)
    rows = torch.arange(len(output), device=logits.device)
    best = scores.masked_fill(~robust, -math.inf)
    top2 = best.topk(2, dim=-1).values
    gap = (best.amax(-1) - scores[rows, emitted]).clamp_min(0)
    gap = torch.where(allowed[rows, emitted], gap, torch.full_like(gap, math.inf))
    tol = rescorer.tolerance(logits, epsilon, ulps)
    bad = [t for t in range(start, len(output)) if gap[t] > tol[t]]
    margins = top2[:, 0] - top2[:, 1]
    return {
        "near_ties": int((margins[start:] <= tol[start:]).sum()),  # positions a rounding could flip
        "not_the_float32_choice": int((gap[start:] > 0).sum()),
        "top2_margin": float(top2[start, 0] - top2[start, 1]) if start < len(output) else None,
        "gap": float(gap[start]) if start < len(output) else None,
        "tolerance": float(tol[start]) if start < len(output) else None,
        "unexplained_positions": bad[:8],
        "worst_gap": float(gap[bad].max()) if bad else None,
        "class": "wrong" if bad else "numerical",
    }


def classify(
    rescorer: Rescorer,
    prompts: list[list[int]],
    samplings: list[SamplingParams],
    reference: list[list[int]],
    completions: list[Completion],
    windows: list[FaultWindow],
    epsilon: float,
    ulps: float,
) -> dict:
    """Counts of the completions that differ from the reference, by class and by whether a lane fault
    (kill / stop) acted while they were in flight; one example row per distinct output."""
    checked: dict[tuple[int, tuple[int, ...]], dict] = {}
    counts: dict[str, int] = {}
    for c in completions:
        d = first_divergence(c.ids, reference[c.index])
        if d is None:
            continue
        key = (c.index, tuple(c.ids))
        if key not in checked:
            row = {"request": c.index, "greedy": samplings[c.index].greedy, "first_divergence": d, "count": 0}
            if d >= len(c.ids) or d >= len(reference[c.index]):
                row.update({"class": "wrong", "why": "length differs"})
            else:
                row.update(check_output(rescorer, prompts[c.index], c.ids, samplings[c.index], d, epsilon, ulps))
            row["faults_in_flight"] = []
            checked[key] = row
        row = checked[key]
        row["count"] += 1
        during = faults_during(c, windows)
        lane_fault = any(f.split(":")[0] in LANE_FAULTS for f in during)
        row["faults_in_flight"] = sorted(set(row["faults_in_flight"]) | set(during))
        bucket = f"{row['class']}_{'through_lane_fault' if lane_fault else 'no_lane_fault'}"
        counts[bucket] = counts.get(bucket, 0) + 1
    numerical = sum(v for k, v in counts.items() if k.startswith("numerical"))
    wrong = sum(v for k, v in counts.items() if k.startswith("wrong"))
    return {
        "ok": len(completions),
        "differ": numerical + wrong,
        "numerical": numerical,
        "wrong": wrong,
        "by_class_and_fault": counts,
        "outputs": sorted(checked.values(), key=lambda r: (r["class"] != "wrong", r["request"]))[:60],
    }


def check_reference(
    rescorer: Rescorer, prompts, samplings, reference: list[list[int]], epsilon: float, ulps: float
) -> dict:
    """The reference itself against the float32 batch-1 choice (it is a served output too)."""
    rows = [check_output(rescorer, p, r, s, 0, epsilon, ulps) for p, s, r in zip(prompts, samplings, reference)]
    return {
        "outputs": len(rows),
        "tokens": sum(len(r) for r in reference),
        "wrong": sum(r["class"] == "wrong" for r in rows),
        "not_the_float32_choice": sum(r["not_the_float32_choice"] for r in rows),  # tokens
        "near_ties": sum(r["near_ties"] for r in rows),  # top-2 margin within the tolerance
    }

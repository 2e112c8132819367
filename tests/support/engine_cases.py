"""Cases shared by test modules of several rooms, each first written for one room's tests: random
EAGLE heads on disk (model), prompts that quote themselves (spec_decode), the seeded crowd and its
driver (model), the schedules' request set, lane recorder and driver (router), and the statistics of
sampled tokens (model)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import torch
from engine_helpers import VOCAB
from scipy import stats

from verifypd.domain.lanes import LaneError
from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.model.eagle_head import random_eagle_head, save_eagle_head
from verifypd.model.loader import load_model

CPU = torch.device("cpu")


def write_head(tiny_models, path, *, draft_vocab=None, with_lm_head=True, seed=3, std=0.3):
    target = load_model(tiny_models[0], CPU, torch.float32)
    config, weights = random_eagle_head(target.shape, seed=seed, draft_vocab=draft_vocab, std=std)
    save_eagle_head(path, config, weights, with_lm_head=with_lm_head)
    return f"eagle:{path}"


def repeating_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that quote themselves (as rewrites and extractions do), so lookup finds matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, 90) for _ in range(rng.randrange(8, 14))]
        out.append(base + [rng.randrange(3, 90) for _ in range(3)] + base[:6] + base)
    return out


def crowd(n: int = 8, seed: int = 1) -> list[RequestSpec]:
    """Other requests: greedy and sampled, other seeds, lengths and speculation overrides."""
    rng = random.Random(seed)
    return [
        RequestSpec(
            tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))),
            max_tokens=rng.randrange(5, 40),
            stop_at_eos=False,
            request_id=f"c{i}",
            max_k=rng.choice([None, None, 0, 2]),
            sampling=SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0]), seed=rng.randrange(99)),
        )
        for i in range(n)
    ]


def run(engine, specs) -> tuple[dict[str, list[int]], dict[str, dict]]:
    """Drives the router to the end: tokens and final stats by request id."""
    router, tokens, stats = engine.router, {}, {}
    for spec in specs:
        router.add_request(spec)
    while router.has_work():
        for out in router.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            stats[out.request_id] = out.stats
    assert router.target_blocks.num_used == 0
    return tokens, stats


SCHEDULES = [("baseline", True), ("pd", True), ("pdv", True), ("pdv", False)]


def prompts(n: int = 7, seed: int = 3) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 24))) for _ in range(n)]


def specs(sampling: bool = False) -> list[RequestSpec]:
    out = []
    for i, p in enumerate(prompts()):
        s = SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i) if sampling else SamplingParams()
        out.append(
            RequestSpec(
                p,
                max_tokens=[20, 7, 15, 26, 3, 18, 11][i],
                stop_at_eos=False,
                request_id=f"r{i}",
                max_k=[None, None, 2, None, None, 0, None][i],
                sampling=s,
            )
        )
    return out


class Recorder:
    """Wraps a router's lanes: every call as (step, lane, [(request_id, k)], thread, start, end)."""

    def __init__(self, router):
        self.step = 0
        self.calls: list[tuple] = []
        self.plans: dict[int, bool] = {}
        for lane, method in (("prefill", "prefill"), ("draft", "draft"), ("verify", "verify")):
            obj = getattr(router, f"{lane}_lane")
            setattr(router, f"{lane}_lane", _Proxy(obj, method, lane, self))
        plan = router.scheduler.plan

        def recording_plan(config, costs):
            result = plan(config, costs)
            self.plans[self.step] = result.pipelined
            return result

        router.scheduler.plan = recording_plan

    def of(self, lane: str, step: int) -> list[tuple[str, int]]:
        return [x for c in self.calls if c[0] == step and c[1] == lane for x in c[2]]


class _Proxy:
    def __init__(self, lane, method, name, rec):
        self._lane, self._method, self._name, self._rec = lane, method, name, rec
        self.fail_at: int | None = None  # raise LaneError on this step

    def describe(self):
        return self._lane.describe()

    def __getattr__(self, attr):
        if attr != self._method:
            return getattr(self._lane, attr)

        def call(items):
            step, t0 = self._rec.step, time.monotonic()
            if self.fail_at == step:
                raise LaneError(f"{self._name} lane down")
            out = getattr(self._lane, attr)(items)
            ks = [
                getattr(i, "k", None)
                if self._name == "draft"
                else len(i.draft_tokens)
                if self._name == "verify"
                else None
                for i in items
            ]
            self._rec.calls.append(
                (
                    step,
                    self._name,
                    [(i.request_id, k) for i, k in zip(items, ks)],
                    threading.get_ident(),
                    t0,
                    time.monotonic(),
                )
            )
            return out

        return call


def drive(engine, all_specs, schedule: str, pipeline: bool = True, cancel: str | None = None):
    """Requests join two per step; `cancel` is aborted mid-way (e.g. while holding pdv drafts)."""
    router = engine.router
    router.config = router.config.updated(schedule=schedule, pipeline=pipeline)
    rec = Recorder(router)
    tokens: dict[str, list[int]] = {}
    pending = list(all_specs)
    while pending or router.has_work():
        for _ in range(2):
            if pending:
                spec = pending.pop(0)
                tokens[router.add_request(spec)] = []
        rec.step += 1
        for out in router.step():
            tokens[out.request_id] += out.token_ids
        if cancel and rec.step == 9 and cancel in {s.request_id for s in router.sequences()}:
            router.abort(cancel)
    assert router.target_blocks.num_used == 0 and (router.draft_blocks is None or router.draft_blocks.num_used == 0)
    router.close()
    return tokens, rec


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square of observed counts against probs, pooling cells with small expectation."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


def sample_second_tokens(
    engine, prompt, temperature: float, n: int, max_tokens: int, seed0: int, vocab: int
) -> np.ndarray:
    """Counts of the 2nd output token (the first a verify step produces) over n seeded requests;
    checks the run saw both accepted and rejected drafts."""
    specs = [
        RequestSpec(
            prompt,
            max_tokens=max_tokens,
            stop_at_eos=False,
            request_id=f"s{i}",
            sampling=SamplingParams(temperature=temperature, seed=seed0 + i),
        )
        for i in range(n)
    ]
    done = engine.generate(specs)
    drafted = sum(c.usage["draft_tokens"] for c in done.values())
    accepted = sum(c.usage["accepted_tokens"] for c in done.values())
    assert 0 < accepted < drafted
    return np.bincount([c.token_ids[1] for c in done.values()], minlength=vocab)


def _second_token_marginal(model, prompt, temperature) -> np.ndarray:
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([list(prompt)])).logits[0, -1].double() / temperature, -1)
        vocab = p1.numel()
        batch = torch.tensor([list(prompt) + [t] for t in range(vocab)])
        p2 = torch.softmax(model(batch).logits[:, -1].double() / temperature, -1)  # [V(t1), V(t2)]
    return (p1[:, None] * p2).sum(0).numpy()

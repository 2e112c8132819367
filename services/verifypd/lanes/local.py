"""In-process lanes over ModelRunners: the co-located transport (zero copy: draft probabilities
stay on the device and pass to the verify lane by reference). The only lane code touching torch.

Host syncs: one `.tolist()` per lane call (to hand tokens back to the router); draft steps feed
the previous step's tokens to the next forward on the device.
"""
from __future__ import annotations

import torch

from verifypd.engine.types import SamplingParams
from verifypd.lanes.interface import (DraftItem, DraftOutput, LaneInfo, PrefillItem, PrefillOutput,
                                      VerifyItem, VerifyOutput)
from verifypd.model import sampler
from verifypd.model.runner import ModelRunner, TokenRun


def _params(samplings: list[SamplingParams], device) -> tuple[torch.Tensor, ...]:
    temp = torch.tensor([s.temperature for s in samplings], dtype=torch.float32, device=device)
    top_k = torch.tensor([s.top_k for s in samplings], dtype=torch.long, device=device)
    top_p = torch.tensor([s.top_p for s in samplings], dtype=torch.float32, device=device)
    seeds = sampler.seed_tensor([s.seed for s in samplings], device)
    return temp, top_k, top_p, seeds


def _choose(logits: torch.Tensor, samplings: list[SamplingParams], positions: list[int], stream: int):
    """Picks one token per row; returns (tokens [N], probs [N, V] or None if all greedy)."""
    if all(s.greedy for s in samplings):
        return logits.argmax(-1), None
    temp, top_k, top_p, seeds = _params(samplings, logits.device)
    probs = sampler.probabilities(logits, temp, top_k, top_p)
    pos = torch.tensor(positions, dtype=torch.long, device=logits.device)
    return sampler.sample(probs, sampler.uniforms(seeds, pos, stream)), probs


class LocalPrefillLane:
    def __init__(self, target: ModelRunner, draft: ModelRunner, info: LaneInfo):
        self.target, self.draft, self.info = target, draft, info

    def describe(self) -> LaneInfo:
        return self.info

    def prefill(self, items: list[PrefillItem]) -> list[PrefillOutput]:
        target_runs = [TokenRun(i.token_ids, i.start_pos, i.target_kv.block_ids) for i in items]
        draft_runs = [TokenRun(i.token_ids, i.start_pos, i.draft_kv.block_ids) for i in items]
        logits = self.target.forward(target_runs, "last")
        self.draft.forward(draft_runs, None)
        rows = [n for n, i in enumerate(items) if i.sample_first]
        first: dict[int, int] = {}
        if rows:
            chosen = [items[n] for n in rows]
            positions = [i.start_pos + len(i.token_ids) for i in chosen]
            tokens, _ = _choose(logits[rows], [i.sampling for i in chosen], positions, sampler.STREAM_TARGET)
            first = dict(zip(rows, tokens.tolist()))
        return [PrefillOutput(i.request_id, first.get(n)) for n, i in enumerate(items)]


class LocalDraftLane:
    def __init__(self, draft: ModelRunner, info: LaneInfo):
        self.runner, self.info = draft, info

    def describe(self) -> LaneInfo:
        return self.info

    def draft(self, items: list[DraftItem]) -> list[DraftOutput]:
        if any(i.k < 1 for i in items):
            raise ValueError("draft items need k >= 1")
        samplings = [i.sampling for i in items]
        # Position of the first draft token of each item (right after its pending token).
        next_pos = [i.start_pos + len(i.input_tokens) for i in items]
        runs = [TokenRun(i.input_tokens, i.start_pos, i.draft_kv.block_ids) for i in items]
        logits = self.runner.forward(runs, "last")
        tokens, probs = _choose(logits, samplings, next_pos, sampler.STREAM_DRAFT)
        # Per step: tokens for every item ([N], stale where inactive) and probs of active rows.
        steps = [(tokens, probs, list(range(len(items))))]
        for step in range(1, max(i.k for i in items)):
            active = [n for n in range(len(items)) if items[n].k > step]
            idx = torch.tensor(active, device=tokens.device)
            runs = [TokenRun([0], next_pos[n] + step - 1, items[n].draft_kv.block_ids) for n in active]
            batch = self.runner.layout(runs)
            batch.input_ids = tokens[idx]  # previous step's drafts, never leaving the device
            logits = self.runner.model.forward(self.runner.pool.tensor, batch, torch.arange(len(active), device=idx.device))
            new, probs = _choose(logits, [samplings[n] for n in active],
                                 [next_pos[n] + step for n in active], sampler.STREAM_DRAFT)
            tokens = tokens.clone()
            tokens[idx] = new
            steps.append((tokens, probs, active))
        host = [t.tolist() for t, _, _ in steps]  # the one host sync of this call
        outputs = []
        for n, item in enumerate(items):
            toks = [host[s][n] for s in range(item.k)]
            probs = None
            if not item.sampling.greedy:
                probs = torch.stack([p[act.index(n)] for _, p, act in steps[:item.k]])
            outputs.append(DraftOutput(item.request_id, toks, probs))
        return outputs


class LocalVerifyLane:
    def __init__(self, target: ModelRunner, info: LaneInfo):
        self.target, self.info = target, info

    def describe(self) -> LaneInfo:
        return self.info

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        runs = [TokenRun([i.pending_token] + i.draft_tokens, i.start_pos, i.target_kv.block_ids) for i in items]
        logits = self.target.forward(runs, "all")                        # [T, V]
        device, R = logits.device, len(items)
        K = max(len(i.draft_tokens) for i in items)
        # Row index [R, K+1] into the flat logits; padding repeats the run's last row.
        starts, index = 0, []
        for run in runs:
            n = len(run.token_ids)
            index.append([starts + min(j, n - 1) for j in range(K + 1)])
            starts += n
        index_t = torch.tensor(index, device=device)
        drafts = torch.tensor([i.draft_tokens + [0] * (K - len(i.draft_tokens)) for i in items],
                              dtype=torch.long, device=device).view(R, K)
        k = torch.tensor([len(i.draft_tokens) for i in items], device=device)
        if all(i.sampling.greedy for i in items):
            accepted, final = sampler.accept_greedy(logits.argmax(-1)[index_t], drafts, k)
        else:
            accepted, final = self._accept_sampled(items, logits, index_t, drafts, k)
        acc, fin = accepted.tolist(), final.tolist()
        return [VerifyOutput(i.request_id, a, i.draft_tokens[:a] + [f]) for i, a, f in zip(items, acc, fin)]

    def _accept_sampled(self, items, logits, index_t, drafts, k):
        R, K1 = index_t.shape
        samplings = [i.sampling for i in items]
        temp, top_k, top_p, seeds = _params(samplings, logits.device)
        rows = logits[index_t.flatten()]
        p = sampler.probabilities(rows, temp.repeat_interleave(K1), top_k.repeat_interleave(K1),
                                  top_p.repeat_interleave(K1)).view(R, K1, -1)
        V = p.shape[-1]
        q = torch.zeros(R, K1 - 1, V, device=logits.device)
        for n, item in enumerate(items):
            kn = len(item.draft_tokens)
            if kn == 0:
                continue
            if item.draft_probs is not None:
                q[n, :kn] = item.draft_probs.to(q.device, torch.float32)
            else:  # greedy draft: q is the one-hot of the proposed tokens
                q[n, torch.arange(kn), drafts[n, :kn]] = 1.0
        start = torch.tensor([i.start_pos for i in items], dtype=torch.long, device=logits.device)
        return sampler.accept_sampled(p, q, drafts, k, seeds, start)

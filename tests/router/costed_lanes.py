"""Lanes that do no model work but cost simulated time, for the draft-length policy's tests. Torch-free.

One object serves as prefill, draft and verify lane. Each call advances a simulated clock (the
router's `clock`) by a cost from the given functions; verify keeps each draft token with a seeded
Bernoulli(alpha) (SIMULATED acceptance, as `bench/engine/engine_throughput.py` on the GPU). So a router run
yields simulated tok/s that can be compared with plain decoding under the same cost tables.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.lanes import DraftOutput, LaneInfo, PoolInfo, PrefillOutput, VerifyOutput
from verifypd.domain.requests import RequestSpec
from verifypd.router.router import Router

VOCAB, BLOCK = 1000, 16
GRAPH_QUERY = 9  # the GPU's captured draft/verify query length (model/graph_runner.py max_query)


def h200_like_verify_s(batch: int, k: int) -> float:
    """Target step (7B shape): memory-bound at small batches, scoring k + 1 tokens grows with batch."""
    base = 5e-3 if batch <= 1 else 6e-3 if batch <= 16 else 9e-3
    per_token = 0.02 if batch <= 1 else 0.04 if batch <= 16 else 0.08
    return base * (1 + per_token * k)


def h200_like_draft_s(batch: int, k: int, input_len: int) -> float:
    """Draft call (1.1B shape): 1.4 ms for k = 1 at batch 1, about 1 ms a further step; a call whose
    input exceeds the captured query runs eagerly and pays a prefill of all its tokens."""
    first = 1.4e-3 if batch <= 1 else 1.8e-3 if batch <= 16 else 2.5e-3
    step = 1.0e-3 if batch <= 16 else 1.5e-3
    eager = 0.0 if input_len <= GRAPH_QUERY else 12e-3 + 2e-6 * batch * input_len
    return first + (k - 1) * step + eager


def ngram_like_draft_s(batch: int, k: int, input_len: int) -> float:
    """Prompt lookup: host work only."""
    return 20e-6 * batch


@dataclass
class DraftCall:
    batch: int
    k: int  # the largest k asked
    input_len: int  # the longest draft input (tokens the draft catches up on + the pending one)


@dataclass
class CostedLanes:
    alpha: float
    verify_s: Callable[[int, int], float] = h200_like_verify_s
    draft_s: Callable[[int, int, int], float] = h200_like_draft_s
    pooled: bool = True  # False: a pool-less draft lane (prompt lookup), no draft KV to catch up
    propose_rate: float = 1.0  # how often a request gets proposals (prompt lookup: when an n-gram matches)
    num_blocks: int = 8192
    seed: int = 0
    now: float = 0.0
    draft_calls: list[DraftCall] = field(default_factory=list)
    verify_steps: int = 0

    def __post_init__(self):
        self.rng = random.Random(self.seed)

    def clock(self) -> float:
        return self.now

    def describe(self) -> LaneInfo:
        pools = [PoolInfo("t", 1, "target", 1, self.num_blocks, BLOCK)]
        if self.pooled:
            pools.append(PoolInfo("d", 1, "draft", 1, self.num_blocks, BLOCK))
        return LaneInfo("all", tuple(pools), VOCAB, 1 << 14)

    def prefill(self, items):
        self.now += 1e-3 * len(items)
        return [PrefillOutput(i.request_id, 7 if i.sample_first else None) for i in items]

    def draft(self, items):
        call = DraftCall(len(items), max(i.k for i in items), max(len(i.input_tokens) for i in items))
        self.draft_calls.append(call)
        self.now += self.draft_s(call.batch, call.k, call.input_len)
        return [
            DraftOutput(
                i.request_id, [11] * i.k if self.propose_rate >= 1 or self.rng.random() < self.propose_rate else []
            )
            for i in items
        ]

    def verify(self, items):
        k = max(len(i.draft_tokens) for i in items)
        self.now += self.verify_s(len(items), k)
        self.verify_steps += 1
        out = []
        for i in items:
            m = 0
            while m < len(i.draft_tokens) and self.rng.random() < self.alpha:
                m += 1
            out.append(VerifyOutput(i.request_id, m, [11] * m + [13]))
        return out


def run_rounds(lanes: CostedLanes, config: RuntimeConfig, batch: int, gen_lens: list[int]) -> tuple[Router, float, int]:
    """Rounds of `batch` requests started together (as bench/engine/engine_throughput.py runs them), one
    round per entry of gen_lens, on one router. Returns (router, simulated seconds of the last
    round, tokens of the last round)."""
    router = Router(
        lanes, lanes, lanes, decode=None, eos_token_ids=(), config=config, clock=lanes.clock, max_running=max(batch, 1)
    )
    seconds = tokens = 0
    for r, gen_len in enumerate(gen_lens):
        for i in range(batch):
            router.add_request(
                RequestSpec(tuple(range(3, 3 + 128)), max_tokens=gen_len, stop_at_eos=False, request_id=f"r{r}-{i}")
            )
        t0, tokens = lanes.now, 0
        while router.has_work():
            tokens += sum(len(out.token_ids) for out in router.step())
        seconds = lanes.now - t0
    return router, seconds, tokens


def speedup_over_plain(
    alpha: float, batch: int, gen_lens: list[int], pipeline: bool = False, **lane_args
) -> tuple[float, CostedLanes, Router]:
    """Simulated tok/s of adaptive k (the engine's defaults; `pipeline`: pdv pipelined where it
    pays) over k = 0, last round of each."""
    plain = CostedLanes(alpha, **lane_args)
    _, plain_s, plain_tokens = run_rounds(plain, RuntimeConfig(k_initial=0, adaptive=False), batch, gen_lens)
    lanes = CostedLanes(alpha, **lane_args)
    router, seconds, tokens = run_rounds(
        lanes, RuntimeConfig(k_min=0, k_max=8, k_initial=4, adaptive=True, pipeline=pipeline), batch, gen_lens
    )
    router.close()  # the pdv draft thread, if one started (the router stays usable)
    assert tokens == plain_tokens
    return (tokens / seconds) / (plain_tokens / plain_s), lanes, router

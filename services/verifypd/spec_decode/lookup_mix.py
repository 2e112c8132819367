"""A feature draft mixed with prompt lookup (`--draft eagle+ngram:PATH`). Torch-free.

Before a step's draft call the router looks each drafting request up in its own context (prompt
and output so far): where the last LOOKUP_MIN_MATCH or more tokens occurred before, that step takes
prompt lookup's proposal (the tokens that followed the most recent earlier occurrence) instead of the
head's, and the head is not called for the request at all. Copying spans (rewrites, extraction,
edits) is what lookup is right about and the head is not: on the embedded model's 96 held-out prompts
(CPU counterfactual walk at k = 4, bench/results/hybrid_draft_s30/) the previous head read 2.44 tokens
per verify step, lookup 1.72, and this mix 2.65 (extract 3.02 -> 3.57, rewrite 2.46 -> 3.08).

Per request, lookup earns its place (`LookupGate`): each of its proposals is scored against the
tokens the target then verified, whether the step took it or the head's; the head is scored by what
it got accepted. Lookup's proposal is taken while its recent score is at least the head's. On chat,
short repeats ("of the") match often and continue rarely: at batch 16 on the H200 the mix that
took every match drafted far more tokens per step than the head alone and ran at 0.95 x plain
decoding where the head alone ran at 1.11 x. Scoring a proposal not taken costs nothing (the
verified tokens are on the host) and lets lookup back in where a request starts copying.

A step need not consult lookup at all: a verify call launched before the verdict of the call before
it (steps.speculate_ahead.fit_next) can't wait for lookup's proposals, which need that verdict's
tokens. While lookup's proposals are rarely taken (under QUIET_RATE of the request-steps it was
asked about, a moving average), all but one step in CONSULT_EVERY may go without it (`may_skip`):
its proposals are seldom worth the host time that launching ahead hides, and the steps that do
consult it keep its rate and gates current.

A request the head skipped catches up in its next head call: the router leaves its draft_computed
where the head's rows are still valid, and the head re-reads the target's features of every position
it was not fed (the long-catch-up path of model.eagle_draft). A step whose every drafting request
takes lookup makes no draft call.

Lossless as every draft is: the verify lane keeps a proposal only where it equals the target's own
(seeded) choice; lookup's proposals have no draft probabilities, as with `--draft ngram`.

Lock-step steps only: with pdv pipelining (`RuntimeConfig.pipeline`, off by default in process), the
drafts made a step ahead beside the other group's verify are the head's alone.

The index (each request's n-grams for n in [min, max]) is a cache over Sequence tokens, bounded like
the ngram lane's: the least recently drafted requests are dropped first and rebuilt from their
tokens if they draft again.
"""

from __future__ import annotations

from collections.abc import Sequence

from verifypd.domain.lookup import LookupWork
from verifypd.spec_decode.ngram import DEFAULT_CAPACITY_TOKENS, HistoryCache, TokenHistory

# The shortest repeated suffix trusted over the head. The walk above: 2 -> 2.63, 3 -> 2.65, 4 -> 2.64,
# 6 -> 2.61; longest match looked for 4 (8 changes it by < 0.005).
LOOKUP_MIN_MATCH = 3
LOOKUP_MAX_MATCH = 4
GATE_WEIGHT = 0.3  # the newest step's share of a source's score (an exponential moving average)
QUIET_RATE = 0.05  # lookup's proposals taken on fewer of the request-steps it saw: steps may skip it
RATE_WEIGHT = 0.1  # the newest consulted step's share of that rate
CONSULT_EVERY = 8  # while quiet, one step in this many still consults lookup


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class LookupGate:
    """One request's scores: tokens per step that lookup's proposals would get (or got) accepted, and
    that the head's got accepted (moving averages; None until a first step). `pending`: lookup's
    proposal of the step in flight, scored at `settle`."""

    __slots__ = ("lookup", "head", "pending")

    def __init__(self) -> None:
        self.lookup: float | None = None
        self.head: float | None = None
        self.pending: list[int] | None = None

    def trusts_lookup(self) -> bool:
        """A first match is trusted (copying is what a match usually means); then lookup's score must
        reach the head's, or one token a step while the head has no score."""
        if self.lookup is None:
            return True
        return self.lookup >= (self.head if self.head is not None else 1.0)

    def settle(self, took_lookup: bool, k: int, accepted: int, verified: Sequence[int]) -> None:
        proposal, self.pending = self.pending, None
        if took_lookup:
            self.lookup = _average(self.lookup, accepted)
            return
        if k > 0:
            self.head = _average(self.head, accepted)
        if proposal:
            # Only the verified tokens are known (accepted + 1): a proposal matching all of them
            # scores one more than the head's, which is its least.
            self.lookup = _average(self.lookup, _common_prefix(proposal[: max(k, 1)], verified))


def _average(score: float | None, value: int) -> float:
    return float(value) if score is None else score + GATE_WEIGHT * (value - score)


class LookupMix:
    def __init__(
        self,
        min_match: int = LOOKUP_MIN_MATCH,
        max_match: int = LOOKUP_MAX_MATCH,
        capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
    ):
        self.min_match, self.max_match = min_match, max_match
        self._histories = HistoryCache(capacity_tokens)
        self._gates: dict[str, LookupGate] = {}  # every request lookup was asked about, until forgotten
        self.proposed = 0  # steps of a request that took lookup's proposal (telemetry, tests)
        self.passed = 0  # steps of a request whose proposal lookup's gate left to the head (tests)
        self.rate = 1.0  # share of consulted request-steps that took lookup's proposal (moving average)
        self._skipped = 0  # steps in a row that went without consulting lookup (`may_skip`)

    def take(self, work: Sequence[LookupWork]) -> dict[str, list[int]]:
        """Lookup's proposals (k tokens) for the requests of `work` whose context repeats its last
        min_match or more tokens and whose gate trusts lookup, by request id; the others draft with
        the head. Every proposal waits for `settle` to be scored."""
        proposals = {}
        for w in work:
            seq, rid = w.seq, w.seq.request_id
            history = self._histories.take(rid)
            if history is None:  # (not `or`: an empty history is falsy, it has a length)
                history = TokenHistory(self.min_match, self.max_match)
            history.extend(seq.ids(len(history), seq.num_tokens))  # through the pending token
            self._histories.put(rid, history)
            gate = self._gates.get(rid)
            if gate is None:
                gate = self._gates[rid] = LookupGate()
            proposal = history.propose(w.k)
            gate.pending = proposal or None
            if proposal and gate.trusts_lookup():
                proposals[rid] = proposal
            elif proposal:
                self.passed += 1
        self.proposed += len(proposals)
        if work:
            self.rate += RATE_WEIGHT * (len(proposals) / len(work) - self.rate)
        self._skipped = 0
        return proposals

    def may_skip(self) -> bool:
        """May the next step go without consulting lookup? (Counted as skipped when yes.)"""
        if self.rate >= QUIET_RATE or self._skipped >= CONSULT_EVERY - 1:
            return False
        self._skipped += 1
        return True

    def settle(self, request_id: str, took_lookup: bool, k: int, accepted: int, verified: Sequence[int]) -> None:
        gate = self._gates.get(request_id)
        if gate is not None:
            gate.settle(took_lookup, k, accepted, verified)

    def forget(self, request_id: str) -> None:
        self._histories.take(request_id)
        self._gates.pop(request_id, None)

"""A feature draft mixed with prompt lookup (`--draft eagle+ngram:PATH`). Torch-free.

Before a step's draft call the router looks each drafting request up in its own context (prompt
and output so far): where the last LOOKUP_MIN_MATCH or more tokens occurred before, that step takes
prompt lookup's proposal (the tokens that followed the most recent earlier occurrence) instead of the
head's, and the head is not called for the request at all. Copying spans (rewrites, extraction,
edits) is what lookup is right about and the head is not: on the embedded model's 96 held-out prompts
(CPU counterfactual walk at k = 4, bench/results/hybrid_draft_s30/) the previous head read 2.44 tokens
per verify step, lookup 1.72, and this mix 2.65 (extract 3.02 -> 3.57, rewrite 2.46 -> 3.08).

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


class LookupMix:
    def __init__(
        self,
        min_match: int = LOOKUP_MIN_MATCH,
        max_match: int = LOOKUP_MAX_MATCH,
        capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
    ):
        self.min_match, self.max_match = min_match, max_match
        self._histories = HistoryCache(capacity_tokens)
        self.proposed = 0  # steps of a request that took lookup's proposal (telemetry, tests)

    def take(self, work: Sequence[LookupWork]) -> dict[str, list[int]]:
        """Lookup's proposals (k tokens) for the requests of `work` whose context repeats its last
        min_match or more tokens, by request id; the others draft with the head."""
        proposals = {}
        for w in work:
            seq, rid = w.seq, w.seq.request_id
            history = self._histories.take(rid)
            if history is None:  # (not `or`: an empty history is falsy, it has a length)
                history = TokenHistory(self.min_match, self.max_match)
            history.extend(seq.ids(len(history), seq.num_tokens))  # through the pending token
            self._histories.put(rid, history)
            proposal = history.propose(w.k)
            if proposal:
                proposals[rid] = proposal
        self.proposed += len(proposals)
        return proposals

    def forget(self, request_id: str) -> None:
        self._histories.take(request_id)

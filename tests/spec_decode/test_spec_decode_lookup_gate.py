"""The mix's per-request gate (spec_decode.lookup_mix.LookupGate): lookup's proposal is taken while
its score (tokens per step it got, or would have got, accepted) reaches the head's; a proposal left to
the head is still scored against the verified tokens, so lookup comes back where a request copies."""

from __future__ import annotations

import pytest

from verifypd.domain.requests import RequestSpec, RequestStats
from verifypd.router.sequence import Sequence
from verifypd.router.step_plan import DecodeWork
from verifypd.spec_decode.lookup_mix import CONSULT_EVERY, QUIET_RATE, LookupGate, LookupMix


def _work(tokens: list[int], k: int = 3, rid: str = "r") -> DecodeWork:
    seq = Sequence(RequestSpec(tokens[:2], max_tokens=100, request_id=rid), rid, 0, RequestStats())
    seq.output_ids = list(tokens[2:])
    return DecodeWork(seq, k)


def test_a_failing_lookup_gives_way_to_the_head_and_comes_back_when_it_would_match():
    mix = LookupMix()
    w = _work([5, 6, 7, 8, 5, 6, 7])  # repeats [5, 6, 7]: lookup proposes [8, 5, 6]
    assert mix.take([w]) == {"r": [8, 5, 6]}  # a first match is trusted
    mix.settle("r", True, 3, 0, [9])  # the target said 9: nothing accepted
    w.seq.output_ids.append(9)
    # Next step the head drafts (no repeat: nothing to gate) and gets 2 of 3 accepted.
    assert mix.take([w]) == {}
    mix.settle("r", False, 3, 2, [1, 2, 3])
    w.seq.output_ids += [1, 2, 3, 5, 6, 7]  # [5, 6, 7] again: lookup proposes [9, 1, 2]
    assert mix.take([w]) == {} and mix.passed == 1  # 0 against the head's 2: the head's step
    # The verified tokens show lookup's proposal was right throughout: it scores 3 (all it could be
    # checked on), the head 1 for this step, and lookup's proposal is taken again.
    mix.settle("r", False, 3, 2, [9, 1, 2])
    w.seq.output_ids += [9, 1, 2, 3, 5, 6, 7]
    gate = mix._gates["r"]
    assert gate.lookup is not None and gate.head is not None and gate.lookup < gate.head
    for _ in range(3):  # lookup keeps matching what the head gets accepted, and one more
        assert mix.take([w]) == {}
        mix.settle("r", False, 3, 1, [9, 1])
    assert gate.trusts_lookup()
    assert mix.take([w]) == {"r": [9, 1, 2]}


def test_the_gate_compares_scores_and_trusts_a_first_match():
    gate = LookupGate()
    assert gate.trusts_lookup()
    gate.pending = [1, 2, 3, 4]
    gate.settle(False, 4, 0, [1])  # the head's 0 accepted; lookup would have matched the 1 token known
    assert gate.lookup == 1.0 and gate.head == 0.0 and gate.trusts_lookup() and gate.pending is None
    gate.settle(True, 4, 0, [7])  # taken and nothing accepted
    assert gate.lookup == pytest.approx(0.7) and gate.trusts_lookup()  # still above the head's 0
    gate.settle(False, 4, 3, [1, 2, 3, 4])  # the head's step, no lookup proposal to score
    assert gate.head == pytest.approx(0.9) and not gate.trusts_lookup()
    lone = LookupGate()
    lone.settle(True, 4, 0, [7])  # no head score yet: lookup must reach one token a step
    assert not lone.trusts_lookup()


def test_steps_skip_lookup_only_while_it_is_quiet_and_one_in_consult_every_consults_it():
    mix = LookupMix()
    assert not mix.may_skip()  # a fresh mix is loud: every step consults it
    quiet = _work([1, 2, 3, 4, 5, 6])  # nothing repeats: no proposal taken
    while mix.rate >= QUIET_RATE:
        mix.take([quiet])
    skips = [mix.may_skip() for _ in range(CONSULT_EVERY)]
    assert skips == [True] * (CONSULT_EVERY - 1) + [False]
    mix.take([quiet])  # the consulted step starts the count again
    assert mix.may_skip()
    copying = _work([5, 6, 7, 8, 5, 6, 7], rid="c")
    for _ in range(3):  # proposals taken again: loud within a few consulted steps
        mix.take([copying])
    assert mix.rate >= QUIET_RATE and not mix.may_skip()

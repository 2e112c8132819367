"""`--workload multi-turn` (verifypd_loadgen.multi_turn): each turn resends the conversation so far."""

from __future__ import annotations

import itertools

import pytest

from verifypd_loadgen.multi_turn import MultiTurnWorkload
from verifypd_loadgen.run_args import run_parser
from verifypd_loadgen.run_plan import build_plan
from verifypd_loadgen.workload import Distribution


def test_turns_resend_the_conversation_round_robin():
    w = MultiTurnWorkload(
        input_len=Distribution("uniform", (3, 9)),
        output_len=Distribution("uniform", (2, 6)),
        vocab_range=(100, 200),
        turns=3,
        conversations=2,
        seed=7,
    )
    reqs = list(itertools.islice(w.requests(), 2 * 3 * 2))  # two sets of 2 conversations x 3 turns
    for start in (0, 6):
        batch = reqs[start : start + 6]
        for c in range(2):
            turns = batch[c::2]  # round-robin: turn 1 of each conversation, then turn 2, ...
            assert 3 <= len(turns[0].prompt.token_ids) <= 9
            for prev, cur in itertools.pairwise(turns):
                before, after = prev.prompt.token_ids, cur.prompt.token_ids
                assert after[: len(before)] == before  # the whole conversation so far is resent
                new = len(after) - len(before) - prev.max_tokens  # then the reply, then a new message
                assert 3 <= new <= 9
                assert all(100 <= t < 200 for t in after) and cur.stop_at_eos is False
    # conversations are independent, and the next set starts afresh
    assert reqs[0].prompt.token_ids[:3] != reqs[1].prompt.token_ids[:3]
    assert len(reqs[6].prompt.token_ids) <= 9
    # seeded: the same stream twice
    again = list(itertools.islice(w.requests(), 12))
    assert [r.prompt.token_ids for r in again] == [r.prompt.token_ids for r in reqs]


def test_cli_builds_it_and_refuses_a_dataset(tmp_path):
    parser = run_parser()
    args = parser.parse_args(["--server", "h:1", "--workload", "multi-turn", "--turns", "5", "--conversations", "3"])
    plan, config = build_plan(args, parser, [])
    assert isinstance(plan.workload, MultiTurnWorkload)
    assert (plan.workload.turns, plan.workload.conversations) == (5, 3)
    assert config["dataset"] == "synthetic multi-turn (turns=5, conversations=3)"
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "hi"}\n')
    args = parser.parse_args(["--server", "h:1", "--workload", "multi-turn", "--dataset", str(data)])
    with pytest.raises(SystemExit):
        build_plan(args, parser, [])

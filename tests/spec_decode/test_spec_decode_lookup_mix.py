"""`--draft eagle+ngram:PATH` (engine.lookup_mix): the head mixed with prompt lookup. Lossless greedy and
seeded; lookup's proposals are taken where the context repeats, and a request the head skipped is caught
up from where the head left it; the verify lane writes host-list drafts beside the head's device rows."""

from __future__ import annotations

import pytest
import torch
from engine_cases import repeating_prompts, write_head
from engine_helpers import make_engine

from verifypd.domain.lanes import KvHandle, VerifyItem
from verifypd.domain.requests import RequestSpec, RequestStats, SamplingParams
from verifypd.lanes.device_values import DeviceDraftTokens, DraftBatch
from verifypd.router.sequence import Sequence
from verifypd.router.step_plan import DecodeWork
from verifypd.spec_decode.lookup_mix import LookupMix

pytestmark = pytest.mark.slow  # seeded decoding with a head and prompt lookup in every schedule (tests/README.md)


@pytest.fixture(scope="module")
def mixed(tiny_models, tmp_path_factory):
    return "eagle+ngram:" + write_head(tiny_models, tmp_path_factory.mktemp("mix") / "head").removeprefix("eagle:")


def _head_calls(engine) -> list:
    """Wraps the draft lane: every item the head is asked to draft, as (item, made after a verify call?)
    (engine.draft_after: its input ends in the verify call's k + 1 tokens, fitted on the device)."""
    calls, lane = [], engine.draft_lane
    draft, after = lane.draft, lane.draft_after

    def counting(items):
        calls.extend((i, False) for i in items)
        return draft(items)

    def counting_after(items, *args):
        calls.extend((i, True) for i in items)
        return after(items, *args)

    lane.draft, lane.draft_after = counting, counting_after
    return calls


@pytest.mark.parametrize("k, adaptive", [(1, False), (4, False), (3, True)])
def test_greedy_with_head_and_lookup_equals_plain(tiny_models, mixed, k, adaptive):
    prompts = repeating_prompts(6, seed=k)
    specs = lambda: [RequestSpec(p, max_tokens=24, stop_at_eos=False) for p in prompts]  # noqa: E731
    plain = make_engine(tiny_models[0], "none", k=0).generate(specs())
    engine = make_engine(tiny_models[0], mixed, k=k, adaptive=adaptive)
    calls = _head_calls(engine)
    done = engine.generate(specs())
    assert [c.token_ids for c in done.values()] == [c.token_ids for c in plain.values()]
    # Adaptive: whether to draft is the policy's call (on the CPU plain decoding of the tiny model is
    # cheap against a draft; it drafted here only while one slow first plain step was its measure).
    assert adaptive or engine.router.lookup.proposed > 0 and calls, "both lookup and the head drafted"
    # The head is fed each request's positions without a gap: a step lookup drafted left the head's
    # draft_computed alone (a skipped position would leave a hole in its KV and features).
    by_request: dict[str, list] = {}
    for item, after in calls:
        by_request.setdefault(item.request_id, []).append((item, after))
    for items in by_request.values():
        for (prev, after), (nxt, _) in zip(items, items[1:]):
            end = prev.start_pos + len(prev.input_tokens)  # after a verify call: its longest outcome
            assert prev.start_pos < nxt.start_pos <= end if after else nxt.start_pos == end, (
                prev.start_pos,
                nxt.start_pos,
            )


def test_seeded_output_with_head_and_lookup_equals_plain(tiny_models, mixed):
    prompts = repeating_prompts(5, seed=9)

    def specs():
        return [
            RequestSpec(
                p,
                max_tokens=24,
                stop_at_eos=False,
                request_id=f"r{i}",
                sampling=SamplingParams(temperature=0.3, seed=100 + i),
            )
            for i, p in enumerate(prompts)
        ]

    plain = make_engine(tiny_models[0], "none", k=0).generate(specs())
    engine = make_engine(tiny_models[0], mixed, k=4)
    done = engine.generate(specs())
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert engine.router.lookup.proposed > 0
    assert sum(c.usage["accepted_tokens"] for c in done.values()) > 0


def _work(request_id: str, tokens: list[int], k: int = 3) -> DecodeWork:
    seq = Sequence(RequestSpec(tokens[:2], max_tokens=100, request_id=request_id), request_id, 0, RequestStats())
    seq.output_ids = list(tokens[2:])
    return DecodeWork(seq, k)


def test_lookup_proposes_only_where_the_context_repeats_its_last_three_tokens():
    mix = LookupMix()
    fresh = _work("a", [5, 6, 7, 8, 9, 10])
    two = _work("b", [5, 6, 7, 8, 6, 7])  # only 2 tokens repeat: the head drafts
    three = _work("c", [5, 6, 7, 8, 5, 6, 7], k=4)  # 3 repeat: copy what followed, overlapping
    assert mix.take([fresh, two, three]) == {"c": [8, 5, 6, 7]}
    three.seq.output_ids.append(8)  # the history follows the sequence's tokens
    assert mix.take([three]) == {"c": [5, 6, 7, 8]}
    # A bounded cache: evicted histories are rebuilt from the sequence and propose the same.
    small = LookupMix(capacity_tokens=8)
    assert small.take([fresh, three]) == {"c": [5, 6, 7, 8]}
    assert small.take([fresh]) == {} and small.take([three]) == {"c": [5, 6, 7, 8]}
    mix.forget("c")
    assert "c" not in mix._histories


def test_verify_gathers_host_drafts_beside_device_rows():
    batch = DraftBatch(torch.tensor([[11, 12, 13], [21, 22, 23]]))
    kv = KvHandle("t", 1, (0,), 1, 1)
    item = lambda drafts: VerifyItem("r", 1, 0, drafts, kv, SamplingParams())  # noqa: E731
    items = [item(DeviceDraftTokens(batch, 1, 3)), item([7, 8]), item([]), item(DeviceDraftTokens(batch, 0, 2))]
    from verifypd.lanes.device_values import device_drafts

    assert device_drafts(items) is batch
    assert batch.gather(items, 3).tolist() == [[21, 22, 23], [7, 8, 0], [0, 0, 0], [11, 12, 13]]


def test_lookup_proposals_reach_telemetry(tiny_models, mixed):
    """verifypd.speculation.lookup_proposals counts the requests' steps lookup drafted."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from verifypd.core.telemetry import Telemetry
    from verifypd.domain import metric_names as mn

    reader = InMemoryMetricReader()
    engine = make_engine(tiny_models[0], mixed, k=3)
    engine.router.observer = Telemetry(readers=[reader])
    engine.generate([RequestSpec(p, max_tokens=24, stop_at_eos=False) for p in repeating_prompts(4, seed=2)])
    points = [
        p.value
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == mn.LOOKUP_PROPOSALS
        for p in m.data.data_points
    ]
    assert engine.router.lookup.proposed > 0 and points == [engine.router.lookup.proposed]


@pytest.mark.parametrize("schedule, pipeline, blocks", [("pdv", True, 128), ("baseline", True, 24), ("pdv", False, 24)])
def test_seeded_output_with_lookup_in_every_schedule_and_after_preemption(
    tiny_models, mixed, schedule, pipeline, blocks
):
    """The mix beside other requests, in the schedules (pipelined pdv, where the drafts made a step
    ahead are the head's; baseline, one request a step) and under a pool small enough to preempt
    (a recompute re-prefills the head's rows; the lookup index is kept, it holds tokens only): each
    request's seeded tokens are --draft none's."""
    from engine_cases import crowd, run

    specs = crowd(6, seed=5) + [
        RequestSpec(
            p,
            max_tokens=24,
            stop_at_eos=False,
            request_id=f"m{i}",
            sampling=SamplingParams(temperature=0.3, seed=40 + i),
        )
        for i, p in enumerate(repeating_prompts(4, seed=11))
    ]
    expected, _ = run(make_engine(tiny_models[0], "none", k=0), specs)
    engine = make_engine(tiny_models[0], mixed, k=3, num_blocks=blocks)  # k fixed: every step drafts
    engine.router.config = engine.router.config.updated(schedule=schedule, pipeline=pipeline)
    tokens, stats = run(engine, specs)
    assert tokens == expected
    assert engine.router.lookup.proposed > 0
    if blocks == 24:
        assert sum(s.preemptions for s in stats.values()) > 0, "the pool was not small enough to preempt"

"""Pure unit tests: distributions, workloads, arrivals, metric definitions, datasets."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from scipy import stats as sps

from verifypd_loadgen import arrivals, metrics
from verifypd_loadgen.datasets import DatasetError, load_dataset
from verifypd_loadgen.fake_server import FailRule
from verifypd_loadgen.runner import LoadPoint, PointResult, RequestRecord
from verifypd_loadgen.workload import Distribution, Workload, parse_distribution, parse_priority_mix


def test_distribution_parsing_and_sampling():
    rng = np.random.default_rng(1)
    assert parse_distribution("64") == Distribution("fixed", (64.0,))
    assert {parse_distribution("fixed:7").sample(rng) for _ in range(10)} == {7}
    u = [parse_distribution("uniform:10,20").sample(rng) for _ in range(2000)]
    assert min(u) == 10 and max(u) == 20
    n = [parse_distribution("normal:100,10").sample(rng) for _ in range(5000)]
    assert abs(np.mean(n) - 100) < 1 and abs(np.std(n) - 10) < 1
    ln = [parse_distribution("lognormal:200,0.5").sample(rng) for _ in range(20000)]
    assert abs(np.mean(ln) - 200) < 6  # parameterised by its mean
    assert min(parse_distribution("normal:1,50").sample(rng) for _ in range(200)) >= 1
    for bad in ("gauss:1,2", "uniform:5", "uniform:9,3", "fixed:0", "normal:a,b", "normal:5,-1"):
        with pytest.raises(ValueError):
            parse_distribution(bad)


def test_priority_mix():
    assert parse_priority_mix("0:3,10:1") == [(0, 0.75), (10, 0.25)]
    for bad in ("x:1", "0:-1", "500:1", "0:0"):
        with pytest.raises(ValueError):
            parse_priority_mix(bad)
    w = Workload(priority_mix=[(0, 0.75), (10, 0.25)], seed=3)
    prios = [next(it).priority for it in [w.requests(1)] for _ in range(4000)]
    assert abs(prios.count(10) / 4000 - 0.25) < 0.03


def test_synthetic_workload_is_seeded_and_bounded():
    w = Workload(
        input_len=parse_distribution("uniform:5,50"),
        output_len=parse_distribution("fixed:9"),
        vocab_range=(100, 200),
        seed=7,
    )
    a = [next(it) for it in [w.requests(1)] for _ in range(50)]
    b = [next(it) for it in [w.requests(1)] for _ in range(50)]
    c = [next(it) for it in [w.requests(0)] for _ in range(50)]
    assert [r.prompt.token_ids for r in a] == [r.prompt.token_ids for r in b]
    assert [r.prompt.token_ids for r in a] != [r.prompt.token_ids for r in c]
    for r in a:
        assert 5 <= len(r.prompt.token_ids) <= 50
        assert all(100 <= t < 200 for t in r.prompt.token_ids)
        proto = r.to_proto("x")
        assert proto.max_tokens == 9 and proto.HasField("stop_at_eos") and not proto.stop_at_eos
        assert not proto.HasField("sampling")  # greedy


def test_poisson_schedule_has_the_right_rate():
    rate = 40.0
    offsets = arrivals.schedule(5000, rate, "poisson", seed=11)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert abs(gaps.mean() * rate - 1) < 0.05  # sd of the mean is 1/sqrt(5000) = 1.4%
    assert sps.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.001
    # and it is not just any positive sequence: a constant-rate schedule fails the same test
    assert sps.kstest(np.full(5000, 1 / rate), "expon", args=(0, 1 / rate)).pvalue < 1e-6


def test_gamma_burstiness_keeps_the_rate_and_sets_the_spread():
    for b in (0.25, 4.0):
        gaps = np.diff(arrivals.schedule(20000, 10.0, "gamma", burstiness=b, seed=2))
        assert abs(gaps.mean() * 10 - 1) < 0.05
        assert abs(gaps.std() / gaps.mean() - 1 / math.sqrt(b)) < 0.1
    assert set(arrivals.schedule(5, math.inf)) == {0.0}


def _rec(start, times, tokens, **kw):
    r = RequestRecord(
        "r",
        kw.pop("priority", 0),
        sum(tokens),
        None,
        start=start,
        end=kw.pop("end", times[-1] if times else start + 1),
        chunk_times=list(times),
        chunk_tokens=list(tokens),
        applied_k=kw.pop("applied_k", [0] * len(times)),
        **kw,
    )
    r.finish_reason = r.finish_reason or ("FINISH_REASON_LENGTH" if r.error is None else "")
    return r


def test_itl_definitions_per_token_and_per_chunk():
    t = metrics.request_times(_rec(0.0, [0.10, 0.13, 0.19], [1, 3, 2]))
    assert t.ttft == pytest.approx(0.10)
    assert t.itl_chunk == pytest.approx([0.03, 0.06])
    assert t.itl_token == pytest.approx([0.01] * 3 + [0.03] * 2)
    assert t.tpot == pytest.approx(0.09 / 5)
    single = metrics.request_times(_rec(0.0, [0.2], [1]))
    assert single.tpot is None and single.itl_token == [] and single.itl_chunk == []


def test_summary_counts_errors_goodput_and_speculation():
    ok_fast = _rec(
        0.0, [0.01, 0.02, 0.03], [1, 2, 2], draft_tokens=8, accepted_tokens=2, verify_steps=2, applied_k=[0, 4, 4]
    )
    ok_slow = _rec(
        1.0, [1.5, 1.6], [1, 1], draft_tokens=4, accepted_tokens=0, verify_steps=1, applied_k=[0, 4], priority=10
    )
    failed = [_rec(0.0, [], [], error="UNAVAILABLE") for _ in range(2)]
    failed.append(_rec(0.0, [0.01], [1], error="RESOURCE_EXHAUSTED"))
    cancelled = _rec(0.0, [], [], cancelled=True)
    point = PointResult(LoadPoint("closed", concurrency=2), [ok_fast, ok_slow, *failed, cancelled], 0.0, 2.0)
    s = metrics.summarize(point, slo_ttft_ms=100)
    assert s["requests"] == {"sent": 6, "completed": 2, "failed": 3, "cancelled": 1}
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 2}
    assert s["throughput"]["requests_per_s"] == pytest.approx(1.0)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(7 / 2)
    assert s["goodput"]["good_requests"] == 1 and s["goodput"]["fraction"] == 0.5
    assert s["latency_ms"]["ttft"]["p50"] == pytest.approx(255.0)  # (10 + 500) / 2
    assert s["speculation"]["acceptance_rate"] == pytest.approx(2 / 12)
    assert s["speculation"]["applied_k"] == {"0": 2, "4": 3}
    assert s["by_priority"]["10"]["completed"] == 1
    assert metrics.summarize(point)["goodput"]["requests_per_s"] is None


def test_stats_match_numpy_and_handle_empty():
    v = np.random.default_rng(0).exponential(size=1001)
    s = metrics.stats(v, scale=1000)
    for p in (50, 90, 95, 99):
        assert s[f"p{p}"] == pytest.approx(np.percentile(v * 1000, p))
    assert metrics.stats([])["p99"] is None and metrics.stats([])["count"] == 0


def test_jsonl_and_sharegpt_datasets(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text(
        json.dumps({"prompt": "hello there", "max_tokens": 5})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
    )
    a, b = load_dataset(jl)
    assert a.text == "hello there" and a.max_tokens == 5
    assert b.chat == [("user", "hi")] and b.max_tokens is None
    sg = tmp_path / "sg.json"
    sg.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "system", "value": "be nice"},
                        {"from": "human", "value": "What is 2+2?"},
                        {"from": "gpt", "value": " ".join(["w"] * 10)},
                    ]
                },
                {"conversations": [{"from": "gpt", "value": "no human turn"}]},
            ]
        )
    )
    (p,) = load_dataset(sg)
    assert p.text == "What is 2+2?" and p.max_tokens == 13  # 10 words * 1.3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        load_dataset(bad)
    w = Workload(prompts=[a], output_len=parse_distribution("3"))
    assert next(w.requests(1)).max_tokens == 3  # --output-len overrides the file


def test_fail_rule_parsing():
    r = FailRule.parse("resource_exhausted,match=^lg0-3$,after=2")
    assert r.code.name == "RESOURCE_EXHAUSTED" and r.after == 2
    for bad in ("NOPE,every=2", "UNAVAILABLE", "UNAVAILABLE,foo=1"):
        with pytest.raises(ValueError):
            FailRule.parse(bad)


def test_procs_share_the_load_exactly():
    from verifypd_loadgen.procs import default_procs, share, share_load
    from verifypd_loadgen.runner import LoadPoint

    assert [share(10, 3, i) for i in range(3)] == [4, 3, 3]
    closed = [share_load(LoadPoint("closed", concurrency=5), 2, i) for i in range(2)]
    assert [p.concurrency for p in closed] == [3, 2]
    assert share_load(LoadPoint("closed", concurrency=1), 2, 1) is None  # sits the point out
    opened = [share_load(LoadPoint("open", rate=30.0, max_concurrency=3), 2, i) for i in range(2)]
    assert [p.rate for p in opened] == [15.0, 15.0] and [p.max_concurrency for p in opened] == [2, 1]
    assert default_procs([LoadPoint("closed", concurrency=1)]) == 1
    assert default_procs([LoadPoint("closed", concurrency=33)]) == min(2, os.cpu_count() or 1)


def test_each_process_draws_its_own_requests():
    from verifypd_loadgen.workload import Workload

    first = [next(Workload(proc=p).requests(stream=1)).prompt.token_ids for p in (0, 1)]
    assert first[0] != first[1]
    assert next(Workload().requests(stream=1)).prompt.token_ids == first[0]  # process 0: as before --procs


def test_mixed_workload_puts_long_prompts_among_short_ones():
    from verifypd_loadgen.workload import Workload

    w = Workload(input_len=parse_distribution("16"), long_fraction=0.25, long_input_len=parse_distribution("900"))
    it = w.requests(stream=1)
    lengths = [len(next(it).prompt.token_ids) for _ in range(400)]
    assert set(lengths) == {16, 900}
    assert 0.18 < lengths.count(900) / 400 < 0.32  # binomial(400, 0.25): sd 0.022
    assert [len(next(Workload().requests(1)).prompt.token_ids)] == [128]  # uniform: unchanged

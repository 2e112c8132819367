"""core/serving_metrics.py without a server: per-token ITL from a request's emission times, and
token counters that count a request in flight once and never go down when it finishes."""

from __future__ import annotations

from types import SimpleNamespace

from verifypd.core.serving_metrics import ITL_BUCKETS, Hist, ServingMetrics, observe_itl
from verifypd.domain.requests import FinishReason, RequestStats
from verifypd.router.sequence import SeqStatus


def test_itl_spreads_each_steps_gap_over_its_tokens():
    h = Hist(ITL_BUCKETS)
    # first step 1 token at t=1.0; then 4 tokens at 1.02 (5 ms each); then 1 token at 1.05 (30 ms)
    observe_itl(h, [1.0, 1.02, 1.02, 1.02, 1.02, 1.05])
    assert h.count == 5
    assert abs(h.total - (4 * 0.005 + 0.03)) < 1e-9
    buckets = dict(h.cumulative()[0])
    assert buckets["0.0025"] == 0 and buckets["0.0075"] == 4 and buckets["0.025"] == 4 and buckets["0.05"] == 5


def seq(rid: str, generated: int, status=SeqStatus.DECODING, preemptions: int = 0):
    stats = RequestStats(prompt_tokens=10, completion_tokens=generated, arrival_time=0.0, preemptions=preemptions)
    stats.scheduled_time, stats.token_times = 0.1, [0.2 + 0.01 * i for i in range(generated)]
    return SimpleNamespace(request_id=rid, stats=stats, status=status, finish_reason=None)


def router(*seqs):
    running = [s for s in seqs if s.status is not SeqStatus.WAITING]
    return SimpleNamespace(
        sequences=lambda: list(seqs),
        scheduler=SimpleNamespace(running=running, num_waiting=len(seqs) - len(running)),
        target_blocks=SimpleNamespace(num_used=3, num_blocks=12),
    )


def totals(m: ServingMetrics) -> dict:
    return {f.name: f.samples[0].value for f in m.collect() if f.type in ("counter", "gauge") and f.samples}


def test_counters_count_a_request_in_flight_once():
    m = ServingMetrics("m")
    a, b = seq("a", 5), seq("b", 2, SeqStatus.WAITING, preemptions=1)
    m.scan(router(a, b))
    t = totals(m)
    assert t["vllm:generation_tokens"] == 7 and t["vllm:prompt_tokens"] == 20 and t["vllm:num_preemptions"] == 1
    assert t["vllm:num_requests_running"] == 1 and t["vllm:num_requests_waiting"] == 1
    assert t["verifypd_num_requests_preempted"] == 1 and t["vllm:kv_cache_usage_perc"] == 0.25
    # `a` runs on to 8 tokens and finishes before the next scan: counted once, with all 8.
    a2 = seq("a", 8)
    a2.finish_reason = FinishReason.LENGTH
    m.on_request_finished(a2)
    t = totals(m)
    assert t["vllm:generation_tokens"] == 8 + 2 and t["vllm:prompt_tokens"] == 20
    m.scan(router(b))
    assert totals(m)["vllm:generation_tokens"] == 10

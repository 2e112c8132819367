"""/metrics after real requests (tiny models, CPU, colocated, HTTP and gRPC): every SLO series
of docs/services.md's table is there under its vLLM name (and our own beside it), with the
counts the requests imply: one ITL observation per output token after the first, gauges that
follow the load up and back to 0, tokens, finish reasons, speculation and refusals counted."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest
from http_helpers import MODEL, HttpGateway
from prometheus_client.parser import text_string_to_metric_families
from services_helpers import Client, greedy_request, wait_until

from verifypd.v1 import generate_pb2

N, TOKENS = 4, 8


def scrape(url: str) -> dict[str, list]:
    """name (as Prometheus renders it, e.g. `vllm:prompt_tokens_total`) -> samples."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(series: dict, name: str, **labels) -> float:
    hits = [s.value for s in series[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, series.get(name))
    return hits[0]


@pytest.fixture(scope="module")
def server(chat_models):
    s = HttpGateway(chat_models, max_running=1)
    yield s
    s.stop()


def test_every_series_after_real_requests(server):
    base = scrape(server.url)
    assert value(base, "vllm:time_to_first_token_seconds_count", model_name=MODEL) == 0

    # While one request runs slowly and another waits (max_running 1): gauges show the load.
    server.slow.delay_s = 0.1
    client = Client(server.gw.address)
    calls = [
        client.gen.Generate(generate_pb2.GenerateRequest(**greedy_request(list(range(3, 20)), 30)), timeout=60)
        for _ in range(2)
    ]
    threads = [threading.Thread(target=list, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    busy = lambda: scrape(server.url)  # noqa: E731
    assert wait_until(
        lambda: (
            value(s := busy(), "vllm:num_requests_running", model_name=MODEL) == 1
            and value(s, "vllm:num_requests_waiting", model_name=MODEL) == 1
            and value(s, "vllm:kv_cache_usage_perc", model_name=MODEL) > 0
        ),
        30,
    )
    for t in threads:
        t.join(60)
    server.slow.delay_s = 0.0

    # N finished HTTP requests of exactly TOKENS tokens, one refused over HTTP and one over gRPC.
    for i in range(N):
        body = {"model": MODEL, "prompt": [5, 6, 7 + i], "max_tokens": TOKENS, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=dict(body, stream=i % 2 == 1), timeout=60)
        assert r.status_code == 200
    assert (
        httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 7}).status_code == 400
    )
    with pytest.raises(grpc.RpcError):
        client.generate(**dict(greedy_request([5, 6], 5), sampling=generate_pb2.SamplingParams(top_p=3)))
    client.close()

    done = 2 + N
    out_tokens = 2 * 30 + N * TOKENS
    m = scrape(server.url)
    model = {"model_name": MODEL}
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert value(m, name + "_count", **model) == done, name
        assert value(m, name + "_bucket", le="+Inf", **model) == done, name
    # One inter-token latency per output token after the first (each prefill gives one token).
    assert value(m, "vllm:inter_token_latency_seconds_count", **model) == out_tokens - done
    assert value(m, "vllm:time_per_output_token_seconds_count", **model) == out_tokens - done
    # The second slow request waited for all of the first: >= 30 / (k + 1) steps of >= 0.1 s.
    assert value(m, "vllm:request_queue_time_seconds_sum", **model) > 0.5
    assert value(m, "vllm:generation_tokens_total", **model) == out_tokens
    assert value(m, "vllm:prompt_tokens_total", **model) == 2 * 17 + N * 3
    assert value(m, "vllm:request_success_total", finished_reason="length", **model) == done
    assert value(m, "vllm:num_preemptions_total", **model) == 0
    drafts = value(m, "vllm:spec_decode_num_drafts_total", **model)
    drafted = value(m, "vllm:spec_decode_num_draft_tokens_total", **model)
    accepted = value(m, "vllm:spec_decode_num_accepted_tokens_total", **model)
    assert drafts > 0 and 0 <= accepted <= drafted
    assert value(m, "verifypd_spec_decode_acceptance_length_count", **model) == drafts
    assert value(m, "verifypd_spec_decode_acceptance_length_sum", **model) == accepted + drafts
    assert value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0", **model) <= drafts
    assert value(m, "verifypd_request_errors_total", api="http", code="400", reason="invalid_value") == 1
    assert value(m, "verifypd_request_errors_total", api="grpc", code="INVALID_ARGUMENT", reason="invalid_request") == 1
    # OTel GenAI names beside them (the OTel instruments' own Prometheus rendering).
    assert m["gen_ai_server_time_to_first_token_seconds_count"][0].value == done
    # Back to idle: gauges read 0.
    assert wait_until(
        lambda: (
            value(s := scrape(server.url), "vllm:num_requests_running", **model) == 0
            and value(s, "vllm:num_requests_waiting", **model) == 0
            and value(s, "verifypd_num_requests_preempted", **model) == 0
            and value(s, "vllm:kv_cache_usage_perc", **model) == 0
            and value(s, "vllm:gpu_cache_usage_perc", **model) == 0
        ),
        30,
    )

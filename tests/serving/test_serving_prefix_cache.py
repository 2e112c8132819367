"""Prefix caching through `verifypd serve`: the same prompts give the same tokens with the cache on
(default) and off (`--no-prefix-cache`), gRPC and the OpenAI API report the cached prompt tokens,
/metrics counts the hits."""

from __future__ import annotations

import random
import sys

import httpx
import pytest
from http_helpers import MODEL
from services_helpers import BLOCK_SIZE, MAX_CONTEXT, Client, Server, free_port, greedy_request

pytestmark = pytest.mark.slow  # `verifypd serve` processes (tests/README.md)


def _serve(models, *extra):
    grpc_port, http_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--served-model-name",
        MODEL,
        "--target",
        models[0],
        "--draft",
        models[1],
        "--device",
        "cpu",
        "--num-blocks",
        "96",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-context",
        str(MAX_CONTEXT),
        "--k-initial",
        "3",
        "--no-adaptive",
        *extra,
    ]
    server = Server(cmd, ready_line="OpenAI-compatible HTTP API on", echo=False)
    if not server.ready.wait(180):
        server.proc.kill()
        pytest.fail("server did not start:\n" + "".join(server.lines[-30:]))
    return server, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    base = [rng.randrange(3, 90) for _ in range(30)]
    return [base + [11, 12], base + [13], base[:17] + [40, 41, 42], base + [11, 12]]


def _run(grpc_addr: str) -> tuple[list[list[int]], list[int]]:
    client = Client(grpc_addr)
    try:
        tokens, cached = [], []
        for p in _prompts():
            ids, msgs = client.generate(**greedy_request(p, max_tokens=12))
            tokens.append(ids)
            cached.append(msgs[-1].usage.cached_tokens)
        return tokens, cached
    finally:
        client.close()


def test_served_tokens_equal_uncached_and_usage_reports_cached_tokens(chat_models):
    from prometheus_client.parser import text_string_to_metric_families

    off, off_grpc, _ = _serve(chat_models, "--no-prefix-cache")
    try:
        plain, plain_cached = _run(off_grpc)
    finally:
        off.proc.kill()
    on, grpc_addr, url = _serve(chat_models)
    try:
        tokens, cached = _run(grpc_addr)
        assert tokens == plain
        assert plain_cached == [0, 0, 0, 0]
        # 30 shared tokens = 7 full blocks of 4; the repeat: 32 tokens, all but the last block's end
        assert cached == [0, 28, 16, 28]
        body = {
            "model": MODEL,
            "prompt": _prompts()[0],
            "max_tokens": 4,
            "ignore_eos": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 28}
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
        hits = families["verifypd_prefix_cache_hit_tokens"].samples[0].value
        queried = families["verifypd_prefix_cache_queried_tokens"].samples[0].value
        rate = families["verifypd_prefix_cache_hit_rate"].samples[0].value
        assert hits == 28 + 16 + 28 + 28 and queried == sum(len(p) for p in _prompts()) + 32
        assert rate == pytest.approx(hits / queried)
    finally:
        on.proc.kill()

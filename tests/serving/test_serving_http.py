"""`verifypd serve` as a user runs it, gRPC and HTTP side by side: the official `openai` client
gets the same greedy text as gRPC Generate, /health and /metrics answer, loadgen's openai backend
drives it, and SIGTERM stops both."""

from __future__ import annotations

import json
import signal
import sys

import httpx
import openai
import pytest
from http_helpers import MODEL
from services_helpers import (
    BLOCK_SIZE,
    MAX_CONTEXT,
    Client,
    Server,
    free_port,
)

pytestmark = pytest.mark.slow  # `verifypd serve` processes (tests/README.md)


@pytest.fixture(scope="module")
def serve(chat_models):
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
        chat_models[0],
        "--draft",
        chat_models[1],
        "--device",
        "cpu",
        "--num-blocks",
        "64",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-context",
        str(MAX_CONTEXT),
        "--k-initial",
        "3",
        "--no-adaptive",
    ]
    server = Server(cmd, ready_line="OpenAI-compatible HTTP API on", echo=False)
    proc, lines, ready = server.proc, server.lines, server.ready
    if not ready.wait(180):
        proc.kill()
        pytest.fail("server did not start:\n" + "".join(lines[-30:]))
    yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", proc, lines
    if proc.poll() is None:
        proc.kill()


def test_openai_client_matches_grpc_generate(serve):
    grpc_addr, url, *_ = serve
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}], max_tokens=10, extra_body={"ignore_eos": True}
    )
    grpc_client = Client(grpc_addr)
    try:
        ids, msgs = grpc_client.generate(text="w5 w6 w7 ", max_tokens=10, stop_at_eos=False)  # the chat template's text
    finally:
        grpc_client.close()
    assert chat.choices[0].message.content == "".join(m.text for m in msgs)
    assert chat.model_extra["verifypd"]["token_ids"] == ids and chat.usage.completion_tokens == 10


def test_health_metrics_and_loadgen(serve, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from verifypd_loadgen.cli import main as loadgen_main

    _, url, *_ = serve
    assert httpx.get(url + "/health").status_code == 200
    out = tmp_path / "openai.json"
    assert (
        loadgen_main(
            [
                "--backend",
                "openai",
                "--url",
                url + "/v1",
                "--model",
                MODEL,
                "--requests",
                "6",
                "--concurrency",
                "2",
                "--input-len",
                "uniform:3,10",
                "--output-len",
                "8",
                "--vocab-size",
                "96",
                "--raw-records",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    s = doc["runs"][0]["summary"]
    assert s["requests"]["completed"] == 6 and s["tokens"]["output_total"] == 6 * 8
    assert 0 < s["speculation"]["acceptance_rate"] < 1 and s["speculation"]["verify_steps"] > 0
    assert s["speculation"]["applied_k"].get("3", 0) > 0  # from the verifypd extension of each chunk
    assert doc["server_info"]["topology"] == "colocated" and doc["server_info"]["max_context"] == MAX_CONTEXT
    # per-chunk token counts from the extension: they add up to the usage count
    assert all(sum(r["chunk_tokens"]) == r["output_tokens"] == 8 for r in doc["runs"][0]["records"])
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    usage = families["gen_ai_client_token_usage"]
    counts = {s.labels["gen_ai_token_type"]: s.value for s in usage.samples if s.name.endswith("_sum")}
    assert counts["output"] >= 6 * 8 + 10


def test_sigterm_stops_both_servers(serve):
    grpc_addr, url, proc, lines = serve
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)

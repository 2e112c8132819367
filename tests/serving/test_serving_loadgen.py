"""verifypd-loadgen against the real tiny-model stack (colocated gateway over gRPC): every request
succeeds, token counts match what was asked, and usage-derived acceptance is reported."""

from __future__ import annotations

import json

import pytest
from services_helpers import engine_options

from verifypd_loadgen.cli import main as loadgen_main

pytestmark = pytest.mark.live  # loadgen end to end against the real stack (tests/README.md)


def test_loadgen_drives_the_real_stack(tiny_models, tmp_path):
    from verifypd.gateway.server import build_colocated

    gw = build_colocated(engine_options(*tiny_models)).start()
    try:
        out = tmp_path / "results.json"
        code = loadgen_main(
            [
                "--server",
                f"127.0.0.1:{gw.port}",
                "--requests",
                "12",
                "--concurrency",
                "1,4",
                "--input-len",
                "uniform:4,16",
                "--output-len",
                "10",
                "--vocab-size",
                "96",
                "--warmup",
                "2",
                "--out",
                str(out),
                "--plot",
                str(tmp_path / "plots"),
                "--seed",
                "3",
            ]
        )
        assert code == 0
        results = json.loads(out.read_text())
    finally:
        gw.stop()
    assert results["server_info"]["target_model"] == tiny_models[0]
    assert len(results["runs"]) == 2
    for run in results["runs"]:
        summary = run["summary"]
        assert summary["requests"]["completed"] == 12 and summary["requests"]["failed"] == 0
        assert summary["tokens"]["output_total"] == 12 * 10
        assert summary["latency_ms"]["ttft"]["count"] == 12
        assert 0 < summary["speculation"]["acceptance_rate"] < 1
    assert any(p.stat().st_size > 1000 for p in (tmp_path / "plots").glob("*.png"))


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_two_client_processes_lose_no_request(chat_models, tmp_path, backend):
    """`--procs 2`: two loadgen processes share c = 4 against one server, over gRPC and HTTP: every
    request of both completes, ids never repeat (a random tag per process), the report merges
    both processes' requests and gives each one's CPU use."""
    from http_helpers import MODEL, HttpGateway

    server = HttpGateway(chat_models)
    try:
        target = (
            ["--server", f"127.0.0.1:{server.gw.port}"]
            if backend == "grpc"
            else ["--backend", "openai", "--url", server.url + "/v1", "--model", MODEL]
        )
        out = tmp_path / "results.json"
        code = loadgen_main(
            [
                *target,
                "--procs",
                "2",
                "--requests",
                "16",
                "--concurrency",
                "4",
                "--input-len",
                "uniform:4,12",
                "--output-len",
                "8",
                "--vocab-size",
                "96",
                "--warmup",
                "2",
                "--raw-records",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        assert code == 0
        results = json.loads(out.read_text())
    finally:
        server.stop()
    assert results["config"]["procs"] == 2 and results["warmup"] == {"requests": 2, "failed": 0}
    summary = results["runs"][0]["summary"]
    assert summary["requests"] == {"sent": 16, "completed": 16, "failed": 0, "cancelled": 0}, summary["errors"]
    assert summary["tokens"]["output_total"] == 16 * 8
    assert summary["client"]["procs"] == 2 and all(0 < u < 4 for u in summary["client"]["cpu_util"])
    ids = [r["request_id"] for r in results["runs"][0]["records"]]
    assert len(set(ids)) == 16 and len({i.split("-")[0] for i in ids}) == 2  # 8 per process, 2 tags

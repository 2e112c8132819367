"""The CLI against a real gRPC server (the deterministic fake) on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest


def _load(path):
    return json.loads(path.read_text())


def test_percentiles_match_injected_timings(fake, loadgen, tmp_path):
    # TTFT depends on the prompt length, so it has a spread we can predict per request.
    servicer, addr = fake(ttft_s=0.015, prefill_s_per_token=0.001, itl_s=0.003, burst=(2,))
    out = tmp_path / "r.json"
    rc, _, err = loadgen(
        "--server",
        addr,
        "--requests",
        40,
        "--concurrency",
        2,
        "--input-len",
        "uniform:1,80",
        "--output-len",
        8,
        "--out",
        out,
    )
    assert rc == 0, err
    lat = _load(out)["runs"][0]["summary"]["latency_ms"]
    expected = np.array([15 + 1.0 * len(req.token_ids.ids) for _, req in servicer.received])
    assert len(expected) == 40
    for p in (50, 90, 99):
        # measured = injected + transport and scheduling overhead, which is a few ms on a
        # 2-core box (more when it is oversubscribed); never less than injected
        diff = lat["ttft"][f"p{p}"] - np.percentile(expected, p)
        assert -0.5 < diff < 12, (p, diff)
    # the spread cancels the overhead, so it is held tighter
    spread = lat["ttft"]["p90"] - lat["ttft"]["p50"]
    assert spread == pytest.approx(np.percentile(expected, 90) - np.percentile(expected, 50), abs=4)
    assert 2.5 < lat["itl_token"]["p50"] < 4.0  # 3 ms per token
    assert 5.5 < lat["itl_chunk"]["p50"] < 7.5  # bursts of 2 tokens: 6 ms per message
    # TPOT spreads the time after the first message over all tokens but one: 3 * 6 ms / 7
    assert lat["tpot"]["mean"] == pytest.approx(18 / 7, abs=0.4)
    assert lat["itl_token"]["count"] == 40 * 6  # 4 messages of 2: tokens after the first message


def test_each_request_is_timed_at_message_arrival(fake):
    """Per request: the first token is seen after the server scheduled it, and soon after."""
    import asyncio

    import grpc

    from verifypd.v1 import generate_pb2_grpc
    from verifypd_loadgen.runner import LoadPoint, Runner
    from verifypd_loadgen.workload import Workload, parse_distribution

    servicer, addr = fake(ttft_s=0.010, prefill_s_per_token=0.0005, itl_s=0.002)

    async def go():
        async with grpc.aio.insecure_channel(addr) as ch:
            runner = Runner(generate_pb2_grpc.GenerationStub(ch), timeout=30, drain_timeout=1)
            w = Workload(input_len=parse_distribution("uniform:1,60"), output_len=parse_distribution("4"))
            return await runner.run(LoadPoint("closed", concurrency=3), w.requests(1), 30, None, "t")

    result = asyncio.run(go())
    received = {req.request_id: t for t, req in servicer.received}  # same perf_counter clock
    lengths = {req.request_id: len(req.token_ids.ids) for _, req in servicer.received}
    for rec in result.records:
        assert rec.ok
        sent_by_server = received[rec.request_id] + 0.010 + 0.0005 * lengths[rec.request_id]
        assert rec.start <= received[rec.request_id]
        # (the upper bound only excludes gross errors: a busy CI machine can stall us)
        assert sent_by_server <= rec.chunk_times[0] < sent_by_server + 0.25
        assert len(rec.chunk_times) == 4 and rec.chunk_times == sorted(rec.chunk_times)


@pytest.mark.parametrize("c", [1, 5])
def test_closed_loop_never_exceeds_concurrency(fake, loadgen, c):
    # TTFT long enough for all c workers to overlap even on a busy machine
    servicer, addr = fake(ttft_s=0.03, itl_s=0.001)
    rc, _, err = loadgen("--server", addr, "--requests", 6 * c, "--concurrency", c, "--output-len", "uniform:1,6")
    assert rc == 0, err
    assert servicer.max_in_flight == c  # reached, never exceeded (server-side count)
    assert len(servicer.received) == 6 * c


def test_open_loop_poisson_rate(fake, loadgen, tmp_path):
    servicer, addr = fake(ttft_s=0.001, itl_s=0.0005)
    rate, n = 50.0, 120
    rc, _, err = loadgen(
        "--server", addr, "--requests", n, "--rate", rate, "--output-len", 2, "--seed", 5, "--out", tmp_path / "r.json"
    )
    assert rc == 0, err
    arrivals = np.array(sorted(t for t, _ in servicer.received))
    gaps = np.diff(arrivals)
    # sd of the mean of 119 exponential gaps is ~9%; 30% is 3 sd plus scheduling slack
    assert abs(gaps.mean() * rate - 1) < 0.3
    # exponential gaps have a coefficient of variation of 1 (sd of the estimate ~0.12 here);
    # a fixed-interval sender would give ~0. (The exact distribution of the schedule is
    # tested without timing noise in test_loadgen_units.py.)
    assert 0.6 < gaps.std() / gaps.mean() < 1.4
    assert servicer.max_in_flight > 1  # open loop does not wait for answers
    load = _load(tmp_path / "r.json")["runs"][0]["load"]
    assert load["mode"] == "open" and load["rate"] == rate and load["arrival"] == "poisson"


def test_errors_counted_by_code(fake, loadgen, tmp_path):
    from verifypd_loadgen.fake_server import FailRule

    _, addr = fake(
        fail=[FailRule.parse("UNAVAILABLE,every=5"), FailRule.parse("RESOURCE_EXHAUSTED,match=-lg0-(3|7)$,after=2")]
    )
    out = tmp_path / "r.json"
    rc, stdout, _ = loadgen("--server", addr, "--requests", 20, "--output-len", 4, "--out", out)
    assert rc == 0
    s = _load(out)["runs"][0]["summary"]
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 2, "UNAVAILABLE": 4}
    assert s["requests"] == {"sent": 20, "completed": 14, "failed": 6, "cancelled": 0}
    assert "Errors by status code" in stdout and "RESOURCE_EXHAUSTED" in stdout


def test_all_failing_exits_nonzero(fake, loadgen):
    from verifypd_loadgen.fake_server import FailRule

    _, addr = fake(fail=[FailRule.parse("INTERNAL,every=1")])
    rc, _, err = loadgen("--server", addr, "--requests", 3)
    assert rc == 1 and "all 3 requests failed (INTERNAL: 3)" in err


def test_json_schema_is_stable(fake, loadgen, tmp_path):
    from verifypd_loadgen import SCHEMA_VERSION, schema

    # Changing the layout means: bump SCHEMA_VERSION, update docs/loadgen.md and this file.
    expected = Path(__file__).with_name("golden_schema_keys.txt").read_text().split()
    for server_info in (True, False):
        _, addr = fake(server_info=server_info, burst=(1, 3), k=4)
        out = tmp_path / f"r{server_info}.json"
        rc, _, err = loadgen(
            "--server",
            addr,
            "--requests",
            4,
            "--concurrency",
            "1,2",
            "--output-len",
            6,
            "--slo-ttft-ms",
            500,
            "--warmup",
            1,
            "--priority-mix",
            "0:1,5:1",
            "--out",
            out,
            "--label",
            "x",
        )
        assert rc == 0, err
        doc = _load(out)
        assert doc["schema_version"] == SCHEMA_VERSION == 5
        assert schema.key_paths(doc) == expected
        assert doc["server_info"]["status"] == ("OK" if server_info else "UNIMPLEMENTED")
        assert doc["config"]["concurrency"] == [1, 2] and doc["config"]["server"] == addr
        assert doc["warmup"] == {"requests": 1, "failed": 0}
        spec = doc["runs"][0]["summary"]["speculation"]
        # 6 tokens in messages of 1,3,1,1: one prefill message and 3 verify steps per request
        assert spec["applied_k"] == {"0": 4, "4": 12}
        assert spec["acceptance_rate"] == pytest.approx(2 / 12)
        assert schema.load(out) == doc


@pytest.mark.slow
def test_csv_plots_and_compare(fake, loadgen, tmp_path):
    _, addr = fake(burst=(2,), k=3)
    for label in ("base", "new"):
        rc, _, err = loadgen(
            "--server",
            addr,
            "--requests",
            6,
            "--concurrency",
            "1,3",
            "--output-len",
            6,
            "--out",
            tmp_path / f"{label}.json",
            "--csv",
            tmp_path / f"{label}.csv",
            "--plot",
            tmp_path / label,
            "--label",
            label,
            "--slo-itl-ms",
            50,
        )
        assert rc == 0, err
    rows = (tmp_path / "base.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("label,mode,concurrency,rate")
    for name in ("throughput", "latency", "cdf_ttft", "cdf_itl_token", "cdf_itl_chunk"):
        png = (tmp_path / "base" / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    rc, out, err = loadgen("compare", tmp_path / "base.json", tmp_path / "new.json", "--plot", tmp_path / "cmp")
    assert rc == 0, err
    assert "base (baseline)" in out and "Load c=3" in out and "%" in out
    for name in ("compare_throughput", "compare_latency"):
        assert (tmp_path / "cmp" / f"{name}.png").stat().st_size > 5000
    (tmp_path / "junk.json").write_text("{}")
    rc, _, err = loadgen("compare", tmp_path / "base.json", tmp_path / "junk.json")
    assert rc == 2 and err.startswith("error:") and "Traceback" not in err


def test_warmup_is_excluded(fake, loadgen, tmp_path):
    servicer, addr = fake()
    rc, _, _ = loadgen(
        "--server",
        addr,
        "--requests",
        10,
        "--warmup",
        3,
        "--concurrency",
        2,
        "--output-len",
        2,
        "--out",
        tmp_path / "r.json",
    )
    assert rc == 0
    ids = [req.request_id for _, req in servicer.received]
    tag = ids[0].split("-")[0]  # one random tag per run and process
    assert len(tag) == 12 and all(i.startswith(tag + "-") for i in ids)
    assert len(ids) == 13 and sorted(i[len(tag) + 1 :] for i in ids[:3]) == ["warmup-0", "warmup-1", "warmup-2"]
    assert _load(tmp_path / "r.json")["runs"][0]["summary"]["requests"]["sent"] == 10


def test_duration_mode_is_bounded_and_cancels_stragglers(fake, loadgen, tmp_path):
    import time

    _, addr = fake(ttft_s=0.005, itl_s=3.0)  # every request takes ~24 s
    t0 = time.monotonic()
    rc, _, _ = loadgen(
        "--server",
        addr,
        "--duration",
        0.3,
        "--drain-timeout",
        0.2,
        "--concurrency",
        2,
        "--output-len",
        8,
        "--out",
        tmp_path / "r.json",
    )
    assert time.monotonic() - t0 < 20  # not waiting for a request to finish (a hang fails too)
    s = _load(tmp_path / "r.json")["runs"][0]["summary"]
    assert s["requests"] == {"sent": 2, "completed": 0, "failed": 0, "cancelled": 2}
    assert rc == 1  # nothing completed


def test_dataset_files_are_sent_as_prompts(fake, loadgen, tmp_path):
    servicer, addr = fake()
    jl = tmp_path / "p.jsonl"
    jl.write_text(
        '{"prompt": "alpha beta", "max_tokens": 3}\n'
        '{"messages": [{"role": "user", "content": "gamma"}], "max_tokens": 4}\n'
    )
    rc, _, err = loadgen("--server", addr, "--dataset", jl, "--requests", 4)
    assert rc == 0, err
    reqs = [r for _, r in servicer.received]
    assert sorted(r.WhichOneof("prompt") for r in reqs) == ["chat", "chat", "text", "text"]
    assert {(r.text, r.max_tokens) for r in reqs if r.text} == {("alpha beta", 3)}
    assert all(not r.HasField("stop_at_eos") for r in reqs)
    sg = tmp_path / "sg.json"
    sg.write_text(
        json.dumps([{"conversations": [{"from": "human", "value": "q?"}, {"from": "gpt", "value": "a b c d e"}]}])
    )
    servicer, addr = fake(final_empty=True)
    rc, _, err = loadgen("--server", addr, "--dataset", sg, "--requests", 2, "--out", tmp_path / "r.json")
    assert rc == 0, err
    assert {(r.text, r.max_tokens) for _, r in servicer.received} == {("q?", 7)}
    s = _load(tmp_path / "r.json")["runs"][0]["summary"]
    assert s["tokens"]["output_total"] == 14  # the empty final message adds no tokens


def test_server_down_gives_one_line_error(loadgen):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, out, err = loadgen("--server", f"127.0.0.1:{port}", "--requests", 2, "--connect-timeout", 3)
    assert rc == 2
    assert err.startswith(f"error: cannot reach verifypd at 127.0.0.1:{port} (UNAVAILABLE: ")
    assert "Traceback" not in err + out and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--requests", "0"],
        ["--input-len", "gauss:1,2"],
        ["--rate", "5", "--burstiness", "2"],
        ["--concurrency", "2", "--rate", "3"],
        ["--requests", "3", "--duration", "3"],
        ["--dataset", "/nonexistent.jsonl"],
    ],
)
def test_bad_arguments_are_argparse_errors(loadgen, argv):
    rc, _, err = loadgen("--server", "127.0.0.1:1", *argv)
    assert rc == 2 and "error:" in err and "Traceback" not in err
    rc, _, err = loadgen("--server", "nohostport")
    assert rc == 2 and "HOST:PORT" in err


def test_fake_server_command_smoke(loadgen, tmp_path):
    import os
    import subprocess
    import sys

    import verifypd
    import verifypd_loadgen

    # the child finds the packages where this process found them
    roots = {str(Path(m.__file__).parents[1]) for m in (verifypd, verifypd_loadgen)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "verifypd_loadgen",
            "fake-server",
            "--port",
            "0",
            "--run-for",
            "60",
            "--burst",
            "1,2",
            "--k",
            "2",
            "--fail",
            "ABORTED,every=3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert "fake verifypd Generate server on 127.0.0.1:" in line, proc.stderr.read()
        addr = line.split(" on ")[1].split()[0]
        rc, _, err = loadgen("--server", addr, "--requests", 6, "--output-len", 3, "--out", tmp_path / "r.json")
        assert rc == 0, err
        s = _load(tmp_path / "r.json")["runs"][0]["summary"]
        assert s["errors"] == {"ABORTED": 2} and s["speculation"]["acceptance_rate"] == 0.5
    finally:
        proc.terminate()
        proc.wait(timeout=10)

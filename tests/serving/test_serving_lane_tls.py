"""Mutual TLS between the engine core and real lane processes (split topology, CPU, tiny models,
real certificates): the same tokens as offline (= plaintext split) with KV passed by handle and
by copy (the prefill lane's pushes to the owners over mTLS), work calls over the TLS call
channel; a plaintext, an expired and a foreign (wrong-CA) engine core each refused with one line
naming why; `serve --topology split --lane-tls-*` end to end through the CLI, with the plaintext
health port; bad flags exit 2 naming the flag."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.request

import pytest
from pki_helpers import make_pki
from services_helpers import (
    Client,
    Server,
    engine_options,
    free_port,
    greedy_request,
    offline_outputs,
    random_prompts,
    serve_cmd,
)

from verifypd.domain.lanes import LaneError
from verifypd.domain.requests import RequestSpec
from verifypd.net.lane_tls import LaneTls

pytestmark = pytest.mark.slow  # lane processes and `verifypd serve` over mutual TLS (tests/README.md)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_of(pki, leaf="leaf", ca="ca"):
    return LaneTls(*pki[leaf], pki[ca][0])


@pytest.fixture(scope="module")
def lanes(tiny_models, pki):
    from verifypd.lanes.processes import LaneProcesses

    procs = LaneProcesses(engine_options(*tiny_models), tls=tls_of(pki))
    procs.start(timeout_s=120)
    yield procs
    procs.terminate()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=5, max_len=30)


@pytest.fixture(scope="module")
def expected(tiny_models, prompts):
    return offline_outputs(
        engine_options(*tiny_models), [RequestSpec(tuple(p), max_tokens=16, stop_at_eos=False) for p in prompts]
    )


@pytest.mark.parametrize("kv_transport", ["handle", "copy"])
def test_lanes_over_mtls_give_the_offline_tokens(tiny_models, lanes, pki, prompts, expected, kv_transport):
    from verifypd.gateway.server import build_split

    with build_split(
        lanes.addrs,
        engine_options(*tiny_models),
        kv_transport=kv_transport,
        lane_secret=lanes.secret,
        lane_tls=tls_of(pki),
    ) as gw:
        client = Client(gw.address)
        try:
            got = [client.generate(**greedy_request(p, max_tokens=16))[0] for p in prompts]
        finally:
            client.close()
        assert got == expected
        assert {m for m in gw.wiring.mode_by_pool.values()} == {"imported" if kv_transport == "handle" else "copy"}
        for lane in gw.lanes:  # the work went over the call channel, inside TLS
            assert isinstance(lane._client.sock, ssl.SSLSocket), lane.lane
        if kv_transport == "copy":  # the prefill lane pushed KV to the owners over mTLS
            assert gw.lanes[0].kv_bytes_copied > 0


@pytest.mark.parametrize(
    "case, says",
    [
        ("plaintext", "refuses plaintext"),
        ("expired", "certificate has expired"),
        ("foreign", "unable to get local issuer certificate"),
        ("foreign_ca", "certificate verify failed"),  # our certificate is fine, the lane's is not from our CA
    ],
)
def test_lanes_refuse_a_core_without_the_right_certificate(tiny_models, lanes, pki, case, says):
    from verifypd.core.assembly import connect_lanes

    tls = {
        "plaintext": None,
        "expired": tls_of(pki, "expired"),
        "foreign": tls_of(pki, "foreign"),
        "foreign_ca": tls_of(pki, "foreign", "other_ca"),
    }[case]
    with pytest.raises(LaneError) as err:
        connect_lanes(lanes.addrs, secret=lanes.secret, tls=tls, ready_timeout_s=2)
    assert says in str(err.value) and "Traceback" not in str(err.value), str(err.value)


def _health(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_serve_split_with_lane_tls_through_the_cli(tiny_models, pki, prompts, expected):
    port, health_port = free_port(), free_port()
    cmd = serve_cmd(
        tiny_models,
        port,
        "--lane-tls-cert-file",
        pki["leaf"][0],
        "--lane-tls-key-file",
        pki["leaf"][1],
        "--lane-tls-ca-file",
        pki["ca"][0],
        "--health-port",
        str(health_port),
        topology="split",
    )
    server = Server(cmd, ready_line="verifypd: health on", echo=False).wait_ready()
    try:
        client = Client(f"127.0.0.1:{port}")
        try:
            assert client.generate(**greedy_request(prompts[0], max_tokens=16))[0] == expected[0]
        finally:
            client.close()
        assert _health(f"http://127.0.0.1:{health_port}/health") == (200, {"status": "serving", "reason": "serving"})
        assert _health(f"http://127.0.0.1:{health_port}/other")[0] == 404
        assert server.count("mutual TLS") == 3  # each lane's start-up line
    finally:
        server.stop()


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--lane-tls-cert-file", "CRT"], "missing --lane-tls-key-file, --lane-tls-ca-file"),
        (
            ["--lane-tls-cert-file", "CRT", "--lane-tls-key-file", "KEY", "--lane-tls-ca-file", "/nonexistent/ca.crt"],
            "cannot read --lane-tls-ca-file /nonexistent/ca.crt",
        ),
        (
            ["--lane-tls-cert-file", "CRT", "--lane-tls-key-file", "OTHERKEY", "--lane-tls-ca-file", "CA"],
            "--lane-tls-key-file",
        ),
        (["--health-port", "70000"], "--health-port"),
    ],
)
def test_bad_lane_tls_flags_exit_2_naming_the_flag(tiny_models, pki, extra, says):
    files = {"CRT": pki["leaf"][0], "KEY": pki["leaf"][1], "OTHERKEY": pki["other_leaf"][1], "CA": pki["ca"][0]}
    cmd = serve_cmd(tiny_models, free_port(), *[files.get(a, a) for a in extra], topology="split")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_lane_with_half_its_tls_flags_exits_2(tiny_models, pki):
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "lane",
        "verify",
        "--allow-unauthenticated",
        "--target",
        tiny_models[0],
        "--device",
        "cpu",
        "--tls-cert-file",
        pki["leaf"][0],
        "--tls-ca-file",
        pki["ca"][0],
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "missing --tls-key-file" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_with_an_expired_lane_certificate_exits_1_naming_it(tiny_models, pki):
    """The lanes `serve` starts get the same (expired) files: the engine core's check names the
    problem in one line, no traceback, and `serve` exits 1."""
    cmd = serve_cmd(
        tiny_models,
        free_port(),
        "--lane-tls-cert-file",
        pki["expired"][0],
        "--lane-tls-key-file",
        pki["expired"][1],
        "--lane-tls-ca-file",
        pki["ca"][0],
        topology="split",
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "our certificate --lane-tls-cert-file" in proc.stderr and "certificate has expired" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_lane_serves_plaintext_health_beside_its_mtls_ports(pki):
    """`verifypd lane --health-port`: the kubelet's probe target while the lane's own ports speak
    mutual TLS only (a pool-less prompt-lookup draft lane: no model to load)."""
    health_port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "lane",
        "draft",
        "--draft",
        "ngram",
        "--device",
        "cpu",
        "--allow-unauthenticated",
        "--tls-cert-file",
        pki["leaf"][0],
        "--tls-key-file",
        pki["leaf"][1],
        "--tls-ca-file",
        pki["ca"][0],
        "--health-port",
        str(health_port),
    ]
    lane = Server(cmd, ready_line="lane serving on", echo=False).wait_ready(120)
    try:
        assert lane.count("mutual TLS") == 1 and lane.count(f"plaintext health on port {health_port}") == 1
        assert _health(f"http://127.0.0.1:{health_port}/health") == (200, {"status": "serving", "reason": "serving"})
    finally:
        lane.stop()

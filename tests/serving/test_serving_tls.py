"""TLS on `verifypd serve`'s public ports, with real certificates (the `cryptography` package): the
right CA gets the same greedy tokens over gRPC and HTTPS; plaintext, a wrong CA and an expired
server certificate are refused; with --tls-client-ca-file a missing or foreign client certificate
is refused; bad flags exit 2 with one line. Two serve processes (server-auth, mutual TLS)."""

from __future__ import annotations

import ssl
import subprocess
import sys

import grpc
import httpx
import pytest
from pki_helpers import make_cert, write_pem
from services_helpers import (
    Server,
    free_port,
    serve_cmd,
)

from verifypd.net import tls as tls_mod
from verifypd.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.slow  # `verifypd serve` processes over TLS (tests/README.md)

PROMPT = "w5 w6 w7"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Files: ca, server, client (by ca); expired (server cert, by ca); other_ca, foreign_server,
    foreign_client (by other_ca). Each name -> (crt path, key path)."""
    tmp = tmp_path_factory.mktemp("pki")
    ca, other = make_cert("test ca", ca=True), make_cert("other ca", ca=True)
    made = {
        "ca": ca,
        "other_ca": other,
        "server": make_cert("server", ca),
        "client": make_cert("client", ca),
        "expired": make_cert("server", ca, days=(-30, -1)),
        "foreign_server": make_cert("server", other),
        "foreign_client": make_cert("client", other),
    }
    return {name: write_pem(tmp, name, *pair) for name, pair in made.items()}


def _serve(tiny_models, pki, *extra):
    grpc_port, http_port = free_port(), free_port()
    cmd = serve_cmd(
        tiny_models, grpc_port, "--tls-cert-file", pki["server"][0], "--tls-key-file", pki["server"][1], *extra
    )
    cmd[cmd.index("--http-port") + 1] = str(http_port)
    server = Server(cmd, ready_line="OpenAI-compatible HTTP API on", echo=False).wait_ready()
    return server, f"127.0.0.1:{grpc_port}", f"https://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def served(tiny_models, pki):
    server, addr, url = _serve(tiny_models, pki)
    yield server, addr, url
    server.stop()


@pytest.fixture(scope="module")
def served_mtls(tiny_models, pki):
    server, addr, url = _serve(tiny_models, pki, "--tls-client-ca-file", pki["ca"][0])
    yield server, addr, url
    server.stop()


def _client(pki, ca="ca", cert=None):
    return tls_mod.client_tls(pki[ca][0], *(pki[cert] if cert else (None, None)))


def _grpc_generate(addr, tls, timeout=30):
    """Greedy token ids of PROMPT, or the RpcError's status code."""
    with tls_mod.grpc_channel(addr, tls) as channel:
        req = generate_pb2.GenerateRequest(text=PROMPT, max_tokens=8, stop_at_eos=False)
        try:
            return [
                t for m in generate_pb2_grpc.GenerationStub(channel).Generate(req, timeout=timeout) for t in m.token_ids
            ]
        except grpc.RpcError as exc:
            return exc.code()


def _https_completion(url, tls):
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(verify=tls.ssl_context() if tls else True, timeout=30) as client:
        models = client.get(url + "/v1/models").json()["data"][0]["id"]
        resp = client.post(url + "/v1/completions", json={**body, "model": models})
    assert resp.status_code == 200, resp.text
    return resp.json()["verifypd"]["token_ids"]


def test_right_ca_same_tokens_over_grpc_and_https(served, pki):
    server, addr, url = served
    assert any(", tls " in ln or ", tls (" in ln for ln in server.lines if "verifypd: serving" in ln)
    ids = _grpc_generate(addr, _client(pki))
    assert isinstance(ids, list) and len(ids) == 8
    assert _https_completion(url, _client(pki)) == ids


def test_plaintext_and_wrong_ca_refused(served, pki):
    _, addr, url = served
    assert _grpc_generate(addr, None, timeout=5) == grpc.StatusCode.UNAVAILABLE
    assert _grpc_generate(addr, _client(pki, "other_ca"), timeout=5) == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.TransportError):  # plain HTTP to the HTTPS port
        httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url + "/health", verify=_client(pki, "other_ca").ssl_context(), timeout=5)


def test_generate_cli_over_tls(served, pki):
    _, addr, _ = served
    base = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "generate",
        "--server",
        addr,
        PROMPT,
        "--raw",
        "--max-tokens",
        "4",
        "--json",
    ]
    ok = subprocess.run(base + ["--tls-ca-file", pki["ca"][0]], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert '"token_ids"' in ok.stdout
    bad = subprocess.run(base + ["--tls-ca-file", pki["other_ca"][0]], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "TLS handshake" in bad.stderr and "certificate verify failed" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_client_certificates_required(served_mtls, pki):
    _, addr, url = served_mtls
    good = _grpc_generate(addr, _client(pki, cert="client"))
    assert isinstance(good, list) and len(good) == 8
    assert _https_completion(url, _client(pki, cert="client")) == good
    for tls in (_client(pki), _client(pki, cert="foreign_client")):
        assert _grpc_generate(addr, tls, timeout=5) == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", verify=tls.ssl_context(), timeout=5)


def test_expired_server_certificate_refused(pki):
    """The client side: the gateway's own HTTPS server and a gRPC server with an expired cert."""
    from verifypd.gateway.http_server import HttpServer

    expired = tls_mod.server_tls(*pki["expired"])

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    http = HttpServer(app, "127.0.0.1", 0, tls=expired).start()
    try:
        with pytest.raises(httpx.ConnectError, match="certificate has expired"):
            httpx.get(http.url, verify=_client(pki).ssl_context(), timeout=5)
    finally:
        http.stop()
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(1))
    port = server.add_secure_port("127.0.0.1:0", expired.grpc_credentials())
    server.start()
    try:
        assert "certificate has expired" in tls_mod.diagnose(f"127.0.0.1:{port}", _client(pki))
        assert _grpc_generate(f"127.0.0.1:{port}", _client(pki), timeout=3) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_bad_tls_flags_exit_2(tiny_models, pki, tmp_path):
    (tmp_path / "junk.pem").write_text("not a certificate")
    cases = [
        (["--tls-cert-file", pki["server"][0]], "--tls-cert-file needs --tls-key-file"),
        (["--tls-key-file", pki["server"][1]], "--tls-key-file needs --tls-cert-file"),
        (["--tls-cert-file", pki["server"][0], "--tls-key-file", pki["client"][1]], "does not hold the private key"),
        (["--tls-cert-file", str(tmp_path / "missing.crt"), "--tls-key-file", pki["server"][1]], "cannot read"),
        (["--tls-cert-file", str(tmp_path / "junk.pem"), "--tls-key-file", pki["server"][1]], "not a PEM file"),
    ]
    for extra, message in cases:
        run = subprocess.run(serve_cmd(tiny_models, free_port(), *extra), capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, (extra, run.stderr)
        assert message in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert ssl.CERT_REQUIRED == tls_mod.server_tls(*pki["server"], pki["ca"][0]).uvicorn_options()["ssl_cert_reqs"]


def test_operator_control_client_over_mtls(served_mtls, pki):
    from verifypd_operator.control_client import ControlClient

    _, addr, _ = served_mtls
    tls = tls_mod.client_tls(pki["ca"][0], *pki["client"], server_name="localhost")  # dialled by IP, checked by name
    assert ControlClient(tls=tls).get(addr).k_max > 0
    with pytest.raises(grpc.RpcError) as refused:
        ControlClient(timeout_s=3).get(addr)  # plaintext
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_loadgen_both_backends_over_tls(served, pki, tmp_path, tiny_models):
    import json

    from verifypd_loadgen.cli import main as loadgen_main

    _, addr, url = served
    common = [
        "--requests",
        "2",
        "--concurrency",
        "2",
        "--input-len",
        "uniform:3,6",
        "--output-len",
        "4",
        "--vocab-size",
        "96",
        "--no-progress",
        "--tls-ca-file",
        pki["ca"][0],
    ]
    openai = ["--backend", "openai", "--url", url + "/v1", "--model", tiny_models[0]]  # the default model id
    for name, target in (("grpc", ["--server", addr]), ("openai", openai)):
        out = tmp_path / f"{name}.json"
        assert loadgen_main([*target, *common, "--out", str(out)]) == 0, name
        assert json.loads(out.read_text())["runs"][0]["summary"]["requests"]["completed"] == 2, name

"""The mutual-TLS layer of the lanes (verifypd.net.lane_tls) in-process, with real certificates and no
model: the call channel and a gRPC port each refuse a plaintext peer, a peer from another CA, an
expired certificate and a missing one, logging one line that names the problem; the lane secret
still applies inside TLS; rotated files are picked up by new connections while open ones keep
going; bad flags are one-line errors."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki_helpers import make_pki

from verifypd.lanes.rpc import call_channel
from verifypd.lanes.rpc.call_channel import CallClient, CallServer
from verifypd.net import lane_tls as lt
from verifypd.net import tls as tls_mod
from verifypd.net.health import add_health_and_reflection
from verifypd.net.tls import TlsError
from verifypd.v1 import lanes_pb2

SECRET = "s" * 32


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_of(pki, leaf="leaf", ca="ca", **kw):
    return lt.LaneTls(*pki[leaf], pki[ca][0], **kw)


def echo(call, state):
    return lanes_pb2.LaneReply(kv_bytes_copied=call.call_id * 10)


def call_once(server, tls, secret=SECRET):
    client = CallClient("127.0.0.1", server.port, secret, 5.0, tls)
    try:
        return client.call(lanes_pb2.LaneCall(method=lanes_pb2.LANE_METHOD_VERIFY)).kv_bytes_copied
    finally:
        client.close()


@pytest.fixture
def channel_server(pki):
    server = CallServer(echo, object, "127.0.0.1", 0, SECRET, tls_of(pki))
    yield server
    server.close()


def test_call_channel_over_mtls_answers_and_is_encrypted(pki, channel_server):
    client = CallClient("127.0.0.1", channel_server.port, SECRET, 5.0, tls_of(pki, "other_leaf"))
    try:
        assert client.call(lanes_pb2.LaneCall(method=lanes_pb2.LANE_METHOD_VERIFY)).kv_bytes_copied == 10
        assert isinstance(client.sock, ssl.SSLSocket) and client.sock.version() in ("TLSv1.2", "TLSv1.3")
        assert client.call(lanes_pb2.LaneCall(method=lanes_pb2.LANE_METHOD_VERIFY)).kv_bytes_copied == 20
    finally:
        client.close()


def _refused(server, tls, caplog, monkeypatch):
    """(client's error, the server's log lines) for one connection attempt."""
    monkeypatch.setattr(call_channel, "HANDSHAKE_TIMEOUT_S", 1.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verifypd.call_channel"):
        with pytest.raises(OSError) as err:  # ssl.SSLError and ChannelClosed are OSErrors
            call_once(server, tls)
        deadline = time.monotonic() + 30
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.02)
    return str(err.value), " ".join(r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "case, client_says, server_says",
    [
        ("expired", "expired", "certificate has expired"),
        ("foreign", "unknown ca", "unable to get local issuer certificate"),
        ("missing", "certificate required", "PEER_DID_NOT_RETURN_A_CERTIFICATE"),
        ("plaintext", "connection closed", "no TLS handshake"),
    ],
)
def test_call_channel_refuses_bad_client_certificates_naming_the_problem(
    pki, channel_server, caplog, monkeypatch, case, client_says, server_says
):
    if case == "missing":  # trusts the server, presents nothing
        ctx = ssl.create_default_context(cafile=pki["ca"][0])

        def wrap_client(self, sock, host):
            return ctx.wrap_socket(sock, server_hostname=host)

        tls = type("NoCert", (), {"wrap_client": wrap_client})()
    else:
        tls = None if case == "plaintext" else tls_of(pki, case)
    said, logged = _refused(channel_server, tls, caplog, monkeypatch)
    assert client_says in said.lower(), said
    assert server_says in logged and "Traceback" not in logged, logged


def test_call_channel_client_refuses_a_server_from_another_ca(pki):
    server = CallServer(echo, object, "127.0.0.1", 0, SECRET, tls_of(pki, "foreign", "other_ca"))
    try:
        with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
            call_once(server, tls_of(pki))
    finally:
        server.close()


def test_the_lane_secret_still_applies_inside_tls(pki, channel_server, caplog):
    with caplog.at_level(logging.WARNING, logger="verifypd.call_channel"):
        with pytest.raises(OSError):
            call_once(channel_server, tls_of(pki), secret="w" * 32)
    assert "bad lane secret proof" in caplog.text
    assert call_once(channel_server, tls_of(pki)) == 10


def _grpc_server(tls):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_health_and_reflection(server, [])
    port = server.add_secure_port("127.0.0.1:0", tls.grpc_server_credentials())
    server.start()
    return server, f"127.0.0.1:{port}"


def _health(channel, timeout=3):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


@pytest.mark.parametrize(
    "case, why",
    [
        ("expired", "certificate has expired"),
        ("foreign", "unable to get local issuer certificate"),
        ("missing", "did not accept our client certificate"),
        ("plaintext", None),
    ],
)
def test_grpc_port_refuses_bad_clients_and_diagnose_names_why(pki, case, why):
    server, addr = _grpc_server(tls_of(pki))
    try:
        with tls_of(pki).grpc_channel(addr) as good:
            assert _health(good) == health_pb2.HealthCheckResponse.SERVING
        if case == "plaintext":
            channel = grpc.insecure_channel(addr)
        elif case == "missing":
            channel = grpc.secure_channel(addr, grpc.ssl_channel_credentials(open(pki["ca"][0], "rb").read()))
        else:
            channel = tls_of(pki, case).grpc_channel(addr)
        with channel, pytest.raises(grpc.RpcError) as err:
            _health(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        if case == "missing":  # what a client's diagnosis says (the gateway prints it in its LaneError)
            said = tls_mod.diagnose(addr, tls_mod.client_tls(pki["ca"][0]))
        elif case != "plaintext":
            said = tls_of(pki, case).diagnose(addr)
        if why:
            assert why in said.lower(), said
    finally:
        server.stop(0)


def test_rotation_new_connections_get_new_files_open_ones_keep_going(pki, tmp_path):
    """The server's files are replaced (atomically, as a Secret volume does) by a certificate of
    another CA: a connection opened before keeps working, a new one sees the new certificate."""
    crt, key = (str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    ca = str(tmp_path / "ca.crt")
    shutil.copy(pki["leaf"][0], crt), shutil.copy(pki["leaf"][1], key), shutil.copy(pki["ca"][0], ca)
    server_tls = lt.LaneTls(crt, key, ca, check_s=0.0)
    channel_server = CallServer(echo, object, "127.0.0.1", 0, SECRET, server_tls)
    grpc_server, addr = _grpc_server(server_tls)
    old_client = CallClient("127.0.0.1", channel_server.port, SECRET, 5.0, tls_of(pki))
    old_channel = tls_of(pki).grpc_channel(addr)
    try:
        assert old_client.call(lanes_pb2.LaneCall()).kv_bytes_copied == 10
        assert _health(old_channel) == health_pb2.HealthCheckResponse.SERVING
        # Rotate to the other CA's certificate (the client CA stays): os.replace, like kubelet's swap.
        for src, dst in ((pki["foreign"][0], crt), (pki["foreign"][1], key)):
            shutil.copy(src, dst + ".new")
            os.replace(dst + ".new", dst)
        time.sleep(0.01)
        # Open connections keep going ...
        assert old_client.call(lanes_pb2.LaneCall()).kv_bytes_copied == 20
        assert _health(old_channel) == health_pb2.HealthCheckResponse.SERVING
        # ... new ones get the new certificate: refused by a client trusting only the first CA,
        # accepted by one trusting the new certificate's CA.
        with pytest.raises(ssl.SSLCertVerificationError):
            call_once(channel_server, tls_of(pki))
        assert call_once(channel_server, tls_of(pki, ca="other_ca")) == 10
        with tls_of(pki).grpc_channel(addr) as fresh, pytest.raises(grpc.RpcError):
            _health(fresh)
        with tls_of(pki, ca="other_ca").grpc_channel(addr) as fresh:
            assert _health(fresh) == health_pb2.HealthCheckResponse.SERVING
        assert server_tls.generation == 1
    finally:
        old_client.close()
        old_channel.close()
        channel_server.close()
        grpc_server.stop(0)


def test_half_replaced_files_keep_the_old_certificate(pki, tmp_path, caplog):
    crt, key, ca = str(tmp_path / "c"), str(tmp_path / "k"), pki["ca"][0]
    shutil.copy(pki["leaf"][0], crt), shutil.copy(pki["leaf"][1], key)
    tls = lt.LaneTls(crt, key, ca, check_s=0.0)
    shutil.copy(pki["other_leaf"][0], crt)  # the certificate changed, its key not yet
    with caplog.at_level(logging.WARNING, logger="verifypd.net.lane_tls"):
        material = tls.current()
    assert tls.generation == 0 and material.cert == open(pki["leaf"][0], "rb").read()
    assert "do not load" in caplog.text
    shutil.copy(pki["other_leaf"][1], key)
    assert tls.current().cert == open(pki["other_leaf"][0], "rb").read() and tls.generation == 1


@pytest.mark.parametrize(
    "given, message",
    [
        ((True, False, True), "missing --tls-key-file"),
        ((False, False, True), "missing --tls-cert-file, --tls-key-file"),
    ],
)
def test_lane_tls_flags_all_or_nothing(pki, given, message):
    files = [pki["leaf"][0], pki["leaf"][1], pki["ca"][0]]
    with pytest.raises(TlsError, match=message):
        lt.lane_tls(*[f if g else None for f, g in zip(files, given)])
    assert lt.lane_tls(None, None, None) is None


def test_a_key_of_another_certificate_is_named(pki):
    with pytest.raises(TlsError, match="--tls-key-file .* does not hold the private key of --tls-cert-file"):
        lt.lane_tls(pki["leaf"][0], pki["other_leaf"][1], pki["ca"][0])


def test_plaintext_is_untouched_when_tls_is_off():
    """TLS off costs nothing: the sockets are the plain ones."""
    server = CallServer(echo, object, "127.0.0.1", 0, SECRET)
    client = CallClient("127.0.0.1", server.port, SECRET, 5.0)
    try:
        assert client.call(lanes_pb2.LaneCall()).kv_bytes_copied == 10
        assert type(client.sock) is socket.socket
    finally:
        client.close()
        server.close()


def test_gateway_public_ports_reload_a_rotated_certificate(pki, tmp_path, monkeypatch):
    """`serve --tls-cert-file`: the gRPC port (dynamic credentials) and the HTTPS port (uvicorn's
    live SSLContext) serve a replaced certificate on new connections, without a restart."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from verifypd.gateway.http_server import HttpServer

    monkeypatch.setattr(tls_mod, "RELOAD_CHECK_S", 0.05)
    crt, key = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")
    shutil.copy(pki["leaf"][0], crt), shutil.copy(pki["leaf"][1], key)
    served = tls_mod.server_tls(crt, key)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_health_and_reflection(server, [])
    addr = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', served.grpc_credentials())}"
    server.start()
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    http = HttpServer(app, "127.0.0.1", 0, tls=served).start()

    def answers(ca):
        client = tls_mod.client_tls(pki[ca][0])
        try:
            with tls_mod.grpc_channel(addr, client) as ch:
                _health(ch)
            with httpx.Client(verify=client.ssl_context()) as c:
                c.get(f"https://localhost:{http.port}/")
            return True
        except (grpc.RpcError, httpx.ConnectError):
            return False

    try:
        assert answers("ca") and not answers("other_ca")
        for src, dst in ((pki["foreign"][0], crt), (pki["foreign"][1], key)):
            shutil.copy(src, dst + ".new")
            os.replace(dst + ".new", dst)
        deadline = time.monotonic() + 30
        while not answers("other_ca") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert answers("other_ca") and not answers("ca")
    finally:
        http.stop()
        server.stop(0)

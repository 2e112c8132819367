"""TLS in Kubernetes, the pure parts: the operator's certificates (issue, keep, renew before expiry,
new names, a broken CA), usable by the real servers; the pods' TLS (Secret mounted, flags the real
CLI parsers accept, one plaintext health port per container with the probes on it), valid
manifests; cert-manager objects; the mode chosen from what the API serves."""

from __future__ import annotations

import base64

import kubernetes_validate
import pytest
from operator_helpers import K8S_VERSION

from verifypd_operator import tls_certs
from verifypd_operator.builders import build_all
from verifypd_operator.spec import parse_spec
from verifypd_operator.tls_issuer import TlsSettings, control_tls, resolve, tls_objects
from verifypd_operator.tls_manifests import (
    CA_FILE,
    CERT_FILE,
    HEALTH_PORTS,
    KEY_FILE,
    build_cert_manager_objects,
    dns_names,
    with_tls,
)

DAY = 86400.0
NOW = 1_800_000_000.0
NAMES = dns_names("demo", "ns1")


@pytest.fixture(scope="module")
def issued():
    return tls_certs.plan((None, None), (None, None), "demo", NAMES, NOW, 30)


def test_first_plan_issues_a_ca_and_a_leaf_for_every_name(issued):
    from cryptography import x509

    assert issued.reason == "issued a new CA"
    leaf = x509.load_pem_x509_certificate(issued.leaf_cert)
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(issued.ca_cert))
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "demo-verify.ns1.svc" in san.get_values_for_type(x509.DNSName)
    assert "demo-gateway-pods.ns1.svc" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days == 30


def test_a_good_certificate_is_kept_then_renewed_when_a_third_is_left(issued):
    ca, leaf = (issued.ca_key, issued.ca_cert), (issued.leaf_key, issued.leaf_cert)
    kept = tls_certs.plan(ca, leaf, "demo", NAMES, NOW + 19 * DAY, 30)
    assert kept.reason is None and (kept.leaf_cert, kept.ca_cert) == (issued.leaf_cert, issued.ca_cert)
    renewed = tls_certs.plan(ca, leaf, "demo", NAMES, NOW + 21 * DAY, 30)
    assert renewed.reason.startswith("re-issued the certificate: expires")
    assert renewed.ca_cert == issued.ca_cert and renewed.leaf_cert != issued.leaf_cert
    assert tls_certs.plan(ca, (renewed.leaf_key, renewed.leaf_cert), "demo", NAMES, NOW + 21 * DAY, 30).reason is None
    expired = tls_certs.plan(ca, leaf, "demo", NAMES, NOW + 40 * DAY, 30)
    assert "expired" in expired.reason


def test_renewal_reasons(issued):
    ca, leaf = (issued.ca_key, issued.ca_cert), (issued.leaf_key, issued.leaf_cert)
    assert tls_certs.plan(ca, leaf, "demo", NAMES + ["extra"], NOW, 30).reason.endswith("names changed")
    assert tls_certs.plan(ca, (None, None), "demo", NAMES, NOW, 30).reason.endswith("no certificate yet")
    other = tls_certs.plan((None, None), (None, None), "other", NAMES, NOW, 30)
    assert "not issued by" in tls_certs.plan(ca, (other.leaf_key, other.leaf_cert), "demo", NAMES, NOW, 30).reason
    assert "key does not match" in tls_certs.plan(ca, (other.leaf_key, issued.leaf_cert), "demo", NAMES, NOW, 30).reason
    # A CA whose key is not its certificate's: a new CA (and leaf).
    assert tls_certs.plan((other.ca_key, issued.ca_cert), leaf, "demo", NAMES, NOW, 30).reason == "issued a new CA"


def test_the_issued_certificate_serves_mutual_tls_for_real(issued, tmp_path):
    """The very bytes the Secret holds, loaded by the lanes' TLS: a handshake with itself verifies
    (server and client auth, chain to the CA, validity)."""
    import time

    from verifypd.net.lane_tls import LaneTls

    now_issued = tls_certs.plan((None, None), (None, None), "demo", NAMES, time.time(), 30)
    for name, data in (
        ("tls.crt", now_issued.leaf_cert),
        ("tls.key", now_issued.leaf_key),
        ("ca.crt", now_issued.ca_cert),
    ):
        (tmp_path / name).write_bytes(data)
    tls = LaneTls(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt"))
    assert tls.self_check() is None
    (tmp_path / "ca.crt").write_bytes(issued.ca_cert)  # another CA (issued above): refused
    assert (
        "does not verify"
        in LaneTls(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt")).self_check()
    )


def _containers(objs):
    return {
        (o["metadata"]["name"], c["name"]): c
        for o in objs
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
    }


def _parse(container):
    """The container's verifypd arguments through the real CLI parsers."""
    import argparse

    from verifypd.launch.serve_args import add_lane_arguments, serve_parser

    args = container["args"][1:] if container["args"][0] == "verifypd" else container["args"]
    if args[0] == "serve":
        return serve_parser().parse_args(args[1:])
    lane = argparse.ArgumentParser()
    add_lane_arguments(lane)
    return lane.parse_args(args[1:])


@pytest.mark.parametrize("spec", [{}, {"topology": "split"}, {"colocated": {"gpuSharing": "dra", "gpu": 1}}])
def test_pods_mount_the_secret_get_the_flags_and_probe_plaintext_health(owner, spec):
    plain = build_all(parse_spec(spec), owner, "ns1", {}, "http://otlp:4317", lane_secret="s" * 64)
    objs = with_tls(plain, "demo")
    assert [o for o in objs if o["kind"] != "Deployment"] == [o for o in plain if o["kind"] != "Deployment"]
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        if o["kind"] != "Deployment":
            continue
        pod = o["spec"]["template"]["spec"]
        assert {"name": "tls", "secret": {"secretName": "demo-tls"}} in pod["volumes"]
        ports = [p["containerPort"] for c in pod["containers"] for p in c["ports"]]
        assert len(ports) == len(set(ports)), ports  # one network namespace per pod
    for (dep, name), c in _containers(objs).items():
        args = _parse(c)
        assert {"name": "tls", "mountPath": "/var/run/verifypd/tls", "readOnly": True} in c["volumeMounts"]
        if name == "gateway":
            assert (args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file) == (CERT_FILE, KEY_FILE, None)
            assert (args.lane_tls_cert_file, args.lane_tls_key_file, args.lane_tls_ca_file) == (
                CERT_FILE,
                KEY_FILE,
                CA_FILE,
            )
        else:
            assert (args.tls_cert_file, args.tls_key_file, args.tls_ca_file) == (CERT_FILE, KEY_FILE, CA_FILE)
        assert args.health_port == HEALTH_PORTS[name]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": HEALTH_PORTS[name]}, (dep, name, probe)
            assert "grpc" not in c[probe]
        assert c["startupProbe"]["failureThreshold"] == 120  # model loading: the timing is kept


def test_without_tls_nothing_changes(owner):
    objs = build_all(parse_spec({"topology": "split"}), owner, "ns1", {}, "x")
    for c in _containers(objs).values():
        assert "--health-port" not in c["args"] and not any("tls" in a for a in c["args"])
        assert "grpc" in c["livenessProbe"]


@pytest.mark.parametrize("issuer", [None, ("ClusterIssuer", "corp-ca")])
def test_cert_manager_objects(owner, issuer):
    objs = build_cert_manager_objects(owner, "ns1", 30, issuer)
    leaf = objs[-1]
    assert (leaf["kind"], leaf["spec"]["secretName"]) == ("Certificate", "demo-tls")
    assert set(leaf["spec"]["usages"]) >= {"server auth", "client auth"}
    assert (leaf["spec"]["duration"], leaf["spec"]["renewBefore"]) == ("720h", "240h")
    assert "demo-prefill.ns1.svc" in leaf["spec"]["dnsNames"] and leaf["spec"]["ipAddresses"] == ["127.0.0.1"]
    for o in objs:
        assert o["metadata"]["ownerReferences"][0]["uid"] == "0000-1111"
    if issuer is None:
        assert [o["kind"] for o in objs] == ["Issuer", "Certificate", "Issuer", "Certificate"]
        assert objs[1]["spec"]["isCA"] is True and leaf["spec"]["issuerRef"]["name"] == "demo-tls-ca"
    else:
        assert len(objs) == 1 and leaf["spec"]["issuerRef"] == {
            "group": "cert-manager.io",
            "kind": "ClusterIssuer",
            "name": "corp-ca",
        }


class FakeKube:
    def __init__(self, served=False, secrets=None):
        self.served, self.secrets = served, dict(secrets or {})

    def request(self, method, path, *a, **k):
        assert path == "/apis/cert-manager.io/v1"
        return {"resources": [{"name": "certificates"}]} if self.served else None

    def get(self, kind, namespace, name):
        return self.secrets.get(name)


@pytest.mark.parametrize(
    "mode, served, want",
    [
        ("off", True, None),
        ("operator", True, "operator"),
        ("auto", True, "cert-manager"),
        ("auto", False, "operator"),
        ("cert-manager", True, "cert-manager"),
    ],
)
def test_mode_from_what_the_api_serves(mode, served, want):
    got = resolve(FakeKube(served), mode, 30, None)
    assert (got.mode if got else None) == want


@pytest.mark.parametrize(
    "mode, days, issuer, says",
    [
        ("cert-manager", 30, None, "is cert-manager installed"),
        ("operator", 2, None, "--tls-cert-days"),
        ("auto", 30, "corp-ca", "Issuer/NAME"),
        ("operator", 30, "ClusterIssuer/x", "--tls-issuer needs cert-manager"),
    ],
)
def test_bad_tls_settings_are_named(mode, days, issuer, says):
    with pytest.raises(ValueError, match=says):
        resolve(FakeKube(False), mode, days, issuer)


def test_tls_objects_keep_live_secrets_and_give_control_the_ca(owner, issued):
    objs, why = tls_objects(FakeKube(), TlsSettings("operator"), owner, "ns1", NOW)
    assert why == "issued a new CA" and [o["metadata"]["name"] for o in objs] == ["demo-tls-ca", "demo-tls"]
    live = {o["metadata"]["name"]: o for o in objs}
    again, why = tls_objects(FakeKube(secrets=live), TlsSettings("operator"), owner, "ns1", NOW + DAY)
    assert why is None and again == objs  # applying them again changes nothing
    assert set(live["demo-tls"]["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert live["demo-tls"]["type"] == "kubernetes.io/tls" and "ca.key" not in live["demo-tls"]["data"]
    client = control_tls(FakeKube(secrets=live), "demo", "ns1")
    assert client.ca == base64.b64decode(live["demo-tls"]["data"]["ca.crt"])
    assert client.server_name == "demo-gateway-pods.ns1.svc" and client.cert is None
    assert control_tls(FakeKube(), "demo", "ns1") is None

"""TLS in Kubernetes against a real kube-apiserver (envtest): the real operator entry point, installed
by the chart with `tls.mode: auto` and running as the chart's service account.

Without cert-manager (auto -> operator): the config's CA and certificate Secrets appear, owned by
the config; the pods mount the certificate and get the TLS flags and the plaintext health ports;
a certificate near its expiry is re-issued by the same CA (only the Secret changes: the pods
reload the files). With cert-manager's API served (auto -> cert-manager): Certificate and Issuer
objects, owned by the config, instead. No pods run on envtest (nothing is mounted for real; the
reload itself is tested in tests/lanes/test_lanes_tls_layer.py, tests/serving/test_serving_lane_tls.py).
"""

from __future__ import annotations

import base64
import time

import kubernetes
import pytest
import yaml
from envtest import helm
from operator_helpers import CHART
from test_operator_envtest_operator import Operator, cr_path, events, wait_for

from verifypd_operator import tls_certs
from verifypd_operator.kube import Kube
from verifypd_operator.tls_manifests import CA_FILE, CERT_FILE, HEALTH_PORTS, KEY_FILE, dns_names

pytestmark = pytest.mark.live  # a real API server (envtest) (tests/README.md)

RELEASE, SYSTEM_NS, SA = "tlsop", "tlsop-sys", "tlsop-verifypd"
DAY = 86400.0
CONFIG = {
    "apiVersion": "verifypd.dev/v1alpha1",
    "kind": "VerifyPDConfig",
    "metadata": {"name": "llm"},
    "spec": {"topology": "split"},
}
# Just enough of cert-manager's CRDs for its API to be served (the operator only detects and writes).
CERT_MANAGER_CRDS = [
    {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.cert-manager.io"},
        "spec": {
            "group": "cert-manager.io",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }
    for kind, plural in (("Certificate", "certificates"), ("Issuer", "issuers"))
]


@pytest.fixture(scope="module")
def release(crds):
    rel = helm(crds, "install", RELEASE, SYSTEM_NS, str(CHART), values={"tls": {"mode": "auto"}})
    dep = next(d for d in yaml.safe_load_all(rel["manifest"]) if d and d["kind"] == "Deployment")
    yield dep["spec"]["template"]["spec"]["containers"][0]["args"]
    helm(crds, "uninstall", RELEASE, SYSTEM_NS)


@pytest.fixture(scope="module")
def admin(crds):
    return Kube(kubernetes.config.new_client_from_config(config_file=str(crds.kubeconfig)))


def _pem(secret, field):
    return base64.b64decode(secret["data"][field])


def _pods_use_tls(admin, ns, uid, ops):
    for unit in ("gateway", "prefill", "draft", "verify"):
        dep = wait_for(lambda unit=unit: admin.get("Deployment", ns, f"llm-{unit}"), f"{unit} Deployment", ops)
        pod = dep["spec"]["template"]["spec"]
        tls_volume = {"name": "tls", "secret": {"secretName": "llm-tls", "defaultMode": 420}}
        assert tls_volume in pod["volumes"], pod["volumes"]
        c = pod["containers"][0]
        assert {"name": "tls", "mountPath": "/var/run/verifypd/tls", "readOnly": True} in c["volumeMounts"]
        want = ["--lane-tls-ca-file", CA_FILE] if unit == "gateway" else ["--tls-ca-file", CA_FILE]
        assert all(a in c["args"] for a in [CERT_FILE, KEY_FILE, *want]), c["args"]
        port = HEALTH_PORTS["gateway" if unit == "gateway" else unit]
        assert c["args"][c["args"].index("--health-port") + 1] == str(port)
        assert c["readinessProbe"]["httpGet"]["port"] == port and "grpc" not in c["livenessProbe"]


def test_operator_issues_mounts_and_renews_certificates(envtest, release, admin, namespace, tmp_path):
    op = Operator(
        release, envtest.sa_kubeconfig(SYSTEM_NS, SA, tmp_path / "kubeconfig"), tmp_path / "op.log", "tlsop-0"
    )
    ops = [op]
    try:
        envtest.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(CONFIG))
        uid = admin.request("GET", cr_path(namespace, "llm"))["metadata"]["uid"]
        leaf = wait_for(lambda: admin.get("Secret", namespace, "llm-tls"), "certificate Secret", ops)
        ca = wait_for(lambda: admin.get("Secret", namespace, "llm-tls-ca"), "CA Secret", ops)
        for s in (leaf, ca):
            assert s["metadata"]["ownerReferences"][0]["uid"] == uid
        assert leaf["type"] == "kubernetes.io/tls" and set(leaf["data"]) == {"tls.crt", "tls.key", "ca.crt"}
        assert _pem(leaf, "ca.crt") == _pem(ca, "ca.crt")
        names = dns_names("llm", namespace)
        now = time.time()
        assert (
            tls_certs.renewal_reason(_pem(leaf, "tls.crt"), _pem(leaf, "tls.key"), _pem(ca, "ca.crt"), names, now)
            is None
        )
        _pods_use_tls(admin, namespace, uid, ops)
        assert "TLS: operator" in op.text()  # auto, and no cert-manager API: the operator issues

        # A certificate with 5 of its 30 days left (as if issued 25 days ago): re-issued by the same
        # CA on a timer tick; only the Secret changes.
        old_key, old_cert = tls_certs.new_leaf(_pem(ca, "ca.key"), _pem(ca, "ca.crt"), names, now - 25 * DAY, 30)
        dep_before = admin.get("Deployment", namespace, "llm-verify")["metadata"]["generation"]
        admin.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/secrets/llm-tls",
            {"data": {"tls.crt": base64.b64encode(old_cert).decode(), "tls.key": base64.b64encode(old_key).decode()}},
            content_type="application/merge-patch+json",
        )
        renewed = wait_for(
            lambda: (
                (s := admin.get("Secret", namespace, "llm-tls"))
                and _pem(s, "tls.crt") not in (old_cert, _pem(leaf, "tls.crt"))
                and s
            ),
            "renewal",
            ops,
        )
        assert (
            tls_certs.renewal_reason(
                _pem(renewed, "tls.crt"), _pem(renewed, "tls.key"), _pem(ca, "ca.crt"), names, time.time()
            )
            is None
        )
        assert _pem(renewed, "ca.crt") == _pem(ca, "ca.crt")  # same CA: peers keep trusting each other
        wait_for(
            lambda: any(e["reason"] == "CertificateRenewed" for e in events(admin, namespace, "llm")),
            "CertificateRenewed event",
            ops,
        )
        assert admin.get("Deployment", namespace, "llm-verify")["metadata"]["generation"] == dep_before

        admin.request("DELETE", cr_path(namespace, "llm"))
        wait_for(lambda: admin.get("Secret", namespace, "llm-tls-ca") is None, "CA Secret deleted with the config", ops)
        assert op.tracebacks() == [], op.text()[-4000:]
    finally:
        op.stop()


def test_cert_manager_is_detected_and_used(envtest, release, admin, namespace, tmp_path):
    for crd in CERT_MANAGER_CRDS:
        envtest.kubectl("apply", "-f", "-", input=yaml.safe_dump(crd))
    envtest.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        *[f"crd/{c['metadata']['name']}" for c in CERT_MANAGER_CRDS],
    )
    op = Operator(
        release, envtest.sa_kubeconfig(SYSTEM_NS, SA, tmp_path / "kubeconfig"), tmp_path / "op.log", "tlsop-1"
    )
    ops = [op]
    try:
        envtest.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(CONFIG))
        uid = admin.request("GET", cr_path(namespace, "llm"))["metadata"]["uid"]
        certs = f"/apis/cert-manager.io/v1/namespaces/{namespace}/certificates"
        leaf = wait_for(lambda: admin.request("GET", f"{certs}/llm-tls"), "Certificate llm-tls", ops)
        assert leaf["metadata"]["ownerReferences"][0]["uid"] == uid
        assert leaf["spec"]["secretName"] == "llm-tls" and "client auth" in leaf["spec"]["usages"]
        assert leaf["spec"]["issuerRef"]["name"] == "llm-tls-ca"
        issuers = admin.request("GET", f"/apis/cert-manager.io/v1/namespaces/{namespace}/issuers")["items"]
        assert sorted(i["metadata"]["name"] for i in issuers) == ["llm-tls-ca", "llm-tls-selfsigned"]
        _pods_use_tls(admin, namespace, uid, ops)
        assert admin.get("Secret", namespace, "llm-tls-ca") is None  # cert-manager's job, not ours
        assert "TLS: cert-manager (cert-manager detected)" in op.text()
        admin.request("DELETE", cr_path(namespace, "llm"))
        wait_for(lambda: admin.request("GET", f"{certs}/llm-tls") is None, "Certificate deleted with the config", ops)
        assert op.tracebacks() == [], op.text()[-4000:]
    finally:
        op.stop()
        for crd in CERT_MANAGER_CRDS:
            envtest.kubectl("delete", "crd", crd["metadata"]["name"], check=False)

"""The Helm chart against a real kube-apiserver (envtest): `helm install`, `upgrade` and
`uninstall` through the Helm library with every rendered object stored by the server, and the
chart's RBAC checked as its service account (impersonation: `kubectl auth can-i --as`)."""

from __future__ import annotations

import json

import pytest
import yaml
from envtest import helm
from operator_helpers import CHART

pytestmark = pytest.mark.live  # a real API server (envtest) (tests/README.md)

CRDS = ("verifypdconfigs.verifypd.dev", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")


def can_i(cluster, sa: str, verb: str, resource: str, namespace: str | None = None, name: str = "") -> bool:
    args = ["auth", "can-i", f"--as={sa}", verb, resource + (f"/{name}" if name else "")]
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    res = cluster.kubectl(*args, check=False)
    assert res.stdout.strip() in ("yes", "no"), res.stderr
    return res.stdout.strip() == "yes"


def live(cluster, *args):
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def rendered(rel):
    return [d for d in yaml.safe_load_all(rel["manifest"]) if d]


@pytest.fixture(scope="module")
def fresh_crds(envtest):
    """No CRDs before the first install, so that `helm install` itself creates them."""
    envtest.kubectl("delete", "crd", *CRDS, "--ignore-not-found", "--wait", "--timeout=60s")
    return envtest


def test_install_upgrade_uninstall_cluster_wide(fresh_crds):
    k = fresh_crds
    rel = helm(k, "install", "vpd", "verifypd", str(CHART))
    assert rel["info"]["status"] == "deployed"
    k.kubectl("wait", "--for=condition=Established", "--timeout=30s", *(f"crd/{c}" for c in CRDS))
    for d in rendered(rel):  # every rendered object is stored, in the namespace it names
        ns = d["metadata"].get("namespace")
        live(k, d["kind"].lower(), d["metadata"]["name"], *(["-n", ns] if ns else []))
    sa = "system:serviceaccount:verifypd:vpd-verifypd"
    for verb, res in [
        ("watch", "verifypdconfigs.verifypd.dev"),
        ("patch", "verifypdconfigs.verifypd.dev/status"),
        ("create", "deployments.apps"),
        ("delete", "services"),
        ("create", "events"),
        ("create", "secrets"),
        ("patch", "secrets"),
        ("create", "networkpolicies.networking.k8s.io"),
        ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ]:
        assert can_i(k, sa, verb, res), (verb, res)
    for verb, res in [
        ("watch", "secrets"),
        ("update", "secrets"),
        ("get", "configmaps"),
        ("create", "pods"),
        ("delete", "namespaces"),
        ("update", "customresourcedefinitions.apiextensions.k8s.io"),
        ("create", "verifypdconfigs.verifypd.dev"),
        ("list", "clusterkopfpeerings.kopf.dev"),
    ]:
        assert not can_i(k, sa, verb, res), (verb, res)

    # Upgrade to two replicas: kopf peering. kopf lists and watches the peering collection, so
    # those verbs cannot be limited by resourceNames; patch stays limited to the chart's object.
    rel = helm(k, "upgrade", "vpd", "verifypd", str(CHART), {"operator": {"replicas": 2, "tickSeconds": 2}})
    assert rel["version"] == 2
    dep = live(k, "deployment", "vpd-verifypd", "-n", "verifypd")
    assert dep["spec"]["replicas"] == 2
    assert "--peering-name=vpd-verifypd" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    live(k, "clusterkopfpeering", "vpd-verifypd")
    for verb in ("list", "watch"):
        assert can_i(k, sa, verb, "clusterkopfpeerings.kopf.dev")
    assert can_i(k, sa, "patch", "clusterkopfpeerings.kopf.dev", name="vpd-verifypd")
    assert not can_i(k, sa, "patch", "clusterkopfpeerings.kopf.dev", name="someone-else")

    helm(k, "uninstall", "vpd", "verifypd")
    for kind, name in [
        ("deployment", "vpd-verifypd"),
        ("clusterrole", "vpd-verifypd-cluster"),
        ("clusterkopfpeering", "vpd-verifypd"),
        ("serviceaccount", "vpd-verifypd"),
    ]:
        res = k.kubectl("get", kind, name, "-n", "verifypd", check=False)
        assert "NotFound" in res.stderr, (kind, res.stdout)
    live(k, "crd", CRDS[0])  # Helm keeps crds/ (and with them every user's configs)


def test_namespaced_install_with_default_config(fresh_crds):
    k = fresh_crds
    for ns in ("team-a", "team-b"):
        k.kubectl("create", "namespace", ns)
    values = {
        "operator": {"replicas": 2, "watchNamespaces": ["team-a", "team-b"]},
        "defaultConfig": {"create": True, "name": "llm", "spec": {"topology": "split"}},
    }
    helm(k, "install", "ns", "verifypd-ns", str(CHART), values)
    # The default config lands where the operator looks: the first watched namespace.
    cfg = live(k, "vpd", "llm", "-n", "team-a")
    assert cfg["spec"]["topology"] == "split" and cfg["spec"]["lanes"]["verify"]["maxReplicas"] == 4
    sa = "system:serviceaccount:verifypd-ns:ns-verifypd"
    for ns in ("team-a", "team-b"):
        live(k, "kopfpeering", "ns-verifypd", "-n", ns)
        assert can_i(k, sa, "create", "deployments.apps", ns)
        assert can_i(k, sa, "list", "kopfpeerings.kopf.dev", ns)
        assert can_i(k, sa, "patch", "kopfpeerings.kopf.dev", ns, name="ns-verifypd")
    for ns in ("kube-system", "default", "verifypd-ns"):
        assert not can_i(k, sa, "create", "deployments.apps", ns)
        assert not can_i(k, sa, "delete", "services", ns)
    with pytest.raises(RuntimeError, match="defaultConfig.namespace"):
        helm(
            k,
            "install",
            "bad",
            "verifypd-bad",
            str(CHART),
            {"operator": {"watchNamespaces": ["team-a"]}, "defaultConfig": {"create": True, "namespace": "team-b"}},
        )
    helm(k, "uninstall", "ns", "verifypd-ns")

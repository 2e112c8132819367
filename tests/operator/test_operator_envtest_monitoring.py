"""The chart with monitoring on against a real kube-apiserver (envtest): the Prometheus Operator's
CRDs (the minimal ones of prometheus_operator_crds.yaml) applied first, then `helm install` with
the ServiceMonitor, PrometheusRule, dashboard and PodDisruptionBudgets on: every rendered object
is accepted and stored by the server (its CRD schema for the monitoring kinds, policy/v1 for the
budgets), and `helm uninstall` removes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from envtest import helm
from operator_helpers import CHART

pytestmark = pytest.mark.live  # a real API server (envtest) (tests/README.md)

CRDS = Path(__file__).with_name("prometheus_operator_crds.yaml")


def test_install_with_monitoring_on(envtest):
    k = envtest
    k.kubectl("apply", "-f", str(CRDS))
    names = [c["metadata"]["name"] for c in yaml.safe_load_all(CRDS.read_text())]
    k.kubectl("wait", "--for=condition=Established", "--timeout=30s", *(f"crd/{n}" for n in names))
    for ns in ("mon-release", "mon-team"):
        k.kubectl("create", "namespace", ns, check=False)
    values = {
        "operator": {"watchNamespaces": ["mon-team"]},
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "prometheusRule": {"enabled": True},
            "dashboard": {"enabled": True},
        },
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%"},
    }
    rel = helm(k, "install", "vpdmon", "mon-release", str(CHART), values)
    assert rel["info"]["status"] == "deployed"
    rendered = [d for d in yaml.safe_load_all(rel["manifest"]) if d]
    kinds = {d["kind"] for d in rendered}
    assert {"ServiceMonitor", "PrometheusRule", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for d in rendered:  # stored as rendered, in the namespace it names
        ns = d["metadata"].get("namespace")
        live = json.loads(
            k.kubectl("get", d["kind"].lower(), d["metadata"]["name"], *(["-n", ns] if ns else []), "-o", "json").stdout
        )
        if d["kind"] in ("ServiceMonitor", "PrometheusRule", "PodDisruptionBudget"):
            assert live["spec"] == d["spec"], d["kind"]  # nothing pruned: every field is in the schema
    rule = json.loads(
        k.kubectl("get", "prometheusrule", "vpdmon-verifypd-slo", "-n", "mon-release", "-o", "json").stdout
    )
    assert len([r for g in rule["spec"]["groups"] for r in g["rules"]]) == 8
    pdbs = json.loads(k.kubectl("get", "pdb", "-n", "mon-team", "-o", "json").stdout)["items"]
    assert sorted(p["metadata"]["name"] for p in pdbs) == [
        "vpdmon-verifypd-draft-lanes",
        "vpdmon-verifypd-gateways",
        "vpdmon-verifypd-prefill-lanes",
        "vpdmon-verifypd-verify-lanes",
    ]
    helm(k, "uninstall", "vpdmon", "mon-release")
    assert not json.loads(k.kubectl("get", "servicemonitor", "-n", "mon-release", "-o", "json").stdout)["items"]
    assert not json.loads(k.kubectl("get", "pdb", "-n", "mon-team", "-o", "json").stdout)["items"]

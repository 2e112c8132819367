"""The chart's monitoring: ServiceMonitor, PrometheusRule, the Grafana dashboard ConfigMap and the
PodDisruptionBudgets, rendered by a real `helm install` (kmock's API emulator), validated (core
kinds against Kubernetes' schemas; the Prometheus Operator kinds against their CRD schemas,
closed: no field outside them), and checked against the product: the ServiceMonitor selects the
one metrics Service the operator labels per config, and every series a rule or panel queries is
one the gateways' /metrics serves, with SLO bounds that are real bucket labels."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from operator_helpers import K8S_VERSION
from test_operator_chart import install, manifests

from verifypd.core.serving_metrics import ITL_BUCKETS, TTFT_BUCKETS
from verifypd.domain import metric_names as mn

CRDS = Path(__file__).with_name("prometheus_operator_crds.yaml")
ON = {
    "operator": {"watchNamespaces": ["team-a", "team-b"]},
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True, "ttftBucket": "0.5", "itlBucket": "0.05", "objective": 0.99},
        "dashboard": {"enabled": True, "namespace": "monitoring"},
    },
    "podDisruptionBudget": {"enabled": True},
}
SERVED = {
    getattr(mn, n)
    for n in dir(mn)
    if n.startswith(("VLLM_", "PREEMPTED", "ACCEPTANCE", "LANE_RESTARTS", "REQUEST_ERR"))
} | {"verifypd_lane_step_duration_seconds"}  # the OTel instrument's Prometheus name


def closed(schema):
    """A CRD's openAPIV3Schema as JSON Schema with every object closed (strict: a field the CRD
    does not declare is an error here, where the API server would silently prune it)."""
    s = copy.deepcopy(schema)
    if s.pop("x-kubernetes-int-or-string", False):
        return {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    if s.get("type") == "object" and "properties" in s:
        s["additionalProperties"] = False
        s["properties"] = {k: closed(v) for k, v in s["properties"].items()}
    if "items" in s:
        s["items"] = closed(s["items"])
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = closed(s["additionalProperties"])
    return s


def crd_schemas() -> dict[str, dict]:
    return {
        c["spec"]["names"]["kind"]: closed(c["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        for c in yaml.safe_load_all(CRDS.read_text())
    }


def series_in(expr: str) -> set[str]:
    """Metric names a PromQL expression reads, histogram and counter suffixes taken off."""
    names = set(re.findall(r"\b(vllm:[a-z0-9_:]+|verifypd_[a-z0-9_]+)(?=[{[])", expr))  # selectors, not labels
    return {re.sub(r"(_bucket|_count|_sum|_total)$", "", n) for n in names}


@pytest.fixture(scope="module")
def rendered():
    rel, _ = install(ON)
    docs, _ = manifests(rel)
    by_kind: dict[str, list] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    return by_kind


def test_objects_render_and_validate(rendered):
    schemas = crd_schemas()
    for kind in ("ServiceMonitor", "PrometheusRule"):
        (obj,) = rendered[kind]
        jsonschema.validate(obj, schemas[kind])
    assert rendered["ServiceMonitor"][0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for d in rendered["PodDisruptionBudget"] + rendered["ConfigMap"]:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    # Per watched namespace: gateways (gateway or colocated pods) and each lane.
    pdbs = rendered["PodDisruptionBudget"]
    assert sorted((p["metadata"]["namespace"], p["metadata"]["name"]) for p in pdbs) == sorted(
        (ns, f"vpd-verifypd-{g}")
        for ns in ("team-a", "team-b")
        for g in ("gateways", "prefill-lanes", "draft-lanes", "verify-lanes")
    )
    gw = next(p for p in pdbs if p["metadata"]["name"].endswith("gateways"))
    assert gw["spec"]["maxUnavailable"] == 1
    assert gw["spec"]["selector"]["matchExpressions"][0]["values"] == ["gateway", "colocated"]
    sm = rendered["ServiceMonitor"][0]["spec"]
    assert sm["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert sm["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s", "scheme": "http"}]


@pytest.mark.parametrize("topology", ["colocated", "split"])
def test_service_monitor_selects_one_metrics_service_per_config(rendered, topology, owner):
    from verifypd_operator.builders import build_services
    from verifypd_operator.spec import parse_spec

    wanted = rendered["ServiceMonitor"][0]["spec"]["selector"]["matchLabels"]
    services = build_services(parse_spec({"topology": topology}), owner, "team-a")
    hits = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in hits] == ["demo-gateway-pods"]
    assert "http" in [p["name"] for p in hits[0]["spec"]["ports"]]


def test_rules_and_panels_query_served_series_with_real_bucket_bounds(rendered):
    rules = [r for g in rendered["PrometheusRule"][0]["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {
        "VerifyPDTTFTSLOBurnCritical",
        "VerifyPDTTFTSLOBurnWarning",
        "VerifyPDITLSLOBurnCritical",
        "VerifyPDITLSLOBurnWarning",
        "VerifyPDErrorRate",
        "VerifyPDLaneRestarts",
        "VerifyPDLaneCrashLoop",
        "VerifyPDKVCacheSaturated",
    }
    ttft = next(r for r in rules if r["alert"] == "VerifyPDTTFTSLOBurnCritical")["expr"]
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.5"}' in ttft and "> 0.144" in ttft  # 14.4 x (1 - 0.99)
    (cm,) = rendered["ConfigMap"]
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["verifypd.json"])
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for expr in exprs:
        assert series_in(expr) and series_in(expr) <= SERVED, expr
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    # The values' bucket choices are the bounds /metrics labels its buckets with.
    schema = json.loads((Path(__file__).parents[2] / "helm/verifypd/values.schema.json").read_text())
    rule_props = schema["properties"]["monitoring"]["properties"]["prometheusRule"]["properties"]
    assert rule_props["ttftBucket"]["enum"] == [str(float(b)) for b in TTFT_BUCKETS]
    assert rule_props["itlBucket"]["enum"] == [str(float(b)) for b in ITL_BUCKETS]


def test_off_by_default():
    docs, _ = manifests(install()[0])
    assert not {"ServiceMonitor", "PrometheusRule", "PodDisruptionBudget", "ConfigMap"} & {d["kind"] for d in docs}

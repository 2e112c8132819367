"""Every manifest the operator builds validates against a current Kubernetes schema, and carries
the contract (owner refs, OTel env, probes, GPU sharing)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from operator_helpers import K8S_VERSION

from verifypd_operator.builders import build_all, otel_env
from verifypd_operator.spec import parse_spec

VARIANTS = {
    "colocated": {},
    "colocated-dra": {"colocated": {"gpuSharing": "dra", "gpu": 1}},
    "split": {"topology": "split", "lanes": {"verify": {"replicas": 2, "maxReplicas": 4, "gpu": 1,
                                                        "resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}}},
    "split-pvc": {"topology": "split", "model": {"target": "/models/llama", "draft": "/models/tiny",
                                                 "pvcName": "models"}},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_manifests_validate(variant, owner):
    objs = build_all(parse_spec(VARIANTS[variant]), owner, "default", {}, "http://otlp:4317")
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        refs = o["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "verifypd.dev/v1alpha1", "kind": "VerifyPDConfig", "name": "demo",
                         "uid": "0000-1111", "controller": True, "blockOwnerDeletion": True}]
        assert o["metadata"]["name"].startswith("demo")


def test_validator_rejects_a_broken_manifest(owner):
    dep = build_all(parse_spec({}), owner, "default", {}, "x")[0]
    dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def _deps(objs):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}


def test_colocated_pod_shares_one_gpu_and_namespaces(owner):
    objs = build_all(parse_spec({}), owner, "ns1", {"colocated": 3}, "http://otlp:4317")
    dep = _deps(objs)["demo-colocated"]
    assert dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    names = [c["name"] for c in pod["containers"]]
    assert names == ["gateway", "prefill", "draft", "verify"]
    gpu = {c["name"]: c["resources"].get("limits", {}).get("nvidia.com/gpu") for c in pod["containers"]}
    assert gpu == {"gateway": None, "prefill": None, "draft": None, "verify": 1}  # one allocation
    for c in pod["containers"]:
        assert c["readinessProbe"]["grpc"]["port"] == c["ports"][0]["containerPort"]
        if c["name"] in ("prefill", "draft"):
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
            assert "CUDA_VISIBLE_DEVICES" in c["command"][2]
    gw = pod["containers"][0]["args"]
    assert gw[:5] == ["serve", "--port", "50051", "--topology", "colocated"]
    assert "localhost:50063" in gw
    assert {s["metadata"]["name"] for s in objs if s["kind"] == "Service"} == {"demo", "demo-gateway-pods"}


def test_dra_claim_shared_by_every_lane(owner):
    objs = build_all(parse_spec(VARIANTS["colocated-dra"]), owner, "ns1", {}, "x")
    pod = _deps(objs)["demo-colocated"]["spec"]["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "demo-gpu"}]
    lanes = [c for c in pod["containers"] if c["name"] != "gateway"]
    assert all(c["resources"]["claims"] == [{"name": "gpu"}] for c in lanes)
    assert any(o["kind"] == "ResourceClaimTemplate" for o in objs)


def test_split_topology_wires_gateway_to_lane_services(owner):
    objs = build_all(parse_spec(VARIANTS["split"]), owner, "ns1", {"verify": 3}, "x")
    deps = _deps(objs)
    assert set(deps) == {"demo-gateway", "demo-prefill", "demo-draft", "demo-verify"}
    assert deps["demo-verify"]["spec"]["replicas"] == 3
    args = deps["demo-gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--verify-addr") + 1] == "demo-verify.ns1.svc:50051"
    lane = deps["demo-draft"]["spec"]["template"]["spec"]["containers"][0]
    assert lane["args"][:2] == ["lane", "draft"] and lane["resources"]["limits"]["nvidia.com/gpu"] == 1
    svcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    assert svcs["demo-verify"]["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in svcs["demo"]["spec"]


def test_otel_env_contract():
    env = otel_env("demo", "ns1", "http://op:4317", "svc")
    assert env[0]["name"] == "POD_NAME"  # must precede its $(POD_NAME) use
    vals = {e["name"]: e.get("value") for e in env}
    assert vals["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://op:4317"
    assert vals["OTEL_RESOURCE_ATTRIBUTES"] == \
        "verifypd.config.name=demo,k8s.namespace.name=ns1,k8s.pod.name=$(POD_NAME)"


def test_every_container_listens_on_the_pod_ip(owner):
    """Servers default to 127.0.0.1; Services and kubelet gRPC probes need the pod IP."""
    for topology in ("colocated", "split"):
        for manifest in build_all(parse_spec({"topology": topology}), owner, "default", {}, "http://otlp:4317"):
            if manifest["kind"] != "Deployment":
                continue
            for c in manifest["spec"]["template"]["spec"]["containers"]:
                assert {"name": "VERIFYPD_HOST", "value": "0.0.0.0"} in c["env"], (topology, c["name"])

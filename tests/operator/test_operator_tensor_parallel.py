"""`tensorParallel`: the CRD field on colocated / lanes.verify / lanes.prefill, the pods the
operator builds for it (one `serve --tensor-parallel N` container requesting the GPUs), and the API
server's own validation of the field (envtest): gpu >= tensorParallel, split lanes refused."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml
from operator_helpers import K8S_VERSION

from verifypd_operator.builders import build_all
from verifypd_operator.spec import parse_spec

TP_COLOCATED = {
    "colocated": {"gpu": 2, "tensorParallel": 2},
    "model": {"target": "/models/llama-70b", "draft": "/models/tiny", "pvcName": "models"},
}


def _pod(objs, name="demo-colocated"):
    dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == name)
    return dep["spec"]["template"]["spec"]


@pytest.mark.parametrize("sharing", ["devicePlugin", "dra"])
def test_colocated_tensor_parallel_pod_runs_one_serve_container_on_all_its_gpus(owner, sharing):
    from verifypd.cli import build_parser

    spec = parse_spec({**TP_COLOCATED, "colocated": {**TP_COLOCATED["colocated"], "gpuSharing": sharing}})
    assert spec.colocated.tensor_parallel == 2
    objs = build_all(spec, owner, "ns1", {"colocated": 2}, "http://otlp:4317", lane_secret="s" * 64)
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    pod = _pod(objs)
    assert [c["name"] for c in pod["containers"]] == ["serve"]
    c = pod["containers"][0]
    if sharing == "dra":
        assert c["resources"]["claims"] == [{"name": "gpu"}]
        claim = next(o for o in objs if o["kind"] == "ResourceClaimTemplate")
        assert claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 2
    else:
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    args = build_parser().parse_args(c["args"])  # the flags the real CLI accepts
    assert (args.command, args.topology, args.tensor_parallel, args.device) == ("serve", "colocated", 2, "cuda")
    assert args.verify_addr is None and args.target == "/models/llama-70b"  # lanes in process: no --*-addr
    assert {p["name"] for p in c["ports"]} == {"grpc", "http"}
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/dev/shm", "/models"}  # NCCL uses /dev/shm
    assert {s["metadata"]["name"] for s in objs if s["kind"] == "Service"} == {"demo", "demo-gateway-pods"}


def test_tensor_parallel_1_keeps_the_four_container_pod(owner):
    pod = _pod(build_all(parse_spec({"colocated": {"gpu": 2}}), owner, "ns1", {}, "x"))
    assert [c["name"] for c in pod["containers"]] == ["gateway", "prefill", "draft", "verify"]
    assert not any("--tensor-parallel" in c["args"] for c in pod["containers"])


def test_split_lane_builder_passes_tensor_parallel(owner):
    """Refused by the CRD for now (split lane pods copy KV, sharded KV is imported only), but built as
    it will run: `verifypd lane verify --tensor-parallel 4` works on one host (tests/lanes)."""
    spec = parse_spec({"topology": "split", "lanes": {"verify": {"gpu": 4, "tensorParallel": 4}}})
    objs = build_all(spec, owner, "ns1", {}, "x")
    verify = _pod(objs, "demo-verify")["containers"][0]
    assert verify["args"][verify["args"].index("--tensor-parallel") + 1] == "4"
    assert verify["resources"]["limits"]["nvidia.com/gpu"] == 4
    prefill = _pod(objs, "demo-prefill")["containers"][0]
    assert "--tensor-parallel" not in prefill["args"]


def cr_yaml(spec, name="demo"):
    return yaml.safe_dump(
        {"apiVersion": "verifypd.dev/v1alpha1", "kind": "VerifyPDConfig", "metadata": {"name": name}, "spec": spec}
    )


def test_server_defaults_and_accepts_tensor_parallel(crds, namespace):
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=cr_yaml(TP_COLOCATED, "tp"))
    got = json.loads(crds.kubectl("get", "vpd", "tp", "-n", namespace, "-o", "json").stdout)["spec"]
    assert got["colocated"]["tensorParallel"] == 2
    assert got["lanes"]["verify"]["tensorParallel"] == 1 and got["lanes"]["prefill"]["tensorParallel"] == 1
    assert "tensorParallel" not in got["lanes"]["draft"]  # drafts are not sharded
    assert parse_spec(got).colocated.tensor_parallel == 2


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"colocated": {"gpu": 1, "tensorParallel": 2}}, "gpu must be at least tensorParallel"),
        ({"colocated": {"gpu": 8, "tensorParallel": 0}}, "should be greater than or equal to 1"),
        ({"colocated": {"gpu": 8, "tensorParallel": 9}}, "should be less than or equal to 8"),
        (
            {"topology": "split", "lanes": {"verify": {"gpu": 1, "tensorParallel": 2}}},
            "gpu must be at least tensorParallel",
        ),
        (
            {"topology": "split", "lanes": {"verify": {"gpu": 2, "tensorParallel": 2}}},
            "runs with topology colocated only",
        ),
        (
            {"topology": "split", "lanes": {"prefill": {"gpu": 2, "tensorParallel": 2}}},
            "runs with topology colocated only",
        ),
        ({"lanes": {"draft": {"tensorParallel": 2}}}, "unknown field"),
    ],
)
def test_bad_tensor_parallel_refused_by_the_server(crds, namespace, spec, message):
    res = crds.kubectl("apply", "--validate=strict", "-n", namespace, "-f", "-", input=cr_yaml(spec), check=False)
    assert res.returncode != 0, f"accepted: {spec}"
    assert message in res.stderr, res.stderr

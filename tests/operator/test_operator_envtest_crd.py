"""The CRD against a real kube-apiserver (envtest): it is accepted, the example and an empty spec
are stored with the server's defaults, and invalid specs and names are rejected with the CRD's
messages (the server's own CEL, schema and quantity checks, not a re-implementation)."""

from __future__ import annotations

import json

import pytest
import yaml
from operator_helpers import EXAMPLE

from verifypd_operator.spec import parse_spec

pytestmark = pytest.mark.live  # a real API server (envtest) (tests/README.md)


def cr_yaml(spec, name="demo"):
    return yaml.safe_dump(
        {"apiVersion": "verifypd.dev/v1alpha1", "kind": "VerifyPDConfig", "metadata": {"name": name}, "spec": spec}
    )


def test_example_applies_in_any_namespace_and_is_defaulted(crds, namespace):
    crds.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
    got = json.loads(crds.kubectl("get", "vpd", "smollm2", "-n", namespace, "-o", "json").stdout)
    example = yaml.safe_load(EXAMPLE.read_text())
    assert got["spec"]["slo"] == example["spec"]["slo"]
    assert got["spec"]["lanes"]["verify"]["maxReplicas"] == 4  # a server-side default
    assert parse_spec(got["spec"]).colocated.resources == {"requests": {"cpu": "2", "memory": "8Gi"}}


def test_empty_spec_gets_the_same_defaults_as_the_parser(crds, namespace):
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=cr_yaml({}, "empty"))
    got = json.loads(crds.kubectl("get", "vpd", "empty", "-n", namespace, "-o", "json").stdout)
    assert parse_spec(got["spec"]) == parse_spec({})
    crds.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=yaml.safe_dump(
            {"apiVersion": "verifypd.dev/v1alpha1", "kind": "VerifyPDConfig", "metadata": {"name": "nospec"}}
        ),
    )
    got = json.loads(crds.kubectl("get", "vpd", "nospec", "-n", namespace, "-o", "json").stdout)
    assert parse_spec(got["spec"]) == parse_spec({})


@pytest.mark.parametrize(
    "spec, name, message",
    [
        ({"speculation": {"kMin": 5, "kInitial": 4, "kMax": 8}}, "demo", "kMin <= kInitial <= kMax"),
        ({"speculation": {"kMin": 1, "kInitial": 4, "kMax": 3}}, "demo", "kMin <= kInitial <= kMax"),
        ({"lanes": {"verify": {"replicas": 1, "minReplicas": 3, "maxReplicas": 2}}}, "demo", "within minReplicas"),
        ({"colocated": {"replicas": 5}}, "demo", "within minReplicas"),
        ({"slo": {"ttftP95Ms": 0}}, "demo", "SLOs must be positive"),
        ({"prefillTokenBudget": 8192}, "demo", "must not exceed prefillTokenBudgetMax"),
        ({"topology": "mesh"}, "demo", 'supported values: "colocated", "split"'),
        ({"colocated": {"resources": {"requests": {"cpu": "banana"}}}}, "demo", "should match"),
        ({"lanes": {"draft": {"resources": {"limits": {"memory": "8 GB"}}}}}, "demo", "should match"),
        ({"colocated": {"resources": {"requests": {"cpu": "1"}, "claimz": {}}}}, "demo", "unknown field"),
        ({"colocated": {"gpu": 2, "laneDevices": {"verify": 2}}}, "demo", "laneDevices must name GPUs below gpu"),
        ({"colocated": {"laneDevices": {"prefill": 1}}}, "demo", "laneDevices must name GPUs below gpu"),
        ({"kvTransport": "nvlink"}, "demo", 'supported values: "auto", "handle", "copy", "peer", "direct"'),
        ({}, "9lives", "name must be a DNS-1035 label"),
        ({}, "my.model", "name must be a DNS-1035 label"),
        ({}, "x" * 41, "at most 40 characters"),
    ],
)
def test_invalid_specs_are_rejected_by_the_server(crds, namespace, spec, name, message):
    res = crds.kubectl("apply", "--validate=strict", "-n", namespace, "-f", "-", input=cr_yaml(spec, name), check=False)
    assert res.returncode != 0, f"accepted: {spec} {name}"
    assert message in res.stderr, res.stderr


def test_valid_quantities_accepted(crds, namespace):
    spec = {
        "colocated": {
            "resources": {
                "requests": {"cpu": "500m", "memory": "8Gi", "ephemeral-storage": 10**9},
                "limits": {"cpu": 2, "memory": "1.5G"},
            }
        }
    }
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=cr_yaml(spec, "q"))


def test_lane_devices_within_the_pods_gpus_are_accepted(crds, namespace):
    spec = {"colocated": {"gpu": 2, "laneDevices": {"prefill": 0, "verify": 1, "draft": 1}}, "kvTransport": "peer"}
    crds.kubectl("apply", "--validate=strict", "-n", namespace, "-f", "-", input=cr_yaml(spec, "pd"))
    got = json.loads(crds.kubectl("get", "vpd", "pd", "-n", namespace, "-o", "json").stdout)
    assert parse_spec(got["spec"]).lane_devices == {"prefill": 0, "verify": 1, "draft": 1}

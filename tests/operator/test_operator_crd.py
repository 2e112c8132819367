"""The CRD: chart copy is current, it is a valid CRD, and its schema + CEL rules accept good specs
and reject bad ones (structural defaulting, OpenAPI checks and CEL evaluated like the API server)."""

from __future__ import annotations

import copy

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from operator_helpers import CRD_FILE, EXAMPLE, K8S_VERSION

from verifypd_operator.crd import build_crd
from verifypd_operator.spec import parse_spec


def _schema():
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema, value):
    """Structural-schema defaulting: fill missing properties with their defaults, recursively."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    return value


def _coerce(schema, value):
    """JSON numbers for `type: number` fields are doubles in CEL, even when written as 1000."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if schema.get("type") == "object" and isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: _coerce(props.get(k, {}), v) for k, v in value.items()}
    return value


def cel_errors(schema, value, path="self"):
    errs = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        prog = env.program(env.compile(rule["rule"]))
        ok = prog.evaluate({"self": celpy.json_to_cel(_coerce(schema, value))})
        if not bool(ok):
            errs.append(f"{path}: {rule['message']}")
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value and key != "metadata":
                errs += cel_errors(sub, value[key], f"{path}.{key}")
    return errs


def _openapi_to_jsonschema(s):
    if isinstance(s, dict):
        return {
            k: _openapi_to_jsonschema(v)
            for k, v in s.items()
            if not k.startswith("x-kubernetes") and k not in ("nullable", "default")
        }
    if isinstance(s, list):
        return [_openapi_to_jsonschema(v) for v in s]
    return s


def validate_cr(obj):
    """Errors the API server would report for `obj` (after defaulting), as messages."""
    schema = _schema()
    obj = apply_defaults(schema, copy.deepcopy(obj))
    v = jsonschema.Draft7Validator(_openapi_to_jsonschema(schema))
    errs = [e.message for e in v.iter_errors(obj)]
    return errs or cel_errors(schema, obj), obj


def cr(spec, name="demo"):
    return {
        "apiVersion": "verifypd.dev/v1alpha1",
        "kind": "VerifyPDConfig",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def test_chart_crd_is_generated_copy():
    assert yaml.safe_load(CRD_FILE.read_text()) == build_crd(), "regenerate: python -m verifypd_operator.crd > " + str(
        CRD_FILE
    )


def test_crd_is_a_valid_crd_and_structural():
    assert kubernetes_validate.validate(build_crd(), K8S_VERSION, strict=True)

    def walk(s, path):  # structural: every node typed unless it preserves unknown fields
        assert "type" in s or s.get("x-kubernetes-preserve-unknown-fields"), path
        for k, sub in s.get("properties", {}).items():
            walk(sub, f"{path}.{k}")
        if isinstance(s.get("items"), dict):
            walk(s["items"], f"{path}[]")

    walk(_schema(), "")


def test_printer_columns():
    cols = {c["name"]: c["jsonPath"] for c in build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert cols["K"] == ".status.applied.kMax"
    assert cols["Replicas"] == ".status.replicasText"
    assert "ttftP95Ms" in cols["TTFT-P95-MS"] and "itlP95Ms" in cols["ITL-P95-MS"]
    assert "Ready" in cols["Ready"]


def test_example_and_empty_spec_are_valid_and_defaults_match_parser():
    example = yaml.safe_load(EXAMPLE.read_text())
    errs, _ = validate_cr(example)
    assert errs == []
    errs, defaulted = validate_cr(cr({}))
    assert errs == []
    # The API server's defaults and the operator's parse of an empty spec agree.
    assert parse_spec(defaulted["spec"]) == parse_spec({})


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"speculation": {"kMin": 5, "kInitial": 4, "kMax": 8}}, "kMin <= kInitial <= kMax"),
        ({"speculation": {"kMin": 1, "kInitial": 9, "kMax": 8}}, "kMin <= kInitial <= kMax"),
        ({"lanes": {"verify": {"replicas": 5, "minReplicas": 1, "maxReplicas": 4}}}, "within minReplicas"),
        ({"colocated": {"replicas": 0, "minReplicas": 1}}, "within minReplicas"),
        ({"slo": {"ttftP95Ms": 0}}, "SLOs must be positive"),
        ({"slo": {"itlP95Ms": -5}}, "SLOs must be positive"),
        ({"prefillTokenBudget": 8192}, "must not exceed prefillTokenBudgetMax"),
        ({"priorities": {"prefill": 3, "verify": 1}}, "prefill priority"),
        ({"topology": "mesh"}, "is not one of"),
        ({"model": {"quantization": "int4"}}, "is not one of"),
        ({"speculation": {"kMax": 17}}, "greater than the maximum"),
    ],
)
def test_bad_specs_rejected(spec, message):
    errs, _ = validate_cr(cr(spec))
    assert any(message in e for e in errs), errs


def test_long_name_rejected():
    errs, _ = validate_cr(cr({}, name="x" * 41))
    assert any("at most 40" in e for e in errs)


def test_object_defaults_are_spelled_out():
    """The server validates a default's CEL rules without nested defaulting: `{}` would fail."""
    spec = _schema()["properties"]["spec"]
    assert spec["default"] == apply_defaults(spec, {})
    assert spec["default"]["speculation"] == {"kInitial": 4, "kMin": 0, "kMax": 8, "adaptive": True}
    assert cel_errors(spec, spec["default"]) == []

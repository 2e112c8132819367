"""The `VerifyPDConfig` CustomResourceDefinition, generated here and committed to the chart.

`python -m verifypd_operator.crd > helm/verifypd/crds/verifypdconfigs.verifypd.dev.yaml`
regenerates the chart's copy; a test fails when the two differ.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from verifypd.domain.defaults import DEFAULT_DRAFT, DEFAULT_K_INITIAL, DEFAULT_K_MAX, DEFAULT_K_MIN, DEFAULT_TARGET
from verifypd.domain.options import KV_CACHE_DTYPES, KV_TRANSPORTS, QUANTIZATIONS

from .spec import GATEWAY_RESOURCES, GROUP, KIND, PLURAL, VERSION

S = dict[str, Any]


def _int(default: int | None = None, minimum: int | None = None, maximum: int | None = None, desc: str = "") -> S:
    out: S = {"type": "integer"}
    for k, v in (("default", default), ("minimum", minimum), ("maximum", maximum)):
        if v is not None:
            out[k] = v
    if desc:
        out["description"] = desc
    return out


def _num(default: float, desc: str, minimum: float | None = None, maximum: float | None = None) -> S:
    out: S = {"type": "number", "default": default, "description": desc}
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    return out


def _str(default: str | None, desc: str, enum: list[str] | None = None, max_len: int = 253) -> S:
    out: S = {"type": "string", "description": desc, "maxLength": max_len}
    if default is not None:
        out["default"] = default
    if enum:
        out["enum"] = enum
    return out


# A resource.Quantity exactly as the core API declares it (int-or-string with this pattern), so
# `cpu: banana` is rejected when the CR is written, not when the operator creates the Deployment.
QUANTITY: S = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)"
    r"|(\.[0-9]+))))?$",
    "x-kubernetes-int-or-string": True,
}
RESOURCES: S = {
    "type": "object",
    "description": "cpu/memory requests and limits (core ResourceRequirements); GPUs are set with `gpu`.",
    "properties": {k: {"type": "object", "additionalProperties": QUANTITY} for k in ("requests", "limits")},
}
# Object names double as Service names (`<name>`, `<name>-gateway-pods`, ...): DNS-1035 labels of at
# most 63 characters, so the CR name must be a DNS-1035 label short enough for the longest suffix.
NAME_RE = "^[a-z]([-a-z0-9]*[a-z0-9])?$"


def _replicas(desc: str, gpu: int = 1) -> S:
    return {
        "type": "object",
        "description": desc,
        "default": {},
        "properties": {
            "replicas": _int(1, 0, 64, "initial replicas (the autoscaler then moves within min..max)"),
            "minReplicas": _int(1, 0, 64),
            "maxReplicas": _int(4, 1, 64),
            "gpu": _int(gpu, 0, 8, "nvidia.com/gpu per pod"),
            "resources": RESOURCES,
        },
        "x-kubernetes-validations": [
            {
                "rule": "self.minReplicas <= self.replicas && self.replicas <= self.maxReplicas",
                "message": "replicas must lie within minReplicas..maxReplicas",
            },
        ],
    }


def with_tensor_parallel(replicas: S, what: str) -> S:
    """Adds `tensorParallel` (the target's ranks, one GPU each: `--tensor-parallel`) to a pod group
    that runs the target; the pod must request at least that many GPUs."""
    replicas["properties"]["tensorParallel"] = _int(
        1,
        1,
        8,
        f"shard the target over this many GPUs of one pod ({what}; `--tensor-parallel`); must "
        "divide the target's heads, kv heads and intermediate size (the engine checks at load)",
    )
    replicas["x-kubernetes-validations"].append(
        {"rule": "self.gpu >= self.tensorParallel", "message": "gpu must be at least tensorParallel (one GPU per rank)"}
    )
    return replicas


# Split lane pods copy prefill KV between pods (kvTransport copy), and sharded KV is only ever imported
# rank by rank on one host (docs/engine.md "Tensor parallelism"): refused here, when the CR is written,
# rather than by a prefill lane refusing ImportPools at run time.
SPLIT_TENSOR_PARALLEL_RULE = {
    "rule": "self.topology == 'colocated' || (self.lanes.verify.tensorParallel == 1 && "
    "self.lanes.prefill.tensorParallel == 1)",
    "message": "tensorParallel > 1 runs with topology colocated only (split lane pods copy KV between pods, "
    "which a sharded target does not support yet)",
}


# Every named lane device must be one of the pod's GPUs, and the placement is for an unsharded target.
LANE_DEVICES_RULE = {
    "rule": "!has(self.laneDevices) || (self.tensorParallel == 1 && "
    + " && ".join(
        f"(!has(self.laneDevices.{lane}) || self.laneDevices.{lane} < self.gpu)"
        for lane in ("prefill", "draft", "verify")
    )
    + ")",
    "message": "laneDevices must name GPUs below gpu (the pod's GPUs) and needs tensorParallel 1",
}


def spec_schema() -> S:
    colocated = with_tensor_parallel(
        _replicas(
            "topology=colocated: pods each holding gateway + all three lanes on one GPU (with "
            "tensorParallel > 1: one container serving the target over that many GPUs)"
        ),
        "colocated pods",
    )
    colocated["properties"].update(
        gpuSharing=_str("devicePlugin", "how the lane containers share the pod's GPU", ["devicePlugin", "dra"]),
        draDeviceClass=_str("gpu.nvidia.com", "DeviceClass for gpuSharing=dra"),
        laneDevices={
            "type": "object",
            "description": "prefill/verify disaggregation inside the pod: the GPU (0..gpu-1 of the pod's) each "
            "lane runs on, e.g. {prefill: 0, verify: 1, draft: 1} with gpu: 2 (`--device cuda:N` per lane; "
            "KV moves by the peer transport over NVLink). Lanes not named run on GPU 0",
            "properties": {lane: _int(None, 0, 7) for lane in ("prefill", "draft", "verify")},
        },
    )
    colocated["x-kubernetes-validations"].append(LANE_DEVICES_RULE)
    gateway = _replicas(
        "the router/gateway (topology=split; its resources apply to the colocated pods' gateway container too)", gpu=0
    )
    gateway["properties"]["resources"] = {**RESOURCES, "default": GATEWAY_RESOURCES}
    return {
        "type": "object",
        "default": {},
        "properties": {
            "model": {
                "type": "object",
                "default": {},
                "properties": {
                    "target": _str(DEFAULT_TARGET, "target model: embedded name, HF cache name, local dir or .gguf"),
                    "draft": _str(
                        DEFAULT_DRAFT,
                        "draft: ngram | ngram:MIN-MAX (prompt lookup, no weights) | "
                        "self:N (the target's first N layers) | eagle:PATH (a feature "
                        "head; colocated) | eagle+ngram:PATH (that head mixed with prompt "
                        "lookup) | none | a draft model",
                    ),
                    "quantization": _str(
                        "none",
                        "fp8: the target's attention and MLP projections quantized to fp8 while loading "
                        "(`--quantization fp8`); published FP8 checkpoints load as fp8 either way",
                        ["none", *QUANTIZATIONS],
                    ),
                    "kvCacheDtype": _str(
                        "auto",
                        "the KV cache's element type (`--kv-cache-dtype`): auto = the model dtype; fp8 = "
                        "float8_e4m3fn, about twice the tokens in the same memory (GPUs of compute capability 8.9+)",
                        list(KV_CACHE_DTYPES),
                    ),
                    "pvcName": _str(None, "PVC mounted read-only at /models", max_len=63),
                },
            },
            "image": {
                "type": "object",
                "default": {},
                "properties": {
                    "repository": _str("ghcr.io/verifypd/verifypd", "service image"),
                    "tag": _str("0.1.0", "", max_len=128),
                    "pullPolicy": _str("IfNotPresent", "", ["Always", "IfNotPresent", "Never"]),
                },
            },
            "topology": _str(
                "colocated",
                "colocated: one pod per replica, lanes share a GPU by KV handle; split: a Deployment per lane",
                ["colocated", "split"],
            ),
            "kvTransport": _str(
                "auto",
                "KV transfer between lanes: handle (one GPU), peer (another GPU of the pod: per-layer copies "
                "over NVLink), direct (another GPU of the pod: KV written over NVLink, no staging pool), copy "
                "(over gRPC, between pods); auto picks among them",
                list(KV_TRANSPORTS),
            ),
            "gateway": gateway,
            "colocated": colocated,
            "lanes": {
                "type": "object",
                "default": {},
                "properties": {
                    lane: _replicas(f"{lane} lane Deployment (topology=split)")
                    if lane == "draft"
                    else with_tensor_parallel(_replicas(f"{lane} lane Deployment (topology=split)"), f"the {lane} lane")
                    for lane in ("prefill", "draft", "verify")
                },
            },
            "speculation": {
                "type": "object",
                "default": {},
                "properties": {
                    "kInitial": _int(DEFAULT_K_INITIAL, 0, 16, "draft length before acceptance is known"),
                    "kMin": _int(DEFAULT_K_MIN, 0, 16, "floor of the adaptive k and of the autoscaler's kMax"),
                    "kMax": _int(
                        DEFAULT_K_MAX,
                        0,
                        16,
                        "ceiling; with adaptive: false the autoscaler lowers it under ITL pressure",
                    ),
                    "adaptive": {"type": "boolean", "default": True},
                },
                "x-kubernetes-validations": [
                    {
                        "rule": "self.kMin <= self.kInitial && self.kInitial <= self.kMax",
                        "message": "speculation must satisfy kMin <= kInitial <= kMax",
                    }
                ],
            },
            "priorities": {
                "type": "object",
                "default": {},
                "properties": {
                    "draft": _int(2, -100, 100),
                    "verify": _int(1, -100, 100),
                    "prefill": _int(0, -100, 100),
                },
            },
            "prefillTokenBudget": _int(512, 16, 1 << 20, "prompt tokens prefilled per scheduling step"),
            "prefillTokenBudgetMax": _int(4096, 16, 1 << 20, "ceiling when the autoscaler raises the budget"),
            "slo": {
                "type": "object",
                "default": {},
                "properties": {
                    "ttftP95Ms": _num(1000.0, "time-to-first-token p95 objective, ms"),
                    "itlP95Ms": _num(100.0, "inter-token latency p95 objective, ms"),
                },
                "x-kubernetes-validations": [
                    {"rule": "self.ttftP95Ms > 0.0 && self.itlP95Ms > 0.0", "message": "SLOs must be positive"}
                ],
            },
            "autoscaling": {
                "type": "object",
                "default": {},
                "properties": {
                    "enabled": {"type": "boolean", "default": True},
                    "intervalSeconds": _int(30, 1, 3600, "evaluation period"),
                    "windowSeconds": _int(120, 5, 3600, "metrics window the p95s are computed over"),
                    "scaleUpCooldownSeconds": _int(60, 0, 86400),
                    "scaleDownCooldownSeconds": _int(300, 0, 86400),
                    "configCooldownSeconds": _int(30, 0, 86400, "between runtime config (k, priority) changes"),
                    "breachPeriods": _int(2, 1, 100, "consecutive breached evaluations before acting"),
                    "headroomPeriods": _int(3, 1, 100, "consecutive evaluations with headroom before relaxing"),
                    "headroomRatio": _num(0.7, "headroom = every p95 below this fraction of its SLO", 0.05, 0.99),
                    "minSamples": _int(20, 0, 1_000_000, "observations needed in the window to act"),
                    "staleAfterSeconds": _int(
                        20, 1, 3600, "hold when the newest telemetry is older than this (pods export every 5 s)"
                    ),
                },
            },
            "metrics": {
                "type": "object",
                "default": {},
                "properties": {
                    "prometheusScrape": {
                        "type": "boolean",
                        "default": False,
                        "description": "annotate gateway pods prometheus.io/scrape, port 8000, path /metrics",
                    },
                },
            },
        },
        "x-kubernetes-validations": [
            {
                "rule": "self.prefillTokenBudget <= self.prefillTokenBudgetMax",
                "message": "prefillTokenBudget must not exceed prefillTokenBudgetMax",
            },
            {
                "rule": "self.priorities.prefill <= self.priorities.verify",
                "message": "prefill priority must not exceed verify's (the autoscaler raises it at most to verify's)",
            },
            SPLIT_TENSOR_PARALLEL_RULE,
        ],
    }


def status_schema() -> S:
    free = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer"},
            "conditions": {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "items": {
                    "type": "object",
                    "required": ["type", "status"],
                    "properties": {
                        "type": {"type": "string"},
                        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                        "reason": {"type": "string"},
                        "message": {"type": "string"},
                        "lastTransitionTime": {"type": "string", "format": "date-time"},
                        "observedGeneration": {"type": "integer"},
                    },
                },
            },
            "observed": {
                "type": "object",
                "properties": {
                    "ttftP95Ms": {"type": "number", "nullable": True},
                    "itlP95Ms": {"type": "number", "nullable": True},
                    "samples": {"type": "integer"},
                    "acceptanceRate": {"type": "number", "nullable": True},
                    "queueDepth": {"type": "object", "additionalProperties": {"type": "number"}},
                    "windowSeconds": {"type": "integer"},
                    "time": {"type": "string"},
                },
            },
            "applied": {
                "type": "object",
                "properties": {
                    "kMin": {"type": "integer"},
                    "kMax": {"type": "integer"},
                    "kInitial": {"type": "integer"},
                    "adaptive": {"type": "boolean"},
                    "prefillTokenBudget": {"type": "integer"},
                    "priorities": {"type": "object", "additionalProperties": {"type": "integer"}},
                    "revision": {"type": "integer"},
                    "routersInSync": {"type": "integer"},
                    "routerErrors": {"type": "integer"},
                },
            },
            "replicas": {"type": "object", "additionalProperties": {"type": "integer"}},
            "replicasText": {"type": "string"},
            "lastDecision": {
                "type": "object",
                "properties": {
                    "action": {"type": "string"},
                    "reason": {"type": "string"},
                    "time": {"type": "string"},
                    "scales": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "unit": {"type": "string"},
                                "from": {"type": "integer"},
                                "to": {"type": "integer"},
                            },
                        },
                    },
                },
            },
            "autoscaler": free,
        },
    }


def materialize_defaults(schema: S) -> S:
    """Replace every object's `default: {}` by the object it stands for, nested defaults filled in.

    The API server validates a default as written, CEL rules included, *without* applying the
    nested defaults first: a rule like `self.kMin <= self.kMax` fails on `{}` ("no such key") and
    the whole CRD is rejected. Spelled-out defaults pass, and mean the same thing.
    """
    props = {k: materialize_defaults(v) for k, v in schema.get("properties", {}).items()}
    out = {**schema, "properties": props} if "properties" in schema else dict(schema)
    if out.get("type") == "object" and out.get("default") == {}:
        out["default"] = {k: v["default"] for k, v in props.items() if "default" in v}
    return out


def build_crd() -> S:
    cols = [
        ("Topology", "string", ".spec.topology"),
        ("K", "integer", ".status.applied.kMax"),
        ("Replicas", "string", ".status.replicasText"),
        ("TTFT-P95-MS", "number", ".status.observed.ttftP95Ms"),
        ("ITL-P95-MS", "number", ".status.observed.itlP95Ms"),
        ("Ready", "string", '.status.conditions[?(@.type=="Ready")].status'),
        ("Age", "date", ".metadata.creationTimestamp"),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "plural": PLURAL,
                "singular": KIND.lower(),
                "listKind": f"{KIND}List",
                "shortNames": ["vpd"],
                "categories": ["verifypd"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [{"name": n, "type": t, "jsonPath": p} for n, t, p in cols],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A verifypd serving deployment run and autoscaled by the verifypd operator.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": materialize_defaults(spec_schema()),
                                "status": status_schema(),
                            },
                            "x-kubernetes-validations": [
                                {
                                    "rule": "self.metadata.name.size() <= 40",
                                    "message": "name must be at most 40 characters (it prefixes Service names)",
                                },
                                {
                                    "rule": f"self.metadata.name.matches('{NAME_RE}')",
                                    "message": "name must be a DNS-1035 label (lowercase letters, digits and '-', "
                                    "starting with a letter, ending with a letter or digit): it names Services",
                                },
                            ],
                        }
                    },
                }
            ],
        },
    }


def main() -> None:
    sys.stdout.write("# Generated by `python -m verifypd_operator.crd`; do not edit.\n")
    yaml.safe_dump(build_crd(), sys.stdout, sort_keys=False, width=120)


if __name__ == "__main__":
    main()

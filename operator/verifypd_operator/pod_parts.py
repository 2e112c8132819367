"""The parts the operator's pods are made of: containers (ports, probes, env, resources, volumes),
the gateway's command line, and the Deployment around a pod spec.

Shared by every pod shape (builders: split and colocated; tensor_parallel_pods: one sharded
container). Plain dicts, no client, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verifypd.domain.metric_names import RES_CONFIG_NAME, RES_CONFIG_NAMESPACE, RES_POD_NAME

from .config_secrets import ADMIN_KEY_DIR, ADMIN_KEY_FILE, LANE_SECRET_DIR, LANE_SECRET_FILE
from .object_meta import Manifest, admin_secret_name, labels, lane_secret_name, object_meta, selector
from .spec import GRPC_PORT, HTTP_PORT, Spec

GPU_RESOURCE = "nvidia.com/gpu"
MODEL_DIR = "/models"
PROMETHEUS_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(HTTP_PORT),
    "prometheus.io/path": "/metrics",
}


def otel_env(config: str, namespace: str, otlp_endpoint: str, service: str) -> list[dict[str, Any]]:
    """Telemetry env for every container: the receiver keys data on these resource attributes.

    POD_NAME must come first: `$(POD_NAME)` expands only variables defined earlier in the list.
    """
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": otlp_endpoint},
        {"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": "grpc"},
        {"name": "OTEL_SERVICE_NAME", "value": service},
        {"name": "OTEL_METRIC_EXPORT_INTERVAL", "value": "5000"},
        {
            "name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": f"{RES_CONFIG_NAME}={config},{RES_CONFIG_NAMESPACE}={namespace},{RES_POD_NAME}=$(POD_NAME)",
        },
    ]


def probes(port: int, http: bool = False) -> dict[str, Any]:
    """gRPC health everywhere; the gateway's readiness is HTTP `GET /health` (503 while draining or
    while a lane is down, so the Service stops sending it requests). Liveness stays on gRPC health:
    a gateway waiting for a lane to come back must not be restarted for it."""
    grpc = {"grpc": {"port": port}}
    ready = {"httpGet": {"path": "/health", "port": "http"}} if http else grpc
    return {
        # Model loading can take minutes: the startup probe holds liveness off until then.
        "startupProbe": {**grpc, "periodSeconds": 5, "failureThreshold": 120},
        "readinessProbe": {**ready, "periodSeconds": 5},
        "livenessProbe": {**grpc, "periodSeconds": 10, "failureThreshold": 6},
    }


def container_resources(spec_resources: Mapping[str, Any], gpu: int) -> dict[str, Any]:
    """A container's `resources`: the spec's requests/limits, plus `gpu` GPUs when not 0."""
    out = {k: dict(v) for k, v in spec_resources.items() if k in ("requests", "limits")}
    if gpu:
        # Extended resources go in limits (requests default to them and must not differ).
        out.setdefault("limits", {})[GPU_RESOURCE] = gpu
    return out


def model_args(spec: Spec) -> list[str]:
    quantization = [] if spec.quantization == "none" else ["--quantization", spec.quantization]
    kv_cache = [] if spec.kv_cache_dtype == "auto" else ["--kv-cache-dtype", spec.kv_cache_dtype]
    return ["--target", spec.target, "--draft", spec.draft, *quantization, *kv_cache]


def volumes(spec: Spec, extra: list[dict[str, Any]], config: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): /dev/shm in RAM (shared-memory tensors), the lane secret, and the
    optional model PVC; `extra` volumes are appended (their mounts are the caller's)."""
    vols: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "lane-secret", "secret": {"secretName": lane_secret_name(config)}},
        *extra,
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "lane-secret", "mountPath": LANE_SECRET_DIR, "readOnly": True},
    ]
    if spec.model_pvc:
        vols.append({"name": "models", "persistentVolumeClaim": {"claimName": spec.model_pvc, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODEL_DIR, "readOnly": True})
    return vols, mounts


def admin_key_volume(config: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) of the admin key: for the gateway container alone."""
    return (
        {"name": "admin-key", "secret": {"secretName": admin_secret_name(config)}},
        {"name": "admin-key", "mountPath": ADMIN_KEY_DIR, "readOnly": True},
    )


def container(
    spec: Spec,
    cname: str,
    args: list[str],
    port: int,
    env: list[dict[str, Any]],
    resources: dict[str, Any],
    mounts: list[dict[str, Any]],
    http: bool = False,
    call_port: int | None = None,
) -> dict[str, Any]:
    """`port`: gRPC (first in `ports`: the probes use it); `call_port`: a lane's call channel."""
    # Servers bind 127.0.0.1 unless told otherwise; in a pod they must listen on the pod IP for the
    # Service and the kubelet's probes.
    env = [{"name": "VERIFYPD_HOST", "value": "0.0.0.0"}] + env
    ports = [{"name": "grpc", "containerPort": port, "protocol": "TCP"}]
    if call_port is not None:
        ports.append({"name": "calls", "containerPort": call_port, "protocol": "TCP"})
    if http:
        ports.append({"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"})
    return {
        "name": cname,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": args,
        "ports": ports,
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
        **probes(port, http),
    }


def gateway_args(spec: Spec, topology: str, addrs: list[str]) -> list[str]:
    """`verifypd serve ...` of the gateway container; `addrs`: its `--<lane>-addr` flags (none: the
    lanes run in process)."""
    return [
        "serve",
        "--port",
        str(GRPC_PORT),
        "--http-port",
        str(HTTP_PORT),
        "--topology",
        topology,
        *model_args(spec),
        *addrs,
        "--kv-transport",
        spec.kv_transport,
        "--lane-secret-file",
        LANE_SECRET_FILE,
        "--admin-key-file",
        ADMIN_KEY_FILE,
    ]


def scrape_annotations(spec: Spec) -> dict[str, str] | None:
    """The Prometheus scrape annotations of the gateway's pods, when the spec asks for them."""
    return PROMETHEUS_ANNOTATIONS if spec.prometheus_scrape else None


def deployment(
    name: str,
    namespace: str,
    component: str,
    owner: Mapping[str, Any],
    replicas: int,
    pod_spec: dict[str, Any],
    annotations: Mapping[str, str] | None = None,
) -> Manifest:
    config = owner["metadata"]["name"]
    pod_meta: dict[str, Any] = {"labels": labels(config, component)}
    if annotations:
        pod_meta["annotations"] = dict(annotations)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(name, namespace, component, owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(config, component)},
            "template": {"metadata": pod_meta, "spec": pod_spec},
        },
    }

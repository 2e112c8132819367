"""Pure builders of the Kubernetes objects the operator owns for one `VerifyPDConfig`.

Every function returns plain dicts (apply-ready JSON); no client, no I/O. `build_all` is what the
reconcile handler applies; anything the operator owns that `build_all` no longer returns is
deleted (e.g. the lane Deployments after a switch to the colocated topology).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from verifypd.domain.metric_names import RES_CONFIG_NAME, RES_CONFIG_NAMESPACE, RES_POD_NAME

from .spec import (
    API_VERSION,
    CALL_PORT,
    COLOCATED,
    COLOCATED_LANE_CALL_PORTS,
    COLOCATED_LANE_PORTS,
    GRPC_PORT,
    HTTP_PORT,
    KIND,
    LANES,
    Spec,
)

MANAGED_BY = "verifypd-operator"
CONFIG_LABEL = "verifypd.dev/config"
GPU_RESOURCE = "nvidia.com/gpu"
# Colocated, devicePlugin sharing: the verify container (which holds the GPU allocation) writes
# the device list it was given here; its siblings wait for it and pin CUDA to the same device.
GPU_HANDOFF_DIR = "/run/verifypd/gpu"
GPU_HANDOFF_FILE = f"{GPU_HANDOFF_DIR}/visible-devices"
MODEL_DIR = "/models"
# The lanes' shared secret (issue 10): a Secret per config, mounted as a file into every pod that
# runs a lane or the gateway; lanes get `--secret-file`, the gateway `--lane-secret-file`.
LANE_SECRET_KEY = "lane-secret"
LANE_SECRET_DIR = "/var/run/verifypd/lane-secret"
LANE_SECRET_FILE = f"{LANE_SECRET_DIR}/{LANE_SECRET_KEY}"
# Control's admin key (issue 20): a Secret per config, mounted into the gateway container only
# (`verifypd serve --admin-key-file`); the operator's Control client reads it from the API and
# presents it. Lanes never see it.
ADMIN_KEY_KEY = "admin-key"
ADMIN_KEY_DIR = "/var/run/verifypd/admin-key"
ADMIN_KEY_FILE = f"{ADMIN_KEY_DIR}/{ADMIN_KEY_KEY}"
PROMETHEUS_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(HTTP_PORT),
    "prometheus.io/path": "/metrics",
}

Manifest = dict[str, Any]


def labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "verifypd",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        CONFIG_LABEL: name,
    }


def selector(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": component, CONFIG_LABEL: name}


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """`owner` is the CR body (or any mapping with metadata.name/uid)."""
    meta = owner["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def deployment_name(name: str, unit: str) -> str:
    return f"{name}-{unit}"


def gateway_pods_service_name(name: str) -> str:
    """Headless Service resolving to every router pod: the operator calls Control on each."""
    return f"{name}-gateway-pods"


def lane_service_name(name: str, lane: str) -> str:
    return f"{name}-{lane}"


def lane_secret_name(name: str) -> str:
    return f"{name}-lane-secret"


def admin_secret_name(name: str) -> str:
    return f"{name}-admin-key"


def network_policy_name(name: str) -> str:
    return f"{name}-lanes"


def _meta(name: str, namespace: str, component: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(owner["metadata"]["name"], component),
        "ownerReferences": [owner_reference(owner)],
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


def _probes(port: int, http: bool = False) -> dict[str, Any]:
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


def _resources(resources: Mapping[str, Any], gpu: int) -> dict[str, Any]:
    out = {k: dict(v) for k, v in resources.items() if k in ("requests", "limits")}
    if gpu:
        # Extended resources go in limits (requests default to them and must not differ).
        out.setdefault("limits", {})[GPU_RESOURCE] = gpu
    return out


def _model_args(spec: Spec) -> list[str]:
    return ["--target", spec.target, "--draft", spec.draft]


def _volumes(spec: Spec, extra: list[dict[str, Any]], config: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): /dev/shm in RAM (shared-memory tensors), the lane secret, and the
    optional model PVC."""
    vols = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "lane-secret", "secret": {"secretName": lane_secret_name(config)}},
    ] + extra
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "lane-secret", "mountPath": LANE_SECRET_DIR, "readOnly": True},
    ]
    if spec.model_pvc:
        vols.append({"name": "models", "persistentVolumeClaim": {"claimName": spec.model_pvc, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODEL_DIR, "readOnly": True})
    return vols, mounts


def _container(
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
        **_probes(port, http),
    }


def _gateway_args(spec: Spec, topology: str, addrs: list[str]) -> list[str]:
    return [
        "serve",
        "--port",
        str(GRPC_PORT),
        "--http-port",
        str(HTTP_PORT),
        "--topology",
        topology,
        *_model_args(spec),
        *addrs,
        "--kv-transport",
        spec.kv_transport,
        "--lane-secret-file",
        LANE_SECRET_FILE,
        "--admin-key-file",
        ADMIN_KEY_FILE,
    ]


def _admin_key_volume(config: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) of the admin key: for the gateway container alone."""
    return (
        {"name": "admin-key", "secret": {"secretName": admin_secret_name(config)}},
        {"name": "admin-key", "mountPath": ADMIN_KEY_DIR, "readOnly": True},
    )


def _deployment(
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
        "metadata": _meta(name, namespace, component, owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(config, component)},
            "template": {"metadata": pod_meta, "spec": pod_spec},
        },
    }


def build_gateway_deployment(spec: Spec, owner: Mapping[str, Any], namespace: str, otlp_endpoint: str) -> Manifest:
    """Split topology: the router/gateway alone, connecting to the lane Services."""
    config = owner["metadata"]["name"]
    addrs = [
        arg
        for lane in LANES
        for arg in (f"--{lane}-addr", f"{lane_service_name(config, lane)}.{namespace}.svc:{GRPC_PORT}")
    ]
    admin_vol, admin_mount = _admin_key_volume(config)
    vols, mounts = _volumes(spec, [admin_vol], config)
    c = _container(
        spec,
        "gateway",
        _gateway_args(spec, "split", addrs),
        GRPC_PORT,
        otel_env(config, namespace, otlp_endpoint, "verifypd-gateway"),
        _resources(spec.gateway.resources, 0),
        mounts + [admin_mount],
        http=True,
    )
    return _deployment(
        deployment_name(config, "gateway"),
        namespace,
        "gateway",
        owner,
        spec.gateway.replicas,
        {"containers": [c], "volumes": vols},
        _scrape(spec),
    )


def build_lane_deployment(
    spec: Spec, owner: Mapping[str, Any], namespace: str, lane: str, replicas: int, otlp_endpoint: str
) -> Manifest:
    config = owner["metadata"]["name"]
    b = spec.lanes[lane]
    # The call channel on a fixed port: the gateway dials <lane pod IP>:CALL_PORT (0 = any free
    # port would be unreachable through the Service and the NetworkPolicy).
    args = [
        "lane",
        lane,
        "--port",
        str(GRPC_PORT),
        "--call-port",
        str(CALL_PORT),
        *_model_args(spec),
        "--secret-file",
        LANE_SECRET_FILE,
    ]
    if b.tensor_parallel > 1:  # refused by the CRD until sharded KV can be copied between pods (crd.py)
        args += ["--tensor-parallel", str(b.tensor_parallel)]
    vols, mounts = _volumes(spec, [], config)
    c = _container(
        spec,
        lane,
        args,
        GRPC_PORT,
        otel_env(config, namespace, otlp_endpoint, f"verifypd-{lane}"),
        _resources(b.resources, b.gpu),
        mounts,
        call_port=CALL_PORT,
    )
    return _deployment(
        deployment_name(config, lane), namespace, lane, owner, replicas, {"containers": [c], "volumes": vols}
    )


def build_resource_claim_template(spec: Spec, owner: Mapping[str, Any], namespace: str) -> Manifest:
    """Colocated + gpuSharing=dra: one claim per pod, referenced by every lane container."""
    config = owner["metadata"]["name"]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": _meta(f"{config}-gpu", namespace, COLOCATED, owner),
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {"deviceClassName": spec.dra_device_class, "count": spec.colocated.gpu},
                        }
                    ]
                }
            }
        },
    }


def build_colocated_deployment(
    spec: Spec, owner: Mapping[str, Any], namespace: str, replicas: int, otlp_endpoint: str
) -> Manifest:
    """One pod: gateway/router + three lane containers sharing one GPU, PID and IPC namespaces.

    Containers of a pod always share the IPC namespace; `shareProcessNamespace` adds the PID
    namespace, which CUDA IPC between the lane processes needs (see docs/kubernetes.md).
    """
    config = owner["metadata"]["name"]
    dra = spec.gpu_sharing == "dra"
    handoff = [] if dra else [{"name": "gpu-handoff", "emptyDir": {"medium": "Memory"}}]
    admin_vol, admin_mount = _admin_key_volume(config)
    vols, mounts = _volumes(spec, handoff + [admin_vol], config)
    lane_mounts = mounts + ([] if dra else [{"name": "gpu-handoff", "mountPath": GPU_HANDOFF_DIR}])
    b = spec.colocated
    containers = []
    for lane in LANES:
        port, call_port = COLOCATED_LANE_PORTS[lane], COLOCATED_LANE_CALL_PORTS[lane]
        lane_cmd = [
            "verifypd",
            "lane",
            lane,
            "--port",
            str(port),
            "--call-port",
            str(call_port),
            *_model_args(spec),
            "--secret-file",
            LANE_SECRET_FILE,
        ]
        env = otel_env(config, namespace, otlp_endpoint, f"verifypd-{lane}")
        if dra:
            resources = _resources(b.resources, 0)
            resources["claims"] = [{"name": "gpu"}]
            c = _container(spec, lane, lane_cmd[1:], port, env, resources, lane_mounts, call_port=call_port)
        elif lane == "verify":
            # Holds the device-plugin allocation; publishes which device it got.
            script = (
                f'echo "$NVIDIA_VISIBLE_DEVICES" > {GPU_HANDOFF_FILE}.tmp && '
                f'mv {GPU_HANDOFF_FILE}.tmp {GPU_HANDOFF_FILE} && exec "$@"'
            )
            c = _container(
                spec, lane, lane_cmd[1:], port, env, _resources(b.resources, b.gpu), lane_mounts, call_port=call_port
            )
            c.update(command=["sh", "-c", script, "verifypd"], args=lane_cmd)
        else:
            # No allocation of its own: the NVIDIA runtime exposes the node's GPUs through the
            # env var, and CUDA is pinned to the verify container's device by its UUID.
            script = (
                f"while [ ! -s {GPU_HANDOFF_FILE} ]; do sleep 1; done; "
                f'export CUDA_VISIBLE_DEVICES="$(cat {GPU_HANDOFF_FILE})"; exec "$@"'
            )
            env = env + [
                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
            ]
            c = _container(
                spec, lane, lane_cmd[1:], port, env, _resources(b.resources, 0), lane_mounts, call_port=call_port
            )
            c.update(command=["sh", "-c", script, "verifypd"], args=lane_cmd)
        containers.append(c)
    addrs = [arg for lane in LANES for arg in (f"--{lane}-addr", f"localhost:{COLOCATED_LANE_PORTS[lane]}")]
    containers.insert(
        0,
        _container(
            spec,
            "gateway",
            _gateway_args(spec, "colocated", addrs),
            GRPC_PORT,
            otel_env(config, namespace, otlp_endpoint, "verifypd-gateway"),
            _resources(spec.gateway.resources, 0),
            mounts + [admin_mount],
            http=True,
        ),
    )
    pod: dict[str, Any] = {"shareProcessNamespace": True, "containers": containers, "volumes": vols}
    if dra:
        pod["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": f"{config}-gpu"}]
    return _deployment(deployment_name(config, COLOCATED), namespace, COLOCATED, owner, replicas, pod, _scrape(spec))


def _service(
    name: str,
    namespace: str,
    component: str,
    owner: Mapping[str, Any],
    headless: bool,
    http: bool = False,
    calls: bool = False,
) -> Manifest:
    config = owner["metadata"]["name"]
    ports = [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}]
    if calls:  # a lane's call channel: plain TCP, verifypd's own framing
        ports.append(
            {"name": "calls", "port": CALL_PORT, "targetPort": "calls", "protocol": "TCP", "appProtocol": "tcp"}
        )
    if http:
        ports.append(
            {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
        )
    spec: dict[str, Any] = {"selector": selector(config, component), "ports": ports}
    if headless:
        spec.update(clusterIP="None", publishNotReadyAddresses=False)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, namespace, component, owner), "spec": spec}


def build_services(spec: Spec, owner: Mapping[str, Any], namespace: str) -> list[Manifest]:
    """The public gateway Service `<name>`, the headless control Service, and (split) lane Services.

    Lane Services are headless so the router can resolve and pin individual lane pods: a
    request's KV lives in one verify replica. They carry gRPC and the call channel (`calls`,
    CALL_PORT), which the gateway dials on the same host as the lane's gRPC address.
    """
    config = owner["metadata"]["name"]
    gw = COLOCATED if spec.topology == COLOCATED else "gateway"
    out = [
        _service(config, namespace, gw, owner, headless=False, http=True),
        _service(gateway_pods_service_name(config), namespace, gw, owner, headless=True, http=True),
    ]
    if spec.topology != COLOCATED:
        out += [
            _service(lane_service_name(config, lane), namespace, lane, owner, headless=True, calls=True)
            for lane in LANES
        ]
    return out


def _scrape(spec: Spec) -> dict[str, str] | None:
    return PROMETHEUS_ANNOTATIONS if spec.prometheus_scrape else None


def _token_secret(owner: Mapping[str, Any], namespace: str, name: str, key: str, token: str) -> Manifest:
    """A Secret holding one token under `key`, owned by the config (the component label is `key`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(name, namespace, key, owner),
        "data": {key: base64.b64encode(token.encode()).decode()},
    }


def _read_token(secret: Mapping[str, Any] | None, key: str) -> str | None:
    data = ((secret or {}).get("data") or {}).get(key)
    if not data:
        return None
    token = base64.b64decode(data).decode(errors="replace").strip()
    return token or None


def build_lane_secret(owner: Mapping[str, Any], namespace: str, token: str) -> Manifest:
    """The lanes' shared secret. `token` is generated once by the caller and read back from the
    live Secret on every later reconcile: rotating it would cut running gateways off their lanes."""
    return _token_secret(owner, namespace, lane_secret_name(owner["metadata"]["name"]), LANE_SECRET_KEY, token)


def read_lane_secret(secret: Mapping[str, Any] | None) -> str | None:
    """The token of a live lane Secret (as built by `build_lane_secret`); None when absent or empty."""
    return _read_token(secret, LANE_SECRET_KEY)


def build_admin_secret(owner: Mapping[str, Any], namespace: str, token: str) -> Manifest:
    """Control's admin key, kept like the lane secret (a new one would lock the operator out of
    running gateways until they restart)."""
    return _token_secret(owner, namespace, admin_secret_name(owner["metadata"]["name"]), ADMIN_KEY_KEY, token)


def read_admin_secret(secret: Mapping[str, Any] | None) -> str | None:
    return _read_token(secret, ADMIN_KEY_KEY)


def build_network_policy(spec: Spec, owner: Mapping[str, Any], namespace: str) -> Manifest:
    """Only the gateway may talk to the lanes (issue 10).

    split: lane pods accept ingress on the gRPC port and the call-channel port (CALL_PORT, the
    gateway's fast path for work calls) only from this config's gateway pods and from its other
    lane pods (KV copy: the prefill lane pushes KV to the verify/draft owners).
    colocated: the gateway reaches the lanes' gRPC and call-channel ports on localhost inside the
    pod (COLOCATED_LANE_PORTS, COLOCATED_LANE_CALL_PORTS; not subject to NetworkPolicy); from
    outside the pod only the gateway's gRPC and HTTP ports are open.
    The kubelet's probes come from the node, which NetworkPolicy always allows.
    """
    config = owner["metadata"]["name"]
    if spec.topology == COLOCATED:
        pods = {"matchLabels": selector(config, COLOCATED)}
        ingress = [{"ports": [{"protocol": "TCP", "port": GRPC_PORT}, {"protocol": "TCP", "port": HTTP_PORT}]}]
    else:

        def comp(*components: str) -> dict[str, Any]:
            return {
                "matchLabels": {CONFIG_LABEL: config, "app.kubernetes.io/instance": config},
                "matchExpressions": [
                    {"key": "app.kubernetes.io/component", "operator": "In", "values": list(components)}
                ],
            }

        pods = comp(*LANES)
        ingress = [
            {
                "from": [{"podSelector": comp("gateway", *LANES)}],
                "ports": [{"protocol": "TCP", "port": GRPC_PORT}, {"protocol": "TCP", "port": CALL_PORT}],
            }
        ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(network_policy_name(config), namespace, "lanes", owner),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def build_all(
    spec: Spec,
    owner: Mapping[str, Any],
    namespace: str,
    replicas: Mapping[str, int],
    otlp_endpoint: str,
    lane_secret: str | None = None,
    admin_key: str | None = None,
) -> list[Manifest]:
    """Everything one config owns. `replicas`: unit -> replicas (the autoscaler's current value).

    `lane_secret` / `admin_key`: the lanes' shared token and Control's admin key; the reconcile
    passes both (read from the live Secrets, or new). None leaves that Secret out: only for callers
    that merely read the Deployments back (the autoscale timer), never for one that prunes.
    """

    def r(unit: str) -> int:
        return replicas.get(unit, spec.bounds(unit).replicas)

    if spec.topology == COLOCATED and spec.colocated.tensor_parallel > 1:
        from .tensor_parallel_pods import build_tensor_parallel_deployment

        objs = [build_tensor_parallel_deployment(spec, owner, namespace, r(COLOCATED), otlp_endpoint)]
        if spec.gpu_sharing == "dra":
            objs.append(build_resource_claim_template(spec, owner, namespace))
    elif spec.topology == COLOCATED:
        objs = [build_colocated_deployment(spec, owner, namespace, r(COLOCATED), otlp_endpoint)]
        if spec.gpu_sharing == "dra":
            objs.append(build_resource_claim_template(spec, owner, namespace))
    else:
        objs = [build_gateway_deployment(spec, owner, namespace, otlp_endpoint)]
        objs += [build_lane_deployment(spec, owner, namespace, lane, r(lane), otlp_endpoint) for lane in LANES]
    objs += build_services(spec, owner, namespace)
    objs.append(build_network_policy(spec, owner, namespace))
    if lane_secret is not None:
        objs.append(build_lane_secret(owner, namespace, lane_secret))
    if admin_key is not None:
        objs.append(build_admin_secret(owner, namespace, admin_key))
    return objs

"""Pure builders of the Kubernetes objects the operator owns for one `VerifyPDConfig`.

Every function returns plain dicts (apply-ready JSON); no client, no I/O. `build_all` is what the
reconcile handler applies; anything the operator owns that `build_all` no longer returns is
deleted (e.g. the lane Deployments after a switch to the colocated topology).

Built from: object_meta (names, labels, owner references), config_secrets (the lane and admin
Secrets), pod_parts (containers, probes, volumes, the Deployment around a pod) and
tensor_parallel_pods (the colocated pod of a sharded target).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config_secrets import LANE_SECRET_FILE, build_admin_secret, build_lane_secret
from .object_meta import (
    CONFIG_LABEL,
    METRICS_LABEL,
    Manifest,
    deployment_name,
    gateway_pods_service_name,
    lane_service_name,
    network_policy_name,
    object_meta,
    selector,
)
from .pod_parts import (
    admin_key_volume,
    container,
    container_resources,
    deployment,
    gateway_args,
    model_args,
    otel_env,
    scrape_annotations,
    volumes,
)
from .spec import (
    CALL_PORT,
    COLOCATED,
    COLOCATED_LANE_CALL_PORTS,
    COLOCATED_LANE_PORTS,
    GRPC_PORT,
    HTTP_PORT,
    LANES,
    Spec,
)
from .tensor_parallel_pods import build_tensor_parallel_deployment

# Colocated, devicePlugin sharing: the verify container (which holds the GPU allocation) writes
# the device list it was given here; its siblings wait for it and pin CUDA to the same device.
GPU_HANDOFF_DIR = "/run/verifypd/gpu"
GPU_HANDOFF_FILE = f"{GPU_HANDOFF_DIR}/visible-devices"


def build_gateway_deployment(spec: Spec, owner: Mapping[str, Any], namespace: str, otlp_endpoint: str) -> Manifest:
    """Split topology: the router/gateway alone, connecting to the lane Services."""
    config = owner["metadata"]["name"]
    addrs = [
        arg
        for lane in LANES
        for arg in (f"--{lane}-addr", f"{lane_service_name(config, lane)}.{namespace}.svc:{GRPC_PORT}")
    ]
    admin_vol, admin_mount = admin_key_volume(config)
    vols, mounts = volumes(spec, [admin_vol], config)
    c = container(
        spec,
        "gateway",
        gateway_args(spec, "split", addrs),
        GRPC_PORT,
        otel_env(config, namespace, otlp_endpoint, "verifypd-gateway"),
        container_resources(spec.gateway.resources, 0),
        mounts + [admin_mount],
        http=True,
    )
    return deployment(
        deployment_name(config, "gateway"),
        namespace,
        "gateway",
        owner,
        spec.gateway.replicas,
        {"containers": [c], "volumes": vols},
        scrape_annotations(spec),
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
        *model_args(spec),
        "--secret-file",
        LANE_SECRET_FILE,
    ]
    if b.tensor_parallel > 1:  # refused by the CRD until sharded KV can be copied between pods (crd.py)
        args += ["--tensor-parallel", str(b.tensor_parallel)]
    vols, mounts = volumes(spec, [], config)
    c = container(
        spec,
        lane,
        args,
        GRPC_PORT,
        otel_env(config, namespace, otlp_endpoint, f"verifypd-{lane}"),
        container_resources(b.resources, b.gpu),
        mounts,
        call_port=CALL_PORT,
    )
    return deployment(
        deployment_name(config, lane), namespace, lane, owner, replicas, {"containers": [c], "volumes": vols}
    )


def build_resource_claim_template(spec: Spec, owner: Mapping[str, Any], namespace: str) -> Manifest:
    """Colocated + gpuSharing=dra: one claim per pod, referenced by every lane container."""
    config = owner["metadata"]["name"]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": object_meta(f"{config}-gpu", namespace, COLOCATED, owner),
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
    admin_vol, admin_mount = admin_key_volume(config)
    vols, mounts = volumes(spec, handoff + [admin_vol], config)
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
            *model_args(spec),
            "--secret-file",
            LANE_SECRET_FILE,
        ]
        if spec.lane_devices:  # disaggregated in the pod: each lane on its GPU of the pod's (laneDevices)
            lane_cmd += ["--device", f"cuda:{spec.lane_devices.get(lane, 0)}"]
        env = otel_env(config, namespace, otlp_endpoint, f"verifypd-{lane}")
        if dra:
            resources = container_resources(b.resources, 0)
            resources["claims"] = [{"name": "gpu"}]
            c = container(spec, lane, lane_cmd[1:], port, env, resources, lane_mounts, call_port=call_port)
        elif lane == "verify":
            # Holds the device-plugin allocation; publishes which device it got.
            script = (
                f'echo "$NVIDIA_VISIBLE_DEVICES" > {GPU_HANDOFF_FILE}.tmp && '
                f'mv {GPU_HANDOFF_FILE}.tmp {GPU_HANDOFF_FILE} && exec "$@"'
            )
            if spec.lane_devices:  # cuda:N must mean the same GPU in every container: the same list, in order
                script = f'export CUDA_VISIBLE_DEVICES="$NVIDIA_VISIBLE_DEVICES"; {script}'
            c = container(
                spec,
                lane,
                lane_cmd[1:],
                port,
                env,
                container_resources(b.resources, b.gpu),
                lane_mounts,
                call_port=call_port,
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
            c = container(
                spec,
                lane,
                lane_cmd[1:],
                port,
                env,
                container_resources(b.resources, 0),
                lane_mounts,
                call_port=call_port,
            )
            c.update(command=["sh", "-c", script, "verifypd"], args=lane_cmd)
        containers.append(c)
    addrs = [arg for lane in LANES for arg in (f"--{lane}-addr", f"localhost:{COLOCATED_LANE_PORTS[lane]}")]
    containers.insert(
        0,
        container(
            spec,
            "gateway",
            gateway_args(spec, "colocated", addrs),
            GRPC_PORT,
            otel_env(config, namespace, otlp_endpoint, "verifypd-gateway"),
            container_resources(spec.gateway.resources, 0),
            mounts + [admin_mount],
            http=True,
        ),
    )
    pod: dict[str, Any] = {"shareProcessNamespace": True, "containers": containers, "volumes": vols}
    if dra:
        pod["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": f"{config}-gpu"}]
    return deployment(
        deployment_name(config, COLOCATED), namespace, COLOCATED, owner, replicas, pod, scrape_annotations(spec)
    )


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
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(name, namespace, component, owner),
        "spec": spec,
    }


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
    out[1]["metadata"]["labels"][METRICS_LABEL] = "true"
    if spec.topology != COLOCATED:
        out += [
            _service(lane_service_name(config, lane), namespace, lane, owner, headless=True, calls=True)
            for lane in LANES
        ]
    return out


def build_network_policy(spec: Spec, owner: Mapping[str, Any], namespace: str) -> Manifest:
    """Only the gateway may talk to the lanes.

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
        "metadata": object_meta(network_policy_name(config), namespace, "lanes", owner),
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

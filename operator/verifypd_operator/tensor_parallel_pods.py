"""The colocated pod of a target sharded over several GPUs (`colocated.tensorParallel` > 1).

One container runs `verifypd serve --topology colocated --tensor-parallel N`: the gateway, the
engine core (rank 0, with the three lanes in process) and the N - 1 follower ranks it starts, all
on the `gpu` GPUs the container requests (the ranks take cuda:0..N-1; NCCL stays inside the pod,
over /dev/shm and NVLink/P2P). The four-container pod of `build_colocated_deployment` shares one
GPU between lane processes by handing its device id around; a sharded target needs all ranks'
GPUs in the process group of one container instead, so this pod has no lane containers, no lane
ports and no GPU handoff. Services, NetworkPolicy and the admin key are the colocated ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .object_meta import Manifest, deployment_name
from .pod_parts import (
    admin_key_volume,
    container,
    container_resources,
    deployment,
    gateway_args,
    otel_env,
    scrape_annotations,
    volumes,
)
from .spec import COLOCATED, GRPC_PORT, Spec


def serve_args(spec: Spec) -> list[str]:
    """`serve` with in-process lanes (no --*-addr) and the target over `tensorParallel` ranks."""
    return [
        *gateway_args(spec, "colocated", []),
        "--device",
        "cuda",
        "--tensor-parallel",
        str(spec.colocated.tensor_parallel),
    ]


def build_tensor_parallel_deployment(
    spec: Spec, owner: Mapping[str, Any], namespace: str, replicas: int, otlp_endpoint: str
) -> Manifest:
    config = owner["metadata"]["name"]
    b = spec.colocated
    admin_vol, admin_mount = admin_key_volume(config)
    vols, mounts = volumes(spec, [admin_vol], config)
    if spec.gpu_sharing == "dra":  # the claim (count = gpu) of build_resource_claim_template
        resources = container_resources(b.resources, 0)
        resources["claims"] = [{"name": "gpu"}]
    else:
        resources = container_resources(b.resources, b.gpu)
    c = container(
        spec,
        "serve",
        serve_args(spec),
        GRPC_PORT,
        otel_env(config, namespace, otlp_endpoint, "verifypd-gateway"),
        resources,
        mounts + [admin_mount],
        http=True,
    )
    pod: dict[str, Any] = {"containers": [c], "volumes": vols}
    if spec.gpu_sharing == "dra":
        pod["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": f"{config}-gpu"}]
    return deployment(
        deployment_name(config, COLOCATED), namespace, COLOCATED, owner, replicas, pod, scrape_annotations(spec)
    )

"""Names, labels and metadata of the Kubernetes objects the operator owns for one `VerifyPDConfig`.

Plain functions of the config's name (and the CR body for the owner reference); no client, no I/O.
The builders, the TLS manifests, the handlers and the Kubernetes client all name and select the
owned objects through these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .spec import API_VERSION, KIND

MANAGED_BY = "verifypd-operator"
CONFIG_LABEL = "verifypd.dev/config"
# On the one Service per config whose endpoints are the gateway pods' /metrics: what the chart's
# ServiceMonitor selects (the public gateway Service has the same pods: scraping both would count twice).
METRICS_LABEL = "verifypd.dev/metrics"

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


def object_meta(name: str, namespace: str, component: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    """`metadata` of an owned object: its name, the config's labels and the owner reference."""
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(owner["metadata"]["name"], component),
        "ownerReferences": [owner_reference(owner)],
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

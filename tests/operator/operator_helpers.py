"""Shared helpers for the operator tests (no Kubernetes API server needed); fixtures in conftest.py."""

from __future__ import annotations

import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
for sub in ("services", "operator", "loadgen"):
    p = str(ROOT / sub)
    if p not in sys.path:
        sys.path.insert(0, p)

CHART = ROOT / "helm" / "verifypd"
CRD_FILE = CHART / "crds" / "verifypdconfigs.verifypd.dev.yaml"
EXAMPLE = ROOT / "deploy" / "examples" / "verifypdconfig.yaml"
K8S_VERSION = "1.37"  # kubernetes-validate's newest schema set

# Discovery documents for the kinds the operator and chart touch (kmock serves the core group's
# groupVersion as "/v1", which client-go rejects, so tests serve /api/v1 themselves).
CORE_V1 = [
    ("configmaps", "ConfigMap", True),
    ("secrets", "Secret", True),
    ("services", "Service", True),
    ("serviceaccounts", "ServiceAccount", True),
    ("events", "Event", True),
    ("pods", "Pod", True),
    ("namespaces", "Namespace", False),
]
GROUPED = {
    "apps/v1": [("deployments", "Deployment", True)],
    "rbac.authorization.k8s.io/v1": [
        ("roles", "Role", True),
        ("rolebindings", "RoleBinding", True),
        ("clusterroles", "ClusterRole", False),
        ("clusterrolebindings", "ClusterRoleBinding", False),
    ],
    "apiextensions.k8s.io/v1": [("customresourcedefinitions", "CustomResourceDefinition", False)],
    "kopf.dev/v1": [("kopfpeerings", "KopfPeering", True), ("clusterkopfpeerings", "ClusterKopfPeering", False)],
    "verifypd.dev/v1alpha1": [("verifypdconfigs", "VerifyPDConfig", True)],
    "resource.k8s.io/v1": [("resourceclaimtemplates", "ResourceClaimTemplate", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "monitoring.coreos.com/v1": [
        ("servicemonitors", "ServiceMonitor", True),
        ("prometheusrules", "PrometheusRule", True),
    ],
}
VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]


def declare_kinds(k) -> None:
    """Make a kmock KubernetesEmulator discoverable like an API server serving these kinds."""
    import kmock

    k["get /version"] << {"major": "1", "minor": "35", "gitVersion": "v1.35.0", "platform": "linux/amd64"}
    k["get /api/v1"] << {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "v1",
        "resources": [
            {"name": p, "singularName": kind.lower(), "namespaced": nsd, "kind": kind, "verbs": VERBS}
            for p, kind, nsd in CORE_V1
        ],
    }
    for gv, kinds in GROUPED.items():
        for plural, kind, namespaced in kinds:
            subres = {"status"} if kind == "VerifyPDConfig" else set()
            k.resources[f"{gv}/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, singular=kind.lower(), verbs=set(VERBS), subresources=subres
            )
    for plural, kind, nsd in CORE_V1:
        k.resources[f"v1/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=nsd, singular=kind.lower(), verbs=set(VERBS)
        )


def kubeconfig_for(url: str) -> str:
    return f"""apiVersion: v1
kind: Config
clusters: [{{name: mock, cluster: {{server: "{url}"}}}}]
users: [{{name: mock, user: {{token: mock}}}}]
contexts: [{{name: mock, context: {{cluster: mock, user: mock, namespace: default}}}}]
current-context: mock
"""


def emulator():
    """kmock's Kubernetes emulator, plus what a real API server does on create: honour
    `generateName` (kopf posts Events that way) and fill in uid/resourceVersion."""
    import uuid

    import kmock

    class Emulator(kmock.KubernetesEmulator):
        async def _handle(self, request):
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:6]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("resourceVersion", "1")
                if request.data.get("kind") == "CustomResourceDefinition":  # established at once
                    request.data["status"] = {
                        "conditions": [
                            {"type": "Established", "status": "True"},
                            {"type": "NamesAccepted", "status": "True"},
                        ],
                        "acceptedNames": request.data.get("spec", {}).get("names", {}),
                    }
            return await super()._handle(request)

    return Emulator()


def wait_until(fn, what: str, timeout: float, *, interval: float = 0.2, alive=lambda: None, logs=lambda: ""):
    """fn()'s first truthy value within `timeout` s; `alive()` asserts the processes under test
    still run (checked every poll); `logs()` is added to the timeout's message."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"\n{logs()}" if logs() else ""))
        time.sleep(interval)

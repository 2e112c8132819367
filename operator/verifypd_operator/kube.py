"""The few Kubernetes API calls the operator makes, as plain-dict REST over the official client.

Owned objects are created when missing and otherwise server-side applied with one field manager
(force), so fields the builders stop emitting are removed on a real API server. Scaling is a
merge patch of `spec.replicas` only, never an apply, so it cannot drop the other applied fields.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

import kubernetes

from .object_meta import CONFIG_LABEL, MANAGED_BY

log = logging.getLogger(__name__)
FIELD_MANAGER = MANAGED_BY

# kind -> (API path prefix, plural); every kind the operator owns.
KINDS = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ResourceClaimTemplate": ("/apis/resource.k8s.io/v1", "resourceclaimtemplates"),
    "Secret": ("/api/v1", "secrets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
}
# TLS with cert-manager (tls_manifests.py): owned, listed and pruned only when the operator runs
# in that mode (`Kube.kinds`), so clusters without cert-manager see no requests for them.
CERT_MANAGER_KINDS = {
    "Certificate": ("/apis/cert-manager.io/v1", "certificates"),
    "Issuer": ("/apis/cert-manager.io/v1", "issuers"),
}


class ApiError(Exception):
    reason = "APIError"

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {_message(body)}")
        self.status = status


class ApiNotServed(ApiError):
    """The API server does not serve a kind we must create (e.g. resource.k8s.io/v1 on < 1.34)."""

    reason = "APINotServed"

    def __init__(self, api_version: str, kind: str):
        Exception.__init__(self, f"{api_version} {kind} is not served by this API server")
        self.status = 404
        self.api_version, self.kind = api_version, kind


def _message(body: str) -> str:
    """A Status object's message (what kubectl shows), else the raw body, shortened."""
    try:
        msg = json.loads(body).get("message")
    except (ValueError, AttributeError):
        msg = None
    return (msg or body)[:600]


def api_client_from_env() -> kubernetes.client.ApiClient:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def api_client_for(server: str) -> kubernetes.client.ApiClient:
    """An unauthenticated client for a given URL (tests against a mock API server)."""
    cfg = kubernetes.client.Configuration()
    cfg.host = server
    return kubernetes.client.ApiClient(cfg)


class Kube:
    def __init__(self, api: kubernetes.client.ApiClient, kinds: Iterable[str] = tuple(KINDS)):
        self.api = api
        self.kinds = tuple(kinds)  # what `owned` lists and `prune` may delete

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any] | None:
        """Returns the decoded body; None for 404."""
        url = self.api.configuration.host + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json", "Content-Type": content_type}
        self.api.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
        try:
            resp = self.api.call_api(
                method, url, header_params=headers, body=json.loads(json.dumps(body)) if body is not None else None
            )
            data = resp.read()
            code = resp.status
        except kubernetes.client.ApiException as e:
            data, code = (e.body or "").encode() if isinstance(e.body, str) else (e.body or b""), e.status
        if code == 404:
            return None
        if not 200 <= code < 300:
            raise ApiError(code, data.decode(errors="replace"))
        return json.loads(data) if data else {}

    @staticmethod
    def _collection(kind: str, namespace: str) -> str:
        prefix, plural = KINDS[kind] if kind in KINDS else CERT_MANAGER_KINDS[kind]
        return f"{prefix}/namespaces/{namespace}/{plural}"

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.request("GET", f"{self._collection(kind, namespace)}/{name}")

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        kind, meta = obj["kind"], obj["metadata"]
        coll = self._collection(kind, meta["namespace"])
        if self.get(kind, meta["namespace"], meta["name"]) is None:
            created = self.request("POST", coll, obj, {"fieldManager": FIELD_MANAGER})
            if created is None:  # 404 on the collection itself: the API group/version is not served
                raise ApiNotServed(obj["apiVersion"], kind)
            return created
        out = self.request(
            "PATCH",
            f"{coll}/{meta['name']}",
            obj,
            {"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )
        return out or {}

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self.request(
            "PATCH",
            f"{self._collection('Deployment', namespace)}/{name}",
            {"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        return (
            self.request("DELETE", f"{self._collection(kind, namespace)}/{name}", {"propagationPolicy": "Background"})
            is not None
        )

    def owned(self, config: str, namespace: str, kinds: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Objects labelled as this config's (filtered client-side too: the label is the contract)."""
        out = []
        for kind in self.kinds if kinds is None else kinds:
            try:
                lst = self.request(
                    "GET", self._collection(kind, namespace), query={"labelSelector": f"{CONFIG_LABEL}={config}"}
                )
            except ApiError as e:
                log.debug("cannot list %s: %s", kind, e)  # e.g. the DRA API is not served
                continue
            for item in (lst or {}).get("items", []):
                item.setdefault("kind", kind)
                if (item.get("metadata", {}).get("labels") or {}).get(CONFIG_LABEL) == config:
                    out.append(item)
        return out

    def prune(self, config: str, namespace: str, keep: Iterable[Mapping[str, Any]]) -> list[str]:
        """Delete this config's objects that are not in `keep`; returns 'Kind/name' deleted."""
        wanted = {(o["kind"], o["metadata"]["name"]) for o in keep}
        gone = []
        for item in self.owned(config, namespace):
            key = (item["kind"], item["metadata"]["name"])
            if key not in wanted and self.delete(item["kind"], namespace, key[1]):
                gone.append(f"{key[0]}/{key[1]}")
        return gone

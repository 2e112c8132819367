"""The operator's TLS I/O: which mode runs (cert-manager detected), the objects a config's TLS
needs now (reading the live Secrets, re-issuing before expiry), and the Control client's TLS.
Decisions are tls_certs.plan and tls_manifests' builders (pure); this module reads and returns."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from . import tls_certs
from .kube import ApiError, Kube
from .tls_manifests import (
    CERT_MANAGER_API,
    build_ca_secret,
    build_cert_manager_objects,
    build_tls_secret,
    ca_secret_name,
    control_server_name,
    dns_names,
    read_pair,
    tls_secret_name,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TlsSettings:
    mode: str  # operator | cert-manager (resolved: never auto or off)
    days: int = 30  # leaf validity
    issuer: tuple[str, str] | None = None  # cert-manager: (kind, name) of the user's issuer


def cert_manager_served(kube: Kube) -> bool:
    """Whether cert-manager's API serves Certificates (discovery: no extra RBAC needed)."""
    try:
        found = kube.request("GET", f"/apis/{CERT_MANAGER_API}")
    except ApiError:
        return False
    return any(r.get("name") == "certificates" for r in (found or {}).get("resources", []))


def resolve(kube: Kube, mode: str, days: int, issuer: str | None) -> TlsSettings | None:
    """`--tls` as given -> the settings the operator runs with (None: TLS off). ValueError names
    what is wrong (the entry point exits 2 on it)."""
    if mode == "off":
        return None
    if days < 3:
        raise ValueError(f"--tls-cert-days must be at least 3, got {days}")
    ref = None
    if issuer:
        kind, _, name = issuer.partition("/")
        if kind not in ("Issuer", "ClusterIssuer") or not name:
            raise ValueError(f"--tls-issuer must be Issuer/NAME or ClusterIssuer/NAME, got {issuer!r}")
        ref = (kind, name)
    served = cert_manager_served(kube) if mode in ("auto", "cert-manager") else False
    if mode == "cert-manager" and not served:
        raise ValueError("--tls cert-manager: the API cert-manager.io/v1 is not served (is cert-manager installed?)")
    resolved = "cert-manager" if mode == "cert-manager" or (mode == "auto" and served) else "operator"
    if ref and resolved != "cert-manager":
        raise ValueError("--tls-issuer needs cert-manager (--tls cert-manager, or auto with cert-manager installed)")
    log.info("TLS: %s%s", resolved, " (cert-manager detected)" if mode == "auto" and served else "")
    return TlsSettings(resolved, days, ref)


def tls_objects(
    kube: Kube, tls: TlsSettings, owner: Mapping[str, Any], namespace: str, now: float
) -> tuple[list[dict[str, Any]], str | None]:
    """(objects to apply, why the certificate changed or None). Operator mode keeps the live
    Secrets while they are good (applying them again changes nothing)."""
    config = owner["metadata"]["name"]
    if tls.mode == "cert-manager":
        return build_cert_manager_objects(owner, namespace, tls.days, tls.issuer), None
    ca = read_pair(kube.get("Secret", namespace, ca_secret_name(config)), "ca.key", "ca.crt")
    leaf = read_pair(kube.get("Secret", namespace, tls_secret_name(config)), "tls.key", "tls.crt")
    p = tls_certs.plan(ca, leaf, config, dns_names(config, namespace), now, tls.days)
    return [
        build_ca_secret(owner, namespace, p.ca_key, p.ca_cert),
        build_tls_secret(owner, namespace, p.leaf_key, p.leaf_cert, p.ca_cert),
    ], p.reason


def control_tls(kube: Kube, config: str, namespace: str):
    """A verifypd.net.tls.ClientTls trusting the config's CA (from its TLS Secret), checking the
    gateway pods' Service name; None while the Secret has no CA yet."""
    from verifypd.net.tls import ClientTls

    secret = kube.get("Secret", namespace, tls_secret_name(config))
    _, ca = read_pair(secret, "tls.key", "ca.crt")
    if not ca:
        return None
    return ClientTls("", None, None, ca, None, None, control_server_name(config, namespace))

"""TLS for a config's pods, as pure manifest functions (docs/kubernetes.md "TLS").

The choice is the operator's (`--tls`, the chart's `tls.mode`), for every config it runs:

    off           plaintext (the lane secret and the NetworkPolicy still apply)
    operator      the operator issues a CA and a leaf per config into two Secrets it owns
                  (tls_certs.py), and re-issues the leaf before it expires
    cert-manager  cert-manager `Certificate` objects (a self-signed Issuer, a CA Certificate and a
                  CA Issuer per config, or the Issuer/ClusterIssuer named by `--tls-issuer`);
                  cert-manager renews them
    auto          cert-manager when its API (cert-manager.io/v1) is served, else operator;
                  decided when the operator starts

Either way the pods mount Secret `<config>-tls` (tls.crt, tls.key, ca.crt) and get:
  gateway  --tls-cert-file/--tls-key-file (its gRPC and HTTP ports serve TLS) and
           --lane-tls-cert-file/--lane-tls-key-file/--lane-tls-ca-file (mutual TLS to the lanes)
  lanes    --tls-cert-file/--tls-key-file/--tls-ca-file (their ports speak mutual TLS only;
           the prefill lane's KV pushes present the same certificate)
  all      --health-port and probes on it: the kubelet's gRPC probe cannot speak TLS, so each
           container answers plaintext `GET /health` on a port of its own (health.HealthPort)

Rotation without dropping requests: kubelet replaces the mounted files (atomically) when the
Secret changes; the servers re-read them for new connections (verifypd.net.tls.FileStamp,
verifypd.net.lane_tls) while open connections keep going, so nothing restarts.

`with_tls` post-processes what builders.build_all returns: it adds to the pod templates and
never needs the builders to know about TLS.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from typing import Any

from .object_meta import deployment_name, gateway_pods_service_name, lane_service_name, object_meta
from .spec import COLOCATED, LANES

MODES = ("off", "operator", "cert-manager", "auto")
TLS_DIR = "/var/run/verifypd/tls"
CERT_FILE, KEY_FILE, CA_FILE = f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt"
# The plaintext health ports (one per container: the containers of a colocated pod share its
# network namespace).
HEALTH_PORTS = {"gateway": 8081, "prefill": 8082, "draft": 8083, "verify": 8084}
CERT_MANAGER_API = "cert-manager.io/v1"
Manifest = dict[str, Any]


def tls_secret_name(config: str) -> str:
    return f"{config}-tls"


def ca_secret_name(config: str) -> str:
    return f"{config}-tls-ca"


def dns_names(config: str, namespace: str) -> list[str]:
    """Every name the pods are dialled by: the public and per-pod gateway Services (clients, the
    operator's Control client), the lane Services (the gateway, the prefill lane's KV pushes), and
    localhost (the colocated pod's lanes)."""
    names = []
    for svc in [config, gateway_pods_service_name(config), *[lane_service_name(config, lane) for lane in LANES]]:
        names += [svc, f"{svc}.{namespace}", f"{svc}.{namespace}.svc", f"{svc}.{namespace}.svc.cluster.local"]
    return names + ["localhost", "127.0.0.1"]


def control_server_name(config: str, namespace: str) -> str:
    """The name the operator checks in a gateway's certificate: it dials the pods by IP."""
    return f"{gateway_pods_service_name(config)}.{namespace}.svc"


# -- Secrets (operator mode) -------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def build_ca_secret(owner: Mapping[str, Any], namespace: str, key: bytes, cert: bytes) -> Manifest:
    """The config's CA (its key never leaves this Secret: no pod mounts it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": object_meta(ca_secret_name(owner["metadata"]["name"]), namespace, "tls-ca", owner),
        "data": {"ca.key": _b64(key), "ca.crt": _b64(cert)},
    }


def build_tls_secret(owner: Mapping[str, Any], namespace: str, key: bytes, cert: bytes, ca: bytes) -> Manifest:
    """The leaf every pod of the config mounts, with the CA its peers must chain to."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": object_meta(tls_secret_name(owner["metadata"]["name"]), namespace, "tls", owner),
        "data": {"tls.crt": _b64(cert), "tls.key": _b64(key), "ca.crt": _b64(ca)},
    }


def read_pair(secret: Mapping[str, Any] | None, key_field: str, cert_field: str) -> tuple[bytes | None, bytes | None]:
    data = (secret or {}).get("data") or {}

    def get(field: str) -> bytes | None:
        return base64.b64decode(data[field]) if data.get(field) else None

    return get(key_field), get(cert_field)


# -- cert-manager --------------------------------------------------------------------------------
def build_cert_manager_objects(
    owner: Mapping[str, Any], namespace: str, days: int, issuer: tuple[str, str] | None = None
) -> list[Manifest]:
    """`issuer`: (kind, name) of an Issuer/ClusterIssuer to sign the leaf; None: a per-config CA
    made by cert-manager (self-signed Issuer -> CA Certificate -> CA Issuer), like operator mode."""
    config = owner["metadata"]["name"]

    def obj(kind: str, name: str, spec: dict[str, Any]) -> Manifest:
        return {
            "apiVersion": CERT_MANAGER_API,
            "kind": kind,
            "metadata": object_meta(name, namespace, "tls", owner),
            "spec": spec,
        }

    out = []
    if issuer is None:
        out += [
            obj("Issuer", f"{config}-tls-selfsigned", {"selfSigned": {}}),
            obj(
                "Certificate",
                ca_secret_name(config),
                {
                    "isCA": True,
                    "commonName": f"verifypd {config} CA"[:64],
                    "secretName": ca_secret_name(config),
                    "duration": "87600h",
                    "privateKey": {"algorithm": "ECDSA", "size": 256},
                    "issuerRef": {"kind": "Issuer", "name": f"{config}-tls-selfsigned"},
                },
            ),
            obj("Issuer", f"{config}-tls-ca", {"ca": {"secretName": ca_secret_name(config)}}),
        ]
        issuer = ("Issuer", f"{config}-tls-ca")
    names = dns_names(config, namespace)
    out.append(
        obj(
            "Certificate",
            tls_secret_name(config),
            {
                "secretName": tls_secret_name(config),
                "commonName": names[0],
                "dnsNames": [n for n in names if not n[0].isdigit()],
                "ipAddresses": [n for n in names if n[0].isdigit()],
                "usages": ["digital signature", "key encipherment", "server auth", "client auth"],
                "duration": f"{days * 24}h",
                "renewBefore": f"{max(1, days * 8)}h",  # a third of its life
                "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
                "issuerRef": {"group": "cert-manager.io", "kind": issuer[0], "name": issuer[1]},
            },
        )
    )
    return out


# -- pods ----------------------------------------------------------------------------------------
def _verifypd_args(container: Mapping[str, Any]) -> list[str]:
    """The verifypd arguments of a container: `args` itself, or (colocated lanes started through
    `sh -c ... exec "$@"`) `args` after the program name."""
    args = list(container.get("args") or [])
    return args[1:] if args[:1] == ["verifypd"] else args


def _role(container: Mapping[str, Any]) -> str | None:
    args = _verifypd_args(container)
    if args[:1] == ["serve"]:
        return "gateway"
    if args[:1] == ["lane"] and len(args) > 1 and args[1] in LANES:
        return args[1]
    return None


def _tls_args(role: str) -> list[str]:
    if role == "gateway":
        return [
            "--tls-cert-file",
            CERT_FILE,
            "--tls-key-file",
            KEY_FILE,
            "--lane-tls-cert-file",
            CERT_FILE,
            "--lane-tls-key-file",
            KEY_FILE,
            "--lane-tls-ca-file",
            CA_FILE,
        ]
    return ["--tls-cert-file", CERT_FILE, "--tls-key-file", KEY_FILE, "--tls-ca-file", CA_FILE]


def _health_probes(container: dict[str, Any], port: int) -> None:
    """Every probe of the container becomes `GET /health` on its plaintext health port, keeping
    its timing (startup: model loading; liveness; readiness)."""
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        old = container.get(probe)
        if old is None:
            continue
        timing = {k: v for k, v in old.items() if k not in ("grpc", "httpGet", "exec", "tcpSocket")}
        container[probe] = {"httpGet": {"path": "/health", "port": port}, **timing}


def with_tls(objs: list[Manifest], config: str) -> list[Manifest]:
    """`objs` (builders.build_all's) with TLS in every Deployment's pods: the Secret mounted, the
    flags given, the probes on the plaintext health ports. Other objects pass unchanged."""
    out = []
    for obj in objs:
        if obj.get("kind") != "Deployment":
            out.append(obj)
            continue
        obj = copy.deepcopy(obj)
        pod = obj["spec"]["template"]["spec"]
        pod.setdefault("volumes", []).append({"name": "tls", "secret": {"secretName": tls_secret_name(config)}})
        for c in pod["containers"]:
            role = _role(c)
            if role is None:
                continue
            port = HEALTH_PORTS[role]
            c["args"] = [*c["args"], *_tls_args(role), "--health-port", str(port)]
            c.setdefault("volumeMounts", []).append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
            c.setdefault("ports", []).append({"name": f"health-{role}"[:15], "containerPort": port, "protocol": "TCP"})
            _health_probes(c, port)
        out.append(obj)
    return out


def tls_deployments(config: str, topology: str) -> list[str]:
    """The Deployments that mount the TLS Secret (what an envtest checks)."""
    units = [COLOCATED] if topology == COLOCATED else ["gateway", *LANES]
    return [deployment_name(config, u) for u in units]

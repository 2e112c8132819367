"""A real Kubernetes API server for tests: etcd + kube-apiserver from `KUBEBUILDER_ASSETS`
(`bash ../shared/k8s-envtest/setup.sh` prints it; `.ci/run` exports it).

The server stores and validates objects (CRD schemas, defaulting, CEL, SSA, RBAC, events); it runs
no scheduler, controller-manager or kubelet: pods never run and nothing is garbage-collected.

One server per test session (`envtest` fixture in conftest.py); tests isolate themselves by
namespace. Clients authenticate with a static admin token (group system:masters); service
accounts get real bound tokens through the TokenRequest API (`Cluster.sa_kubeconfig`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request

ADMIN_TOKEN = "verifypd-envtest-admin"


def assets_dir() -> pathlib.Path | None:
    d = os.environ.get("KUBEBUILDER_ASSETS")
    if not d:
        return None
    p = pathlib.Path(d)
    missing = [b for b in ("etcd", "kube-apiserver") if not (p / b).is_file()]
    if missing:
        raise RuntimeError(f"KUBEBUILDER_ASSETS={d} lacks {missing}: run bash ../shared/k8s-envtest/setup.sh")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _certs(d: pathlib.Path) -> None:
    """CA, a serving cert for 127.0.0.1/localhost, and the service-account signing key pair."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    def key():
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def pem_key(k):
        return k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )

    now = datetime.datetime.now(datetime.UTC)
    ca_key, srv_key, sa_key = key(), key(), key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "verifypd-envtest-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    srv = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "server.crt").write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    (d / "server.key").write_bytes(pem_key(srv_key))
    (d / "sa.key").write_bytes(pem_key(sa_key))
    (d / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


@dataclasses.dataclass
class Cluster:
    url: str
    dir: pathlib.Path
    kubeconfig: pathlib.Path  # admin
    procs: list[subprocess.Popen]

    def kubeconfig_text(self, token: str = ADMIN_TOKEN, namespace: str = "default") -> str:
        ca = (self.dir / "ca.crt").read_text()
        import base64

        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "envtest",
                "clusters": [
                    {
                        "name": "envtest",
                        "cluster": {
                            "server": self.url,
                            "certificate-authority-data": base64.b64encode(ca.encode()).decode(),
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [
                    {"name": "envtest", "context": {"cluster": "envtest", "user": "u", "namespace": namespace}}
                ],
            }
        )

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, kubeconfig: pathlib.Path | None = None
    ) -> subprocess.CompletedProcess:
        cmd = ["kubectl", f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=60)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def sa_kubeconfig(self, namespace: str, sa: str, path: pathlib.Path) -> pathlib.Path:
        """A kubeconfig holding a real bound token of a ServiceAccount (TokenRequest API)."""
        token = self.kubectl("create", "token", sa, "-n", namespace, "--duration=2h").stdout.strip()
        path.write_text(self.kubeconfig_text(token, namespace))
        return path

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _ready(url: str, ctx: ssl.SSLContext) -> bool:
    req = urllib.request.Request(url + "/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            return r.read().strip() == b"ok"
    except OSError:
        return False


def start(assets: pathlib.Path, workdir: pathlib.Path, timeout_s: float = 120.0) -> Cluster:
    (workdir / "certs").mkdir(parents=True, exist_ok=True)  # the loopback cert lands here
    _certs(workdir)
    (workdir / "tokens.csv").write_text(f'{ADMIN_TOKEN},envtest-admin,envtest-admin,"system:masters"\n')
    etcd_port, peer_port, api_port = _free_port(), _free_port(), _free_port()
    logs = [open(workdir / n, "wb") for n in ("etcd.log", "apiserver.log")]
    etcd = subprocess.Popen(
        [
            str(assets / "etcd"),
            "--name",
            "envtest",
            "--data-dir",
            str(workdir / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-cluster",
            f"envtest=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync",
        ],
        stdout=logs[0],
        stderr=subprocess.STDOUT,
    )
    d = str(workdir)
    api = subprocess.Popen(
        [
            str(assets / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--cert-dir={d}/certs",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--endpoint-reconciler-type=none",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={d}/sa.pub",
            f"--service-account-signing-key-file={d}/sa.key",
            f"--tls-cert-file={d}/server.crt",
            f"--tls-private-key-file={d}/server.key",
            f"--client-ca-file={d}/ca.crt",
            f"--token-auth-file={d}/tokens.csv",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
        ],
        stdout=logs[1],
        stderr=subprocess.STDOUT,
    )
    url = f"https://127.0.0.1:{api_port}"
    cluster = Cluster(url=url, dir=workdir, kubeconfig=workdir / "kubeconfig", procs=[etcd, api])
    cluster.kubeconfig.write_text(cluster.kubeconfig_text())
    ctx = ssl.create_default_context(cafile=str(workdir / "ca.crt"))
    deadline = time.monotonic() + timeout_s
    while not _ready(url, ctx):
        if api.poll() is not None or etcd.poll() is not None or time.monotonic() > deadline:
            tail = (workdir / "apiserver.log").read_text(errors="replace")[-3000:]
            cluster.stop()
            raise RuntimeError(f"kube-apiserver did not become ready within {timeout_s}s:\n{tail}")
        time.sleep(0.5)
    return cluster


# helm-sdkpy runs in a child process: its Go runtime reads the environment the *process* started
# with, and one chart action per process keeps Go state from leaking between tests.
HELM_CHILD = """
import asyncio, json, sys, helm_sdkpy
kubeconfig, action, release, namespace, chart, values = json.load(sys.stdin)
cfg = helm_sdkpy.Configuration(namespace=namespace, kubeconfig=kubeconfig)
try:
    if action == "install":
        rel = helm_sdkpy.Install(cfg).run(release, chart, values=values, create_namespace=True, wait=False,
                                          timeout=60, disable_openapi_validation=False)
    elif action == "upgrade":
        rel = helm_sdkpy.Upgrade(cfg).run(release, chart, values=values, wait=False, timeout=60,
                                          disable_openapi_validation=False)
    else:
        rel = helm_sdkpy.Uninstall(cfg).run(release, wait=False, timeout=60)
    print(json.dumps(asyncio.run(rel)))
except helm_sdkpy.HelmError as e:
    print(json.dumps({"error": str(e)}))
"""


def helm(
    cluster: Cluster, action: str, release: str, namespace: str, chart: str = "", values: dict | None = None
) -> dict:
    """A real Helm install/upgrade/uninstall through the Helm library; raises on Helm errors."""
    import sys

    payload = json.dumps([str(cluster.kubeconfig), action, release, namespace, chart, values or {}])
    res = subprocess.run([sys.executable, "-c", HELM_CHILD], input=payload, capture_output=True, text=True, timeout=180)
    if res.returncode != 0 or not res.stdout.strip():
        raise RuntimeError(f"helm {action} crashed ({res.returncode}): {res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if "error" in out:
        raise RuntimeError(f"helm {action} {release}: {out['error']}")
    return out

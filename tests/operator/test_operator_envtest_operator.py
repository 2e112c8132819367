"""The real `verifypd-operator` entry point against a real kube-apiserver (envtest), installed by
the chart and authenticated as the chart's service account (a real bound token, so the chart's
RBAC is what the operator gets). It runs with the very arguments the chart renders.

What the server cannot show: no pods run (Deployments never get ready replicas, so Ready stays
False and no router answers Control), and nothing is garbage-collected (the operator's delete
handler removes the owned objects itself, which is what is checked).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import kubernetes
import pytest
import yaml
from envtest import helm
from operator_helpers import CHART, EXAMPLE, ROOT, wait_until

from verifypd_operator.kube import Kube

pytestmark = pytest.mark.live  # a real API server (envtest) (tests/README.md)

RELEASE, SYSTEM_NS = "e2e", "e2e-sys"
# A Go runtime panic inside the server's CEL evaluation (the race shows as "index out of range [i]
# with length j" or "invalid memory address or nil pointer dereference"); a rule that really fails
# reads "Invalid value: ...: <its message>" without "internal error: runtime error".
APISERVER_CEL_RACE = re.compile(r"internal error: runtime error: [^'\"]{1,120} evaluating rule")
SA = "e2e-verifypd"
TIMEOUT = 120.0  # generous: 2 loaded cores shared with other test runs; waits return as soon as true


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Operator:
    """One `verifypd-operator` process (the console script's `main()`), logging to a file."""

    def __init__(self, args: list[str], kubeconfig, log_path, pod_name: str):
        self.log_path = log_path
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "POD_NAME": pod_name,
            "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("services", "operator", "loadgen")),
        }
        args = [a for a in args if not a.startswith(("--liveness", "--otlp-port", "--tick"))]
        args += [f"--liveness=http://127.0.0.1:{_port()}/healthz", f"--otlp-port={_port()}", "--tick=1"]
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from verifypd_operator.main import main; main()", *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tracebacks(self) -> list[str]:
        """Log records carrying a traceback, except kube-apiserver 1.25.0's CEL data race.

        That server (envtest's) evaluates CRD validation rules on concurrent writes with a racy
        cel-go (kubernetes#114661, fixed in 1.25.6): a valid status patch now and then gets 422
        "internal error: runtime error: <a Go panic> evaluating rule". kopf
        logs it and retries the handler after its error backoff, so nothing is lost; every other
        traceback is the operator's own and fails the test."""
        records = re.split(r"\n(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", self.text())
        return [r for r in records if "Traceback" in r and not APISERVER_CEL_RACE.search(r)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def wait_for(fn, what: str, ops=(), timeout: float = TIMEOUT):
    def alive() -> None:
        for op in ops:
            assert op.proc.poll() is None, f"operator exited ({op.proc.returncode}):\n{op.text()[-4000:]}"

    return wait_until(
        fn, what, timeout, interval=0.3, alive=alive, logs=lambda: "\n".join(op.text()[-4000:] for op in ops)
    )


@pytest.fixture(scope="module")
def release(crds):
    """The chart, installed once (cluster-wide, one replica); returns the operator's rendered args."""
    rel = helm(crds, "install", RELEASE, SYSTEM_NS, str(CHART))
    dep = next(d for d in yaml.safe_load_all(rel["manifest"]) if d and d["kind"] == "Deployment")
    yield dep["spec"]["template"]["spec"]["containers"][0]["args"]
    helm(crds, "uninstall", RELEASE, SYSTEM_NS)


@pytest.fixture(scope="module")
def admin(crds):
    return Kube(kubernetes.config.new_client_from_config(config_file=str(crds.kubeconfig)))


def cr_path(ns: str, name: str = "") -> str:
    return f"/apis/verifypd.dev/v1alpha1/namespaces/{ns}/verifypdconfigs" + (f"/{name}" if name else "")


def condition(cr: dict | None, type_: str) -> dict:
    return next((c for c in ((cr or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def events(admin: Kube, ns: str, name: str) -> list[dict]:
    items = (admin.request("GET", f"/api/v1/namespaces/{ns}/events") or {}).get("items", [])
    return [e for e in items if e["involvedObject"].get("name") == name]


def merge_patch(admin: Kube, ns: str, name: str, spec: dict) -> int:
    out = admin.request("PATCH", cr_path(ns, name), {"spec": spec}, content_type="application/merge-patch+json")
    return out["metadata"]["generation"]


def test_entry_point_reconciles_the_example(envtest, release, admin, namespace, tmp_path):
    kubeconfig = envtest.sa_kubeconfig(SYSTEM_NS, SA, tmp_path / "sa-kubeconfig")
    op = Operator(release, kubeconfig, tmp_path / "operator.log", "e2e-verifypd-0")
    ops = [op]
    try:
        envtest.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
        cr = admin.request("GET", cr_path(namespace, "smollm2"))
        uid = cr["metadata"]["uid"]
        dep = wait_for(lambda: admin.get("Deployment", namespace, "smollm2-colocated"), "colocated Deployment", ops)
        ref = dep["metadata"]["ownerReferences"][0]
        assert (ref["uid"], ref["kind"], ref["controller"]) == (uid, "VerifyPDConfig", True)
        for svc in ("smollm2", "smollm2-gateway-pods"):
            # the Deployment is applied before the Services in one reconcile: wait, do not read once
            live_svc = wait_for(lambda svc=svc: admin.get("Service", namespace, svc), f"Service {svc}", ops)
            assert live_svc["metadata"]["ownerReferences"][0]["uid"] == uid
            assert {"name": "http", "port": 8000} in [
                {k: p[k] for k in ("name", "port")} for p in live_svc["spec"]["ports"]
            ], live_svc["spec"]
        secret = wait_for(lambda: admin.get("Secret", namespace, "smollm2-lane-secret"), "lane Secret", ops)
        assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
        token = secret["data"]["lane-secret"]
        policy = wait_for(lambda: admin.get("NetworkPolicy", namespace, "smollm2-lanes"), "NetworkPolicy", ops)
        assert policy["metadata"]["ownerReferences"][0]["uid"] == uid
        cr = wait_for(
            lambda: (
                (c := admin.request("GET", cr_path(namespace, "smollm2")))
                and condition(c, "Progressing").get("reason") == "Reconciled"
                and c
            ),
            "status",
            ops,
        )
        assert condition(cr, "Ready")["status"] == "False"  # no pods run on envtest
        assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]
        assert cr["status"]["applied"]["kMax"] == 8 and cr["status"]["replicasText"] == "1 pods"
        table = envtest.kubectl("get", "vpd", "smollm2", "-n", namespace).stdout
        assert table.split("\n")[0].split()[:4] == ["NAME", "TOPOLOGY", "K", "REPLICAS"], table
        assert table.split("\n")[1].split()[:5] == ["smollm2", "colocated", "8", "1", "pods"], table
        wait_for(
            lambda: any(e["reason"] == "Reconciled" for e in events(admin, namespace, "smollm2")),
            "Reconciled event",
            ops,
        )

        # Edits: replicas, kMax and SLOs; then colocated -> split (colocated pruned) and back.
        gen = merge_patch(
            admin,
            namespace,
            "smollm2",
            {"colocated": {"replicas": 2}, "speculation": {"kMax": 6}, "slo": {"itlP95Ms": 80}},
        )
        wait_for(
            lambda: admin.get("Deployment", namespace, "smollm2-colocated")["spec"]["replicas"] == 2,
            "colocated scaled to 2",
            ops,
        )
        cr = wait_for(
            lambda: (
                (c := admin.request("GET", cr_path(namespace, "smollm2")))["status"].get("observedGeneration") == gen
                and c
            ),
            "observedGeneration",
            ops,
        )
        assert cr["status"]["applied"]["kMax"] == 6 and cr["status"]["replicasText"] == "2 pods"
        merge_patch(admin, namespace, "smollm2", {"topology": "split"})
        for lane in ("gateway", "prefill", "draft", "verify"):
            wait_for(lambda lane=lane: admin.get("Deployment", namespace, f"smollm2-{lane}"), f"{lane} Deployment", ops)
        wait_for(lambda: admin.get("Deployment", namespace, "smollm2-colocated") is None, "colocated pruned", ops)
        assert admin.get("Service", namespace, "smollm2-verify")["spec"]["clusterIP"] == "None"
        lanes = wait_for(
            lambda: (
                (p := admin.get("NetworkPolicy", namespace, "smollm2-lanes"))
                and p["spec"]["podSelector"].get("matchExpressions")
                and p
            ),
            "split NetworkPolicy",
            ops,
        )
        assert lanes["spec"]["ingress"][0]["ports"] == [
            {"protocol": "TCP", "port": 50051},
            {"protocol": "TCP", "port": 50052},
        ]  # gRPC, calls
        lane_ports = {p["name"]: p for p in admin.get("Service", namespace, "smollm2-verify")["spec"]["ports"]}
        assert (lane_ports["calls"]["port"], lane_ports["calls"]["targetPort"]) == (50052, "calls"), lane_ports
        assert lanes["metadata"]["ownerReferences"][0]["uid"] == uid
        # Reconciled several times since: the token was kept, not rotated.
        assert admin.get("Secret", namespace, "smollm2-lane-secret")["data"]["lane-secret"] == token
        gw = admin.get("Deployment", namespace, "smollm2-gateway")["spec"]["template"]["spec"]["containers"][0]
        assert gw["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}
        merge_patch(admin, namespace, "smollm2", {"topology": "colocated"})
        wait_for(lambda: admin.get("Deployment", namespace, "smollm2-verify") is None, "lanes pruned", ops)
        wait_for(lambda: admin.get("Service", namespace, "smollm2-verify") is None, "lane Service pruned", ops)

        _dra_failure_is_visible(envtest, admin, namespace, ops)

        admin.request("DELETE", cr_path(namespace, "smollm2"))
        wait_for(lambda: admin.request("GET", cr_path(namespace, "smollm2")) is None, "CR deleted", ops)
        assert admin.owned("smollm2", namespace) == []
        assert op.tracebacks() == [], op.text()[-4000:]
    finally:
        for o in ops:
            o.stop()


def _dra_failure_is_visible(envtest, admin: Kube, ns: str, ops) -> None:
    """gpuSharing: dra on v1.25 (no resource.k8s.io/v1): Degraded with the missing API, a Warning
    event; fixing the spec clears Degraded."""
    spec = {"colocated": {"gpuSharing": "dra"}}
    envtest.kubectl(
        "apply",
        "-n",
        ns,
        "-f",
        "-",
        input=yaml.safe_dump(
            {"apiVersion": "verifypd.dev/v1alpha1", "kind": "VerifyPDConfig", "metadata": {"name": "dra"}, "spec": spec}
        ),
    )
    cr = wait_for(
        lambda: (
            (c := admin.request("GET", cr_path(ns, "dra"))) and condition(c, "Degraded").get("status") == "True" and c
        ),
        "Degraded=True",
        ops,
    )
    deg = condition(cr, "Degraded")
    assert deg["reason"] == "APINotServed", deg
    assert "resource.k8s.io/v1 ResourceClaimTemplate is not served" in deg["message"], deg
    assert "gpuSharing: devicePlugin" in deg["message"]
    assert condition(cr, "Progressing")["status"] == "False"
    ev = wait_for(lambda: [e for e in events(admin, ns, "dra") if e["type"] == "Warning"], "Warning event", ops)
    assert ev[0]["reason"] == "APINotServed" and "resource.k8s.io/v1" in ev[0]["message"]
    time.sleep(3)  # several timer ticks: the timer must not clear the reconcile failure
    assert condition(admin.request("GET", cr_path(ns, "dra")), "Degraded")["reason"] == "APINotServed"
    merge_patch(admin, ns, "dra", {"colocated": {"gpuSharing": "devicePlugin"}})
    wait_for(
        lambda: condition(admin.request("GET", cr_path(ns, "dra")), "Degraded").get("status") == "False",
        "Degraded cleared",
        ops,
    )
    admin.request("DELETE", cr_path(ns, "dra"))
    wait_for(lambda: admin.request("GET", cr_path(ns, "dra")) is None, "dra deleted", ops)


def is_active(op: Operator) -> bool:
    """kopf's own log: the last pause/resume line decides (it starts paused with mandatory peering)."""
    text = op.text()
    return text.rfind("Resuming operations after the pause") > max(
        text.rfind("Pausing operations"), text.rfind("Pausing all operators")
    )


def test_peering_two_replicas_one_active(envtest, release, admin, namespace, tmp_path):
    """operator.replicas: 2 -> the chart's ClusterKopfPeering; both replicas start and see each
    other, exactly one reconciles. Without the peering object the operator says so and exits."""
    kubeconfig = envtest.sa_kubeconfig(SYSTEM_NS, SA, tmp_path / "sa-kubeconfig")
    rel = helm(envtest, "upgrade", RELEASE, SYSTEM_NS, str(CHART), {"operator": {"replicas": 2}})
    args = next(d for d in yaml.safe_load_all(rel["manifest"]) if d and d["kind"] == "Deployment")["spec"]["template"][
        "spec"
    ]["containers"][0]["args"]
    assert "--peering-name=e2e-verifypd" in args
    for cfg, problem in [(envtest.kubeconfig, "not found"), (kubeconfig, "forbidden")]:
        bad = Operator(
            [a for a in args if not a.startswith("--peering-name")] + ["--peering-name=nope"],
            cfg,
            tmp_path / "bad.log",
            "x",
        )
        try:
            bad.proc.wait(timeout=TIMEOUT)
        finally:
            bad.stop()  # never leave an operator running, also when it hangs (the defect)
        assert bad.proc.returncode == 2, bad.text()[-2000:]
        assert "clusterkopfpeerings/nope" in bad.text() and problem in bad.text(), bad.text()[-2000:]
    ops = [Operator(args, kubeconfig, tmp_path / f"op{i}.log", f"e2e-verifypd-{i}") for i in range(2)]
    try:
        peers = wait_for(
            lambda: (
                len(admin.request("GET", "/apis/kopf.dev/v1/clusterkopfpeerings/e2e-verifypd").get("status") or {}) == 2
                and True
            ),
            "two peers in the peering",
            ops,
        )
        assert peers
        # With mandatory peering kopf starts paused and resumes once it is the top priority; a replica
        # that resumed while alone pauses when a higher one appears. Exactly one active, then go on.
        wait_for(lambda: sum(map(is_active, ops)) == 1, "exactly one active replica", ops)
        envtest.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
        wait_for(lambda: admin.get("Deployment", namespace, "smollm2-colocated"), "reconciled by a peer", ops)
        # Only this config counts: configs left by earlier tests are resumed by both replicas in
        # the moment before they see each other (kopf peering settles after startup). The log line
        # comes after the children are written (it once lagged the Deployment on a loaded CPU).
        done = f"reconciled {namespace}/smollm2"
        wait_for(lambda: any(done in o.text() for o in ops), "the reconcile logged", ops)
        active = [o for o in ops if done in o.text()]
        assert len(active) == 1, [o.text()[-2000:] for o in ops]
        admin.request("DELETE", cr_path(namespace, "smollm2"))
        wait_for(lambda: admin.request("GET", cr_path(namespace, "smollm2")) is None, "CR deleted", ops)
    finally:
        for o in ops:
            o.stop()
        helm(envtest, "upgrade", RELEASE, SYSTEM_NS, str(CHART), {})

"""The Helm chart through the Helm library (helm-sdkpy): lint, and a real `helm install` against
kmock's API emulator (release storage in memory) whose rendered manifests are validated."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys

import helm_sdkpy
import kmock
import kubernetes_validate
import pytest
import yaml
from operator_helpers import CHART, EXAMPLE, K8S_VERSION, declare_kinds, emulator, kubeconfig_for


def lint(path=CHART):
    cfg = helm_sdkpy.Configuration(namespace="verifypd")
    return asyncio.run(helm_sdkpy.Lint(cfg).run(str(path)))


def test_lint_passes_and_catches_broken_templates(tmp_path):
    res = lint()
    assert res["TotalChartsLinted"] == 1
    assert not res["Errors"] and all(m["Severity"] < 3 for m in res["Messages"]), res  # 3 = error
    broken = tmp_path / "verifypd"
    shutil.copytree(CHART, broken)
    (broken / "templates" / "broken.yaml").write_text("{{ .Values.nope.missing }}\n")
    assert lint(broken)["Errors"]


# Runs in a child process: helm-sdkpy's Go runtime reads the environment the *process* started
# with (putenv from Python is not seen), and HELM_DRIVER=memory keeps release records out of
# protobuf-encoded Secrets, which the kmock emulator cannot decode.
HELM_CHILD = """
import asyncio, json, sys, helm_sdkpy
kubeconfig, chart, values = json.load(sys.stdin)
cfg = helm_sdkpy.Configuration(namespace="verifypd", kubeconfig=kubeconfig)
try:
    rel = asyncio.run(helm_sdkpy.Install(cfg).run("vpd", chart, values=values, wait=False, timeout=60))
except helm_sdkpy.HelmError as e:
    print(json.dumps({"error": str(e)})); sys.exit(0)
print(json.dumps(rel))
"""


async def _install(values):
    async with emulator() as k, kmock.Server(k):
        declare_kinds(k)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            HELM_CHILD,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "HELM_DRIVER": "memory"},
        )
        payload = json.dumps([kubeconfig_for(str(k.url).rstrip("/")), str(CHART), values]).encode()
        out, _ = await asyncio.wait_for(proc.communicate(payload), timeout=120)
        rel = json.loads(out)
        created = [str(r.url.path) for r in list(k) if str(r.method).upper().endswith("POST")]
        return rel, created


def install(values=None):
    rel, created = asyncio.run(_install(values or {}))
    if "error" in rel:
        raise helm_sdkpy.HelmError(rel["error"])
    return rel, created


def manifests(rel):
    docs = [d for d in yaml.safe_load_all(rel["manifest"]) if d]
    hooks = [yaml.safe_load(h["manifest"]) for h in rel.get("hooks") or []]
    return docs, hooks


def test_default_install_renders_valid_manifests():
    rel, created = install()
    assert rel["info"]["status"] == "deployed"
    docs, hooks = manifests(rel)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount"]
    for d in docs + hooks:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "ghcr.io/verifypd/verifypd-operator:0.1.0"
    assert "--standalone" in c["args"]
    assert "--otlp-endpoint=http://vpd-verifypd-otlp.verifypd.svc:4317" in c["args"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # The test hook sends one Generate with the service image.
    assert [h["metadata"]["annotations"]["helm.sh/hook"] for h in hooks] == ["test"]
    assert "Generate" in hooks[0]["spec"]["containers"][0]["args"][0]
    # CRDs from crds/ were created in the (mock) cluster before the templates.
    crd_posts = [p for p in created if p.endswith("/customresourcedefinitions")]
    assert len(crd_posts) == 3
    notes = rel["info"].get("notes", "")
    assert "verifypd.v1.Generation/Generate" in notes
    # README's walkthrough: the example config applied in the release namespace is the one NOTES and
    # `helm test` call (its gateway Service is named after it: builders.build_services).
    example = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    assert "kubectl apply -n verifypd -f deploy/examples/verifypdconfig.yaml" in notes
    assert f"port-forward -n verifypd svc/{example} 50051:50051" in notes and "helm test vpd -n verifypd" in notes
    assert "svc/verifypd" not in notes
    hook = hooks[0]
    assert hook["metadata"]["namespace"] == "verifypd"
    assert f'target = "{example}.verifypd.svc:50051"' in hook["spec"]["containers"][0]["args"][0]


def test_non_default_values():
    rel, _ = install(
        {
            "operator": {
                "replicas": 2,
                "watchNamespaces": ["team-a", "team-b"],
                "image": {"repository": "registry.local/op", "tag": "dev"},
            },
            "otlp": {"endpoint": "http://otel-collector.monitoring:4317"},
            "defaultConfig": {"create": True, "name": "llm", "spec": {"topology": "split"}},
        }
    )
    docs, hooks = manifests(rel)
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    for d in docs:  # custom kinds: the CR is checked against our CRD below; KopfPeering is free-form
        if d["kind"] not in ("VerifyPDConfig", "KopfPeering"):
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    assert sorted(r["metadata"]["namespace"] for r in by_kind["Role"]) == ["team-a", "team-b"]
    assert len(by_kind["KopfPeering"]) == 2
    args = by_kind["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering-name=vpd-verifypd" in args and "--standalone" not in args
    assert "--namespace=team-a" in args and "--otlp-endpoint=http://otel-collector.monitoring:4317" in args
    cluster_rules = by_kind["ClusterRole"][0]["rules"]
    assert not any("deployments" in r["resources"] for r in cluster_rules)  # namespaced only
    cfg = by_kind["VerifyPDConfig"][0]
    assert cfg["spec"]["topology"] == "split"
    assert cfg["spec"]["image"] == {"repository": "ghcr.io/verifypd/verifypd", "tag": "0.1.0"}
    from test_operator_crd import validate_cr

    assert validate_cr(cfg)[0] == []
    # NOTES and the test hook follow the default config into the first watched namespace.
    notes = rel["info"].get("notes", "")
    assert "kubectl apply -n team-a -f" in notes and "port-forward -n team-a svc/llm 50051:50051" in notes
    assert hooks[0]["metadata"]["namespace"] == "team-a"
    assert 'target = "llm.team-a.svc:50051"' in hooks[0]["spec"]["containers"][0]["args"][0]


@pytest.mark.parametrize(
    "values",
    [
        {"operator": {"replicas": 0}},
        {"operator": {"logLevel": "LOUD"}},
        {"otlp": {"endpoint": "otel:4317"}},
        {"defaultConfig": {"name": "Bad_Name"}},
        {"unknownKey": 1},
    ],
)
def test_schema_rejects_bad_values(values):
    with pytest.raises(helm_sdkpy.HelmError) as e:
        install(values)
    assert "schema" in str(e.value).lower() or "values don't meet" in str(e.value).lower(), e.value

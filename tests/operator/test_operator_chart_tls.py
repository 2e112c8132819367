"""The chart's TLS choice (values `tls.*`, schema, operator args, RBAC, the `helm test` pod), rendered
by the real Helm SDK into kmock; the rendered args parsed by the operator's own parser."""

from __future__ import annotations

import helm_sdkpy
import kubernetes_validate
import pytest
from operator_helpers import K8S_VERSION
from test_operator_chart import install, manifests

from verifypd_operator.main import parse_args


def _rendered(values=None):
    docs, hooks = manifests(install(values)[0])
    dep = next(d for d in docs if d["kind"] == "Deployment")
    rules = [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]
    return dep["spec"]["template"]["spec"]["containers"][0]["args"], rules, hooks[0], docs


def _cert_manager_rule(rules):
    return [r for r in rules if "cert-manager.io" in r["apiGroups"]]


def test_tls_is_off_by_default():
    args, rules, hook, _ = _rendered()
    parsed = parse_args(args)
    assert (parsed.tls, parsed.tls_cert_days, parsed.tls_issuer) == ("off", 30, None)
    assert not _cert_manager_rule(rules)
    assert "insecure_channel" in hook["spec"]["containers"][0]["args"][0] and "volumes" not in hook["spec"]


@pytest.mark.parametrize("mode", ["cert-manager", "auto"])
def test_cert_manager_modes_render_args_rbac_and_a_tls_test_pod(mode):
    args, rules, hook, docs = _rendered(
        {"tls": {"mode": mode, "certDays": 10, "issuer": "ClusterIssuer/corp-ca"}, "test": {"configName": "llm"}}
    )
    for d in docs + [hook]:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    parsed = parse_args(args)
    assert (parsed.tls, parsed.tls_cert_days, parsed.tls_issuer) == (mode, 10, "ClusterIssuer/corp-ca")
    assert _cert_manager_rule(rules) == [
        {
            "apiGroups": ["cert-manager.io"],
            "resources": ["certificates", "issuers"],
            "verbs": ["get", "list", "create", "patch", "delete"],
        }
    ]
    script = hook["spec"]["containers"][0]["args"][0]
    assert "secure_channel" in script and "insecure_channel" not in script
    compile(script, "helm-test", "exec")  # the rendered Python is valid
    assert hook["spec"]["volumes"] == [
        {"name": "tls", "secret": {"secretName": "llm-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}
    ]


def test_operator_mode_needs_no_cert_manager_rbac():
    args, rules, _, _ = _rendered({"tls": {"mode": "operator"}})
    assert parse_args(args).tls == "operator" and not _cert_manager_rule(rules)


@pytest.mark.parametrize(
    "values", [{"tls": {"mode": "on"}}, {"tls": {"issuer": "corp-ca"}}, {"tls": {"certDays": 1}}, {"tls": {"other": 1}}]
)
def test_schema_rejects_bad_tls_values(values):
    with pytest.raises(helm_sdkpy.HelmError) as e:
        install(values)
    assert "schema" in str(e.value).lower() or "values don't meet" in str(e.value).lower(), e.value

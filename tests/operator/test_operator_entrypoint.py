"""Pure parts of the entry point and the reconcile failure path (no API server)."""

from __future__ import annotations

import kopf
import pytest

from verifypd_operator import status as st
from verifypd_operator.handlers import ReconcileError, apply_all
from verifypd_operator.kube import ApiError, ApiNotServed
from verifypd_operator.main import parse_args, peering_paths, register_login


def test_registry_has_a_login_handler():
    def logins(registry):
        return [h for h in registry._activities.get_all_handlers() if h.activity.value == "authentication"]

    registry = kopf.OperatorRegistry()
    assert logins(registry) == []  # why kopf never logged in before
    register_login(registry)
    assert len(logins(registry)) == 1


def test_peering_is_off_unless_named():
    assert parse_args([]).peering_name == ""
    assert peering_paths("p", []) == ["/apis/kopf.dev/v1/clusterkopfpeerings/p"]
    assert peering_paths("p", ["a", "b"]) == [
        "/apis/kopf.dev/v1/namespaces/a/kopfpeerings/p",
        "/apis/kopf.dev/v1/namespaces/b/kopfpeerings/p",
    ]


def test_reconcile_failure_conditions_stick_until_success():
    conds = st.reconcile_failed(None, st.API_NOT_SERVED, "no DRA", 0.0, 3)
    by = {c["type"]: c for c in conds}
    assert by["Degraded"]["status"] == "True" and by["Degraded"]["reason"] == "APINotServed"
    assert by["Progressing"]["status"] == "False" and by["Degraded"]["observedGeneration"] == 3
    assert st.reconcile_failure_pending(conds)
    ok = st.set_condition(conds, "Degraded", False, "AsExpected", "", 1.0, 4)
    assert not st.reconcile_failure_pending(ok)


class FailingKube:
    def __init__(self, error):
        self.error, self.applied = error, []

    def apply(self, obj):
        if obj["kind"] == "ResourceClaimTemplate":
            raise self.error
        self.applied.append(obj["kind"])

    def prune(self, *a, **k):
        return []


@pytest.mark.parametrize(
    "error, reason, text",
    [
        (ApiNotServed("resource.k8s.io/v1", "ResourceClaimTemplate"), "APINotServed", "gpuSharing: devicePlugin"),
        (ApiError(422, '{"message": "spec.x: Invalid value"}'), "APIError", "HTTP 422: spec.x: Invalid value"),
    ],
)
def test_apply_all_names_the_object_and_cause(error, reason, text):
    class Ctx:
        kube = FailingKube(error)

    objs = [
        {"kind": "Deployment", "metadata": {"name": "d"}},
        {"kind": "ResourceClaimTemplate", "metadata": {"name": "d-gpu"}},
    ]
    with pytest.raises(ReconcileError) as e:
        apply_all(Ctx, "d", "ns", objs)
    assert e.value.reason == reason and "ResourceClaimTemplate d-gpu" in str(e.value) and text in str(e.value)


def test_reconcile_keeps_the_autoscalers_live_scale():
    """A reconcile that started from a status older than the autoscaler's last scale must not undo
    it: a unit's live Deployment replicas win over status; a user's edit of `replicas` wins over both."""
    from verifypd_operator.spec import parse_spec

    spec = parse_spec({"topology": "split", "lanes": {"verify": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}}})
    stale = {"autoscaler": {"replicas": {"prefill": 1, "draft": 1, "verify": 1}}}
    assert st.unit_replicas(spec, stale, live={"verify": 2})["verify"] == 2
    assert st.unit_replicas(spec, stale, reset=["verify"], live={"verify": 2})["verify"] == 1
    assert st.unit_replicas(spec, stale, live={"verify": 9})["verify"] == 3  # clamped to maxReplicas
    assert st.unit_replicas(spec, {"autoscaler": {"replicas": {"verify": 2}}})["verify"] == 2  # no Deployment yet
    assert st.unit_replicas(spec, None)["verify"] == 1

"""Fixtures of the operator tests (helpers live in operator_helpers.py and envtest.py)."""

from __future__ import annotations

import pathlib
import tempfile

import operator_helpers  # noqa: F401  (puts services/operator/loadgen on sys.path)
import pytest


@pytest.fixture
def owner():
    return {
        "apiVersion": "verifypd.dev/v1alpha1",
        "kind": "VerifyPDConfig",
        "metadata": {"name": "demo", "namespace": "default", "uid": "0000-1111"},
    }


@pytest.fixture(scope="session")
def envtest():
    """One real etcd + kube-apiserver for the whole session (tests isolate by namespace)."""
    import envtest as et

    assets = et.assets_dir()
    if assets is None:
        pytest.skip(
            "needs a real API server: KUBEBUILDER_ASSETS is unset "
            "(export KUBEBUILDER_ASSETS=$(bash ../shared/k8s-envtest/setup.sh))"
        )
    cluster = et.start(assets, pathlib.Path(tempfile.mkdtemp(prefix="verifypd-envtest-")))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def crds(envtest):
    """The chart's CRDs, applied to the session's API server and Established."""
    from operator_helpers import CHART

    for f in sorted((CHART / "crds").glob("*.yaml")):
        envtest.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(f))
    envtest.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/verifypdconfigs.verifypd.dev",
        "crd/clusterkopfpeerings.kopf.dev",
        "crd/kopfpeerings.kopf.dev",
    )
    return envtest


_ns_counter = iter(range(1, 1_000_000))


@pytest.fixture
def namespace(envtest):
    """A fresh namespace per test (no controller-manager: deleting one never finishes, so none is)."""
    name = f"t{next(_ns_counter)}"
    envtest.kubectl("create", "namespace", name)
    return name

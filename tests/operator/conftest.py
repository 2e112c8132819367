"""Fixtures of the operator tests (helpers live in operator_helpers.py)."""
from __future__ import annotations

import pytest

import operator_helpers  # noqa: F401  (puts services/operator/loadgen on sys.path)


@pytest.fixture
def owner():
    return {"apiVersion": "verifypd.dev/v1alpha1", "kind": "VerifyPDConfig",
            "metadata": {"name": "demo", "namespace": "default", "uid": "0000-1111"}}

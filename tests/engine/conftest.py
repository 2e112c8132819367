"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""
from __future__ import annotations

import pytest

from engine_helpers import write_target_and_draft


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    return write_target_and_draft(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def hf_target(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models[0]).eval()

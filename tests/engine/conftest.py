"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""
from __future__ import annotations

import pytest

from engine_helpers import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("models")
    target = write_tiny_llama(root / "target", seed=1, layers=3)
    draft = write_tiny_llama(root / "draft", seed=1, layers=3, noise=0.2, noise_seed=7)
    return str(target), str(draft)


@pytest.fixture(scope="session")
def hf_target(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models[0]).eval()

"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

import os

import pytest

# The Triton kernels run on CPU through Triton's interpreter; it must be chosen before triton loads.
if os.environ.get("VERIFYPD_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into a loop bound with int(ndarray), which
    numpy >= 2.4 refuses for 1-element arrays of one dimension; read the element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter()

from engine_helpers import write_target_and_draft  # noqa: E402 (after TRITON_INTERPRET is chosen: it may load triton)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    return write_target_and_draft(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def hf_target(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models[0]).eval()

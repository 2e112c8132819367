"""The family matrix: every supported model type (families.SUPPORTED_TYPES) loads from a local directory
AND by name from the Hugging Face cache layout (models--ORG--NAME/snapshots/REV, refs/main; offline),
and generates exactly transformers' greedy tokens (fp32) with no speculation, the default draft
(prompt lookup on the CPU) and a self-draft (`self:1`). One tiny random checkpoint per family, written
with transformers' own config and model classes, the family's features switched on (windows shorter
than the prompts, soft caps, q/k norms, qkv biases, experts); few prompts, few tokens."""

from __future__ import annotations

import pathlib
import random
import shutil

import pytest
import torch
from engine_helpers import VOCAB, make_engine, write_tiny_llama
from family_checkpoints import LONGROPE_CONTEXT, hf_greedy_through_eos, write_family, write_tiny_moe
from test_model_gemma import GEMMA_DIMS

from verifypd.domain.defaults import DEFAULT_DRAFT
from verifypd.domain.requests import RequestSpec
from verifypd.model.families import SUPPORTED_TYPES

pytestmark = pytest.mark.slow  # 60 engines over 10 families (~40 s)
NEW_TOKENS = 8
REVISION = "0123abcd"
# model_type -> how its tiny checkpoint is written (family_checkpoints' name where it has one).
WRITTEN_AS = {
    "llama": "llama3.2",
    "mistral": "mistral",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3_text",
    "phi3": "phi3",
}


def write_checkpoint(root: pathlib.Path, model_type: str) -> pathlib.Path:
    path = root / "local"
    if model_type in WRITTEN_AS:
        return write_family(path, WRITTEN_AS[model_type], seed=3)
    if model_type == "gemma":
        return write_tiny_llama(path, seed=3, **GEMMA_DIMS)
    if model_type in ("mixtral", "qwen3_moe"):
        return write_tiny_moe(path, model_type, write_tiny_llama(root / "tok", seed=0, layers=1), seed=4)
    if model_type == "qwen2":  # random init leaves the qkv biases at zero: make them matter
        from transformers import AutoModelForCausalLM

        write_tiny_llama(path, seed=4, layers=2, model_type="qwen2")
        hf = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        hf.save_pretrained(path)
        return path
    raise AssertionError(f"no tiny checkpoint for the supported type {model_type!r}: add one to the matrix")


def hub_copy(local: pathlib.Path, hub: pathlib.Path, name: str) -> None:
    """`local` as the Hugging Face cache holds a downloaded `name`."""
    repo = hub / ("models--" + name.replace("/", "--"))
    shutil.copytree(local, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


@pytest.fixture(scope="module", params=SUPPORTED_TYPES)
def family(request, tmp_path_factory):
    """(model type, local dir, hub dir, hub name, prompts, transformers' greedy outputs)."""
    from transformers import AutoModelForCausalLM

    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    local = write_checkpoint(root, model_type)
    name = f"verifypd-test/tiny-{model_type.replace('_', '-')}"
    hub_copy(local, root / "hub", name)
    hf = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.config.model_type == model_type
    rng = random.Random(17)
    prompts = [tuple(rng.randrange(3, VOCAB) for _ in range(n)) for n in (9, 14)]
    outputs = [hf_greedy_through_eos(hf, list(p), NEW_TOKENS) for p in prompts]
    return model_type, str(local), root / "hub", name, prompts, outputs


def test_every_supported_type_has_a_checkpoint():
    assert set(SUPPORTED_TYPES) == set(WRITTEN_AS) | {"gemma", "mixtral", "qwen3_moe", "qwen2"}
    assert DEFAULT_DRAFT == "ngram"  # "the default draft" below: prompt lookup on the CPU


@pytest.mark.parametrize("draft,k", [("none", 0), (DEFAULT_DRAFT, 3), ("self:1", 3)])
@pytest.mark.parametrize("layout", ["local", "hf_cache"])
def test_greedy_matches_transformers(family, layout, draft, k, monkeypatch):
    import huggingface_hub.constants

    _, local, hub, name, prompts, expected = family
    target = local
    if layout == "hf_cache":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        target = name
    engine = make_engine(target, draft, k=k, max_context=LONGROPE_CONTEXT)  # Phi-3's longrope: its original context
    assert engine.models.target.name == target
    done = engine.generate(
        [RequestSpec(p, max_tokens=NEW_TOKENS, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
    )
    assert [done[str(i)].token_ids for i in range(len(prompts))] == expected

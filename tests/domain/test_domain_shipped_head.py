"""The EAGLE head shipped in the package (verifypd.heads): `--draft eagle:smollm2` and
`eagle+ngram:smollm2` name it; its files load as a head of the embedded model's shape, and a target
of another shape refuses it with the usual message."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

from verifypd.domain.drafts import parse_draft
from verifypd.heads import SHIPPED_HEADS, shipped_head
from verifypd.model.eagle_head import load_eagle_head
from verifypd.model.llama import LlamaShape
from verifypd.model.loader import ModelLoadError, load_model

CPU = torch.device("cpu")
# SmolLM2-135M-Instruct, the embedded target the head was trained for.
SMOLLM2 = LlamaShape(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_context=2048,
)


@pytest.mark.parametrize("prefix", ["eagle:", "eagle+ngram:"])
def test_a_shipped_head_is_named_without_a_path(prefix):
    spec = parse_draft(f"{prefix}smollm2")
    assert spec.kind == "eagle" and spec.lookup == (prefix == "eagle+ngram:")
    root = pathlib.Path(spec.model)
    assert root == pathlib.Path(shipped_head("smollm2")) and root.is_dir()
    assert (root / "config.json").is_file() and (root / "model.safetensors").is_file()
    assert "LlamaForCausalLMEagle3" in json.loads((root / "config.json").read_text())["architectures"]


def test_paths_and_other_names_are_left_as_given(tmp_path):
    assert SHIPPED_HEADS == ("smollm2",)
    assert shipped_head("nope") is None and shipped_head("./smollm2") is None
    assert parse_draft(f"eagle:{tmp_path}").model == str(tmp_path)
    assert parse_draft("eagle:heads/smollm2").model == "heads/smollm2"
    assert parse_draft("eagle:nope").model == "nope"


def test_the_shipped_head_loads_for_the_embedded_models_shape():
    lm_head = torch.zeros(SMOLLM2.vocab_size, SMOLLM2.hidden_size, dtype=torch.bfloat16)
    config, weights = load_eagle_head(shipped_head("smollm2"), SMOLLM2, lm_head, CPU, torch.bfloat16)
    assert config.hidden_size == SMOLLM2.hidden_size and config.aux_layer_ids == (1, 14, 26)
    assert weights.lm_head is lm_head and weights.draft_to_target is None  # the target's own lm_head
    assert weights.fc.shape == (SMOLLM2.hidden_size, 3 * SMOLLM2.hidden_size)


def test_another_target_refuses_it_naming_the_flag(tiny_models):
    """A head is trained for one target: another shape fails at load with the flag and the reason."""
    wider = dataclasses.replace(SMOLLM2, hidden_size=640, head_dim=64, num_heads=10, num_kv_heads=5)
    lm_head = torch.zeros(wider.vocab_size, wider.hidden_size)
    with pytest.raises(ModelLoadError, match=r"--draft eagle:.*smollm2_eagle: head hidden sizes .* hidden size 640"):
        load_eagle_head(shipped_head("smollm2"), wider, lm_head, CPU, torch.float32)
    target = load_model(tiny_models[0], CPU, torch.float32)  # 3 layers: the head reads layers 1, 14 and 26
    with pytest.raises(ModelLoadError, match=r"--draft eagle:.*smollm2_eagle: eagle_aux_hidden_state_layer_ids"):
        load_eagle_head(shipped_head("smollm2"), target.shape, target.weights.lm_head, CPU, torch.float32)

"""EAGLE-3 heads as their authors publish them: config.json plus pytorch_model.bin with the names
midlayer.*, fc, norm, lm_head, d2t, t2d. Such a head drafts losslessly; the .bin is read with torch's
restricted unpickler, so a file that would run code (a REDUCE of os.system, any custom class) is
refused with a ModelLoadError and runs nothing."""

from __future__ import annotations

import json
import os
import pathlib
import pickle

import pytest
import torch
from engine_helpers import make_engine
from test_model_greedy_lossless import random_prompts

from verifypd.domain.requests import RequestSpec
from verifypd.model.eagle_head import head_state_dict, load_eagle_head, random_eagle_head, save_eagle_head
from verifypd.model.loader import ModelLoadError, load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(tiny_models[0], CPU, torch.float32)


def write_published_head(target, path: pathlib.Path, *, seed: int = 3) -> tuple[pathlib.Path, dict]:
    """A head in the published layout: pytorch_model.bin (a draft vocabulary: d2t and t2d too) and a
    config.json with the published keys (no target_hidden_size: it defaults to hidden_size)."""
    config, weights = random_eagle_head(target.shape, seed=seed, draft_vocab=64, std=0.3)
    state = head_state_dict(config, weights)
    path.mkdir(parents=True)
    torch.save(state, path / "pytorch_model.bin")
    raw = config.to_json()
    del raw["target_hidden_size"]
    (path / "config.json").write_text(json.dumps(raw))
    return path, state


def test_published_bin_head_loads_the_published_names(target, tmp_path):
    path, state = write_published_head(target, tmp_path / "head")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight"} <= set(state)
    config, weights = load_eagle_head(str(path), target.shape, target.weights.lm_head, CPU, torch.float32)
    assert config.draft_vocab_size == 64 and config.target_hidden_size == target.shape.hidden_size
    assert torch.equal(weights.fc, state["fc.weight"]) and torch.equal(weights.lm_head, state["lm_head.weight"])
    assert torch.equal(
        weights.layer.qkv[: state["midlayer.self_attn.q_proj.weight"].shape[0]],
        state["midlayer.self_attn.q_proj.weight"],
    )
    assert torch.equal(weights.draft_to_target, state["d2t"] + torch.arange(64))
    # the same head as model.safetensors loads the same tensors
    cfg2, from_safetensors = load_eagle_head(
        str(save_eagle_head(tmp_path / "st", config, weights)), target.shape, target.weights.lm_head, CPU, torch.float32
    )
    assert torch.equal(from_safetensors.layer.gate_up, weights.layer.gate_up) and cfg2 == config


@pytest.mark.slow
def test_published_bin_head_drafts_losslessly(tiny_models, target, tmp_path):
    path, _ = write_published_head(target, tmp_path / "head")
    prompts = random_prompts(6, seed=5)

    def generate(draft: str, k: int):
        done = make_engine(tiny_models[0], draft, k=k).generate(
            [RequestSpec(p, max_tokens=16, stop_at_eos=False) for p in prompts]
        )
        return [c.token_ids for c in done.values()], sum(c.usage["draft_tokens"] for c in done.values())

    expected, _ = generate("none", 0)
    tokens, drafted = generate(f"eagle:{path}", 3)
    assert tokens == expected
    assert drafted > 0


class RunsCode:
    """Unpickling calls os.system (a REDUCE of a global): what a malicious checkpoint does."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Custom:
    """Any class of the writer's: weights_only refuses its global."""

    def __init__(self):
        self.weight = torch.zeros(2)


def test_malicious_bin_is_refused_and_runs_nothing(target, tmp_path):
    marker = tmp_path / "ran"
    payloads = {
        "reduce_os_system": lambda p: torch.save({"fc.weight": RunsCode(marker)}, p),
        "custom_class": lambda p: torch.save({"fc.weight": Custom()}, p),
        "plain_pickle": lambda p: p.write_bytes(pickle.dumps({"fc.weight": RunsCode(marker)})),
    }
    for kind, write in payloads.items():
        path, _ = write_published_head(target, tmp_path / kind)
        write(path / "pytorch_model.bin")
        with pytest.raises(ModelLoadError, match=r"eagle:.*pytorch_model\.bin: (refused|not a readable)") as err:
            load_eagle_head(str(path), target.shape, target.weights.lm_head, CPU, torch.float32)
        assert "Traceback" not in str(err.value), kind
        assert not marker.exists(), f"{kind}: the file ran code"
    path, _ = write_published_head(target, tmp_path / "not_tensors")
    torch.save({"fc.weight": 3, "norm.weight": [1.0]}, path / "pytorch_model.bin")  # allowed types, not tensors
    with pytest.raises(ModelLoadError, match="refused, not a dict of named tensors"):
        load_eagle_head(str(path), target.shape, target.weights.lm_head, CPU, torch.float32)


def test_head_of_another_hidden_size_is_refused(target, tmp_path):
    path, _ = write_published_head(target, tmp_path / "head")
    raw = json.loads((path / "config.json").read_text())
    raw["hidden_size"] = target.shape.hidden_size * 2
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ModelLoadError, match=rf"hidden sizes .* must equal the target's hidden size {target.shape.hidden_size}"
    ):
        load_eagle_head(str(path), target.shape, target.weights.lm_head, CPU, torch.float32)


def test_head_without_weights_is_named(target, tmp_path):
    path, _ = write_published_head(target, tmp_path / "head")
    (path / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"no weights \(model\.safetensors or pytorch_model\.bin\)"):
        load_eagle_head(str(path), target.shape, target.weights.lm_head, CPU, torch.float32)

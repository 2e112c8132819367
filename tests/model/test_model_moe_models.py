"""Mixtral and Qwen3-MoE end to end on tiny random checkpoints written by transformers' save_pretrained
(per-expert tensor names on disk; transformers 5 models hold them stacked): the loader reads both
layouts to the same weights, our paged forward's logits match transformers' in float32 (reference
and Triton backends: the loop over experts and the grouped kernel), greedy decoding through the
engine (no speculation, a self-draft) reproduces `transformers.generate`, and tensor-parallel shards
of the experts sum to the whole layer."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from engine_helpers import DEVICE, hf_greedy, make_engine, write_tiny_llama
from family_checkpoints import write_tiny_moe
from paged_logits import relative_logit_errors
from test_model_greedy_lossless import random_prompts

from verifypd.domain.requests import RequestSpec
from verifypd.model.checkpoint import StateDictSource
from verifypd.model.families import shape_from_config, shard_rule, weights_from_source
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import ModelLoadError, load_model
from verifypd.model.moe import moe_forward

needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1",
)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    tok = write_tiny_llama(root / "tok", seed=0, layers=1)
    return {f: str(write_tiny_moe(root / f, f, tok, seed=4)) for f in ("mixtral", "qwen3_moe")}


@pytest.fixture(scope="module")
def hf_models(moe_models):
    from transformers import AutoModelForCausalLM

    return {f: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for f, p in moe_models.items()}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_both_name_layouts_load_the_same_weights(moe_models, hf_models, family):
    """The model's state dict (stacked experts) and the files on disk (per-expert names) agree."""
    from safetensors.torch import load_file

    hf = hf_models[family]
    shape = shape_from_config(hf.config, 256)
    assert shape.moe is not None and shape.qk_norm == (family == "qwen3_moe")
    assert shape.moe.dense_layers == ((1,) if family == "qwen3_moe" else ())
    on_disk = load_file(str(pathlib.Path(moe_models[family]) / "model.safetensors"))
    assert any(".experts.0." in n for n in on_disk) and not any("gate_up_proj" in n for n in on_disk)
    stacked = hf.state_dict()
    assert any(n.endswith("experts.gate_up_proj") for n in stacked)
    cpu = torch.device("cpu")
    a, b = (weights_from_source(StateDictSource(sd, cpu, torch.float32), shape, False) for sd in (on_disk, stacked))
    for la, lb in zip(a.layers, b.layers):
        assert (la.moe is None) == (lb.moe is None)
        if la.moe is not None and lb.moe is not None:
            assert la.gate_up is None and la.moe.gate_up.shape[0] == shape.moe.num_experts
            for name in ("router", "gate_up", "down"):
                assert torch.equal(getattr(la.moe, name), getattr(lb.moe, name)), name


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_logits_match_transformers(moe_models, hf_models, family, backend):
    """Two sequences prefilled together, then decoded together through the paged KV: every logit row
    against transformers'. The triton backend runs the experts through the grouped kernel."""
    loaded = load_model(moe_models[family], torch.device(DEVICE), torch.float32)
    model = PagedLlama(loaded.shape, loaded.weights, attention=backend)
    assert model.moe_path == ("grouped" if backend == "triton" else "reference")
    for err in relative_logit_errors(model, hf_models[family], decode_steps=4):
        assert err < 1e-5, f"{family}: relative logits error {err:.2e}"


@pytest.fixture(scope="module")
def references(hf_models):
    prompts = random_prompts(3, seed=31)
    out = {f: [hf_greedy(m, list(p), NEW_TOKENS) for p in prompts] for f, m in hf_models.items()}
    for family, outputs in out.items():
        assert len({t for o in outputs for t in o}) > 8, family  # not a model that repeats one token
        assert all(hf_models[family].config.eos_token_id not in o for o in outputs)  # engine ignores EOS
    return prompts, out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("draft,k", [("none", 0), ("self:1", 3)])
def test_greedy_matches_transformers(moe_models, references, family, draft, k):
    prompts, expected = references
    engine = make_engine(moe_models[family], draft, k=k)
    specs = [
        RequestSpec(list(p), max_tokens=NEW_TOKENS, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)
    ]
    done = engine.generate(specs)
    assert [done[str(i)].token_ids for i in range(len(prompts))] == expected[family]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_tensor_parallel_expert_shards_sum_to_the_layer(moe_models, hf_models, family):
    """Two ranks' expert slices, read through shard_rule from both name layouts, and cut by
    shard_weights: each rank's MoE output is a partial sum, and the two sum to the whole layer's."""
    from safetensors.torch import load_file

    from verifypd.model.tensor_parallel import shard_shape, shard_weights

    loaded = load_model(moe_models[family], torch.device("cpu"), torch.float32)
    shape, moe = loaded.shape, loaded.shape.moe
    assert moe is not None
    local = shard_shape(shape, 2)
    assert local.moe is not None and local.moe.intermediate_size * 2 == moe.intermediate_size
    layer = loaded.weights.layers[0].moe
    assert layer is not None
    x = torch.randn(9, shape.hidden_size, generator=torch.Generator().manual_seed(8))
    args = (moe.top_k, moe.normalize_topk, "silu")
    whole = moe_forward(x, layer, *args, float32_weights=moe.float32_weights)
    on_disk = load_file(str(pathlib.Path(moe_models[family]) / "model.safetensors"))
    for state in (on_disk, hf_models[family].state_dict()):
        parts = []
        for rank in range(2):
            src = StateDictSource(
                state, torch.device("cpu"), torch.float32, lambda n, dims: shard_rule(n, shape, dims), rank, 2
            )
            read = weights_from_source(src, local, False).layers[0].moe
            cut = shard_weights(shape, loaded.weights, rank, 2).layers[0].moe
            assert read is not None and cut is not None
            for name in ("router", "gate_up", "down"):
                assert torch.equal(getattr(read, name), getattr(cut, name)), name
            parts.append(moe_forward(x, read, *args, float32_weights=moe.float32_weights))
        assert ((parts[0] + parts[1] - whole).norm() / whole.norm()).item() < 1e-5


def test_sliding_window_qwen3_moe_is_refused(tmp_path, moe_models):
    import json

    config = json.loads((pathlib.Path(moe_models["qwen3_moe"]) / "config.json").read_text())
    config["use_sliding_window"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)

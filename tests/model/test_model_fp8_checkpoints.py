"""Published FP8 checkpoints (model.fp8_load): compressed-tensors ("FP8-dynamic" per channel, "FP8"
per tensor with static input scales) and FBGEMM fp8, written here in their layouts from a tiny random
Llama. The loaded projections are the file's bytes and scales, and the logits match a model over the
dequantized weights; broken or unsupported checkpoints are ModelLoadErrors naming the field."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from engine_helpers import write_tiny_llama
from fp8_checkpoints import KINDS, WEIGHTS, write_fp8
from safetensors.torch import load_file, save_file

from verifypd.model.fp8 import FP8, FP8_MAX, Fp8Weight
from verifypd.model.layout import TokenRun, build_layout
from verifypd.model.llama import BatchLayout, PagedLlama
from verifypd.model.loader import ModelLoadError, load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    return write_tiny_llama(tmp_path_factory.mktemp("fp8ckpt") / "llama", seed=5, layers=2)


def logits(model: PagedLlama, tokens: list[int]) -> torch.Tensor:
    s, block = model.shape, 4
    pool = torch.zeros(2, s.num_layers, 8, block, s.num_kv_heads, s.head_dim)
    lay = build_layout([TokenRun(tokens, 0, (2, 7, 0, 4))], block)
    t = torch.tensor
    batch = BatchLayout(
        t(lay.ids),
        t(lay.positions),
        t(lay.slots),
        t(lay.tables, dtype=torch.int32),
        t(lay.query_start, dtype=torch.int32),
        lay.max_query,
    )
    return model.forward(pool, batch, torch.arange(len(tokens)))


def reference_linear(x, w, bias=None):
    """model.fp8.linear in float32: fp8-rounded activations (per token, or by the static scale) times
    the dequantized weight."""
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w, bias)
    s = w.input_scale if w.input_scale is not None else x.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    xq = (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s
    return torch.nn.functional.linear(xq, w.dequantize(x.dtype), bias)


PROMPT = [5, 17, 40, 8, 9, 60, 33, 12, 70, 4]


@pytest.mark.parametrize("kind", KINDS)
def test_published_fp8_checkpoint_loads_as_written(tiny, tmp_path, kind, monkeypatch):
    written = write_fp8(tiny, tmp_path / kind, kind)
    loaded = load_model(str(tmp_path / kind), CPU, torch.float32)
    layer = loaded.weights.layers[1]
    p = "model.layers.1."
    qkv, down = layer.qkv, layer.down
    assert isinstance(qkv, Fp8Weight) and isinstance(down, Fp8Weight)
    parts = [written[p + f"self_attn.{x}_proj"] for x in "qkv"]
    # The file's fp8 bytes, fused in q, k, v order; each row with its own (or its tensor's) scale.
    want = torch.cat([t[p + f"self_attn.{x}_proj.weight"] for t, x in zip(parts, "qkv")])
    assert qkv.weight.view(torch.uint8).equal(want.view(torch.uint8))
    rows = [t[p + f"self_attn.{x}_proj.weight"].shape[0] for t, x in zip(parts, "qkv")]
    scales = [t[p + f"self_attn.{x}_proj.weight_scale"].reshape(-1).expand(n) for t, x, n in zip(parts, "qkv", rows)]
    assert qkv.scale.equal(torch.cat(scales))
    if kind == "ct-tensor":  # the largest of the fused parts' static scales
        inputs = [t[p + f"self_attn.{x}_proj.input_scale"] for t, x in zip(parts, "qkv")]
        assert qkv.input_scale is not None and qkv.input_scale.equal(torch.cat(inputs).amax())
        assert down.input_scale is not None and down.input_scale.equal(
            written[p + "mlp.down_proj"][p + "mlp.down_proj.input_scale"][0]
        )
    else:  # dynamic activations (fbgemm's input_scale_ub is not read)
        assert qkv.input_scale is None and down.input_scale is None
    assert loaded.weights.lm_head.dtype == torch.float32 and loaded.weights.embed.dtype == torch.float32
    model = PagedLlama(loaded.shape, loaded.weights)
    got = logits(model, PROMPT)
    monkeypatch.setattr("verifypd.model.llama.linear", reference_linear)
    torch.testing.assert_close(got, logits(model, PROMPT), rtol=1e-4, atol=1e-4)
    # And near the original high-precision model's logits (measured: 0.042 dynamic, 0.052 static).
    monkeypatch.undo()
    full = logits(PagedLlama(loaded.shape, load_model(str(tiny), CPU, torch.float32).weights), PROMPT)
    assert ((got - full).norm() / full.norm()).item() < 0.1


def test_fp8_checkpoint_with_quantization_flag_keeps_its_weights(tiny, tmp_path):
    written = write_fp8(tiny, tmp_path / "m", "ct-channel")
    loaded = load_model(str(tmp_path / "m"), CPU, torch.bfloat16, quantization="fp8")
    o = loaded.weights.layers[0].o
    name = "model.layers.0.self_attn.o_proj"
    assert isinstance(o, Fp8Weight)
    assert o.weight.view(torch.uint8).equal(written[name][name + ".weight"].view(torch.uint8))


def test_fp8_tensors_without_quantization_config_are_refused(tiny, tmp_path):
    write_fp8(tiny, tmp_path / "m", "ct-channel")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"q_proj.weight' is FP8 .*'quantization_config'"):
        load_model(str(tmp_path / "m"), CPU, torch.float32)


def test_missing_weight_scale_is_named(tiny, tmp_path):
    write_fp8(tiny, tmp_path / "m", "fbgemm")
    path = tmp_path / "m" / "model.safetensors"
    state = load_file(str(path))
    del state["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(state, str(path))
    with pytest.raises(ModelLoadError, match=r"no 'model.layers.0.mlp.down_proj.weight_scale'"):
        load_model(str(tmp_path / "m"), CPU, torch.float32)


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, r"'quantization_config.quant_method' 'gptq' is not supported"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}},
            },
            r"config_groups.g.weights': only 8-bit float",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {**WEIGHTS, "strategy": "block"}}},
            },
            r"weights.strategy' 'block' is not supported",
        ),
    ],
)
def test_unsupported_quantization_config_is_named(tiny, tmp_path, quantization_config, message):
    directory = tmp_path / "m"
    shutil.copytree(tiny, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(directory), CPU, torch.float32)

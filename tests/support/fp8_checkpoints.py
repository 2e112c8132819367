"""Published FP8 checkpoints written from a tiny high-precision one, in the layouts model.fp8_load
reads: compressed-tensors ("FP8-dynamic" per channel, "FP8" per tensor with static input scales) and
FBGEMM fp8."""

from __future__ import annotations

import json
import pathlib
import shutil

import torch
from safetensors.torch import load_file, save_file

from verifypd.model.fp8 import FP8, FP8_MAX

KINDS = ("ct-channel", "ct-tensor", "fbgemm")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


def compressed_tensors_config(strategy: str, static: bool) -> dict:
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token", "dynamic": not static}
    group = {"targets": ["Linear"], "weights": {**WEIGHTS, "strategy": strategy}, "input_activations": acts}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def write_fp8(src: pathlib.Path, dst: pathlib.Path, kind: str, seed: int = 0) -> dict[str, dict]:
    """`src` rewritten as a published FP8 checkpoint of `kind`; returns {module: its fp8 tensors}."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    written: dict[str, dict] = {}
    for name in [n for n in state if n.split(".")[-2] in PROJECTIONS]:
        w = state.pop(name).float()
        module = name.removesuffix(".weight")
        if kind == "ct-tensor":  # one scale for the whole tensor, stored as [1]
            scale = (w.abs().amax() / FP8_MAX).reshape(1)
            per_row = scale.expand(w.shape[0])
        else:  # per channel, stored [N, 1]
            per_row = w.abs().amax(1) / FP8_MAX
            scale = per_row[:, None]
        q = (w / per_row[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors = {name: q, module + ".weight_scale": scale.contiguous()}
        if kind == "ct-tensor":  # static activations: calibrated scales, different per projection
            tensors[module + ".input_scale"] = (torch.rand(1, generator=gen) * 0.01 + 0.005).reshape(1)
        if kind == "fbgemm":
            tensors[module + ".input_scale_ub"] = torch.tensor([1200.0])
        state.update(tensors)
        written[module] = tensors
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if kind == "fbgemm":
        config["quantization_config"] = {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ["lm_head"],
        }
    else:
        config["quantization_config"] = compressed_tensors_config(kind.removeprefix("ct-"), kind == "ct-tensor")
    (dst / "config.json").write_text(json.dumps(config))
    return written
